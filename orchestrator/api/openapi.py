"""The OpenAPI document says what the service does, not only what FastAPI infers.

FastAPI documents a route's 200/201 and, when it has validated parameters, a 422;
it knew nothing of the job spec (``POST /v1/jobs`` reads its body itself, as JSON or
YAML), of who may call, or of the 4xx answers the routes and middleware give. So a
fuzzer never generated a job spec, and a client could not learn that a 401 or 413
was possible. :func:`install` wraps ``app.openapi`` to add, once per app:

* the job spec's JSON Schema as the request body of ``POST /v1/jobs`` and
  ``POST /v1/jobs/render`` (``application/json``; YAML as a string);
* the bearer scheme, on every operation that needs a token (``/v1/`` but the
  anonymous agent package routes);
* the 4xx (and 503) answers each operation can give, with the two shapes they come
  in: ``{"detail": "<why>"}``, and for 422 a list of ``{loc, msg, type}``
  (``limits.http_error_handler`` turns every 422 into that list).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from orchestrator.domain.spec import JobSpec

ERROR = {
    "title": "Error",
    "type": "object",
    "required": ["detail"],
    "properties": {"detail": {"type": "string", "description": "what is wrong, in words"}},
}
INVALID = {
    "title": "Invalid",
    "type": "object",
    "required": ["detail"],
    "properties": {
        "detail": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["loc", "msg"],
                "properties": {
                    "loc": {"type": "array", "items": {"anyOf": [{"type": "string"},
                                                                 {"type": "integer"}]}},
                    "msg": {"type": "string"},
                    "type": {"type": "string"},
                },
            },
        }
    },
}  # fmt: skip

_WHY = {
    "400": "the body cannot be read (JSON nested too deeply)",
    "401": "no token, or an unknown or revoked one",
    "403": "the token's role is too low for this operation",
    "404": "no such job, attempt, node or token",
    "409": "the operation conflicts with the current state (not the current attempt, a "
    "reused Idempotency-Key, an illegal transition)",
    "413": "the body is over this route's limit",
    "415": "the body is neither JSON nor YAML",
    "422": "an input is invalid (the list names each one)",
    "431": "the request has too many header fields",
    "503": "not available now (the agent wheel is being built or failed to build; "
    "heartbeats under back-pressure: Retry-After)",
}

#: Operations whose body is a job spec, read by the route itself.
SPEC_BODY_ROUTES = (("/v1/jobs", "post"), ("/v1/jobs/render", "post"))


def _answers(path: str, method: str, secured: bool, op: dict[str, Any]) -> list[str]:
    codes = ["422", "431"]
    if secured:
        codes += ["401", "403"]
    if path.startswith("/v1/"):  # an id in the path, or in the body (a webhook's job)
        codes += ["404", "409"]
    if method in ("post", "put", "patch", "delete"):
        codes += ["400", "413"]
    if (path, method) in SPEC_BODY_ROUTES:
        codes.append("415")
    if path.startswith("/v1/agent/") or path.endswith("/heartbeat"):
        codes.append("503")
    return codes


def _document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    spec = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(spec.pop("$defs", {}))
    schemas["JobSpec"] = spec
    schemas["Error"] = ERROR
    schemas["Invalid"] = INVALID
    doc["components"]["securitySchemes"] = {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "an operator token (viewer reads, operator writes, admin "
            "manages tokens) or, on a node's routes, its agent token",
        }
    }
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            secured = path.startswith("/v1/") and not path.startswith("/v1/agent/")
            if secured:
                op["security"] = [{"bearer": []}]
            if (path, method) in SPEC_BODY_ROUTES:
                op["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
                        "application/yaml": {"schema": {"type": "string"}},
                    },
                }
            responses = op.setdefault("responses", {})
            for code in _answers(path, method, secured, op):
                shape = "Invalid" if code == "422" else "Error"
                responses[code] = {
                    "description": _WHY[code],
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}
                    },
                }
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    return doc


def install(app: FastAPI) -> None:
    """Serve the completed document at ``/openapi.json`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
