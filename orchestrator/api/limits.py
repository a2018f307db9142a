"""Limits on what a request may carry, before any route reads it.

* Body size: every route has a limit (``BODY_LIMIT``); agent reports get one of their
  own (``REPORT_BODY_LIMIT``), sized for the biggest a real agent sends: an evidence
  report carries up to 1 MiB characters of stacks (``EVIDENCE_REPORT_CAP``; JSON
  escapes newlines, so ~1.2 MB) plus findings and Flight Recorder summaries. A body
  over its limit is 413 naming the limit, refused from ``Content-Length`` before it is
  read, or (chunked) as soon as the bytes read pass it. Without this one
  node's token stored a 50 MB report.
* Header fields: at most ``Settings.max_headers`` (431); their size is h11's limit
  (``api/connections.py``).
* NUL in the path or the query: 422. PostgreSQL cannot compare text holding NUL, so
  ``/v1/jobs/%00`` reached the database as an error (500).
* A 422 never echoes a large input back: pydantic puts the whole offending value in
  each error's ``input`` (a bad 50 MB event came back as a 152 MB answer), so inputs
  are cut to ``ECHO_CHARS`` and at most ``MAX_ERRORS`` errors are listed.
"""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import unquote

from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.domain.spec import MAX_JSON_DEPTH

#: Every route's request body limit, in bytes (a job spec has its own, smaller one).
BODY_LIMIT = 1024 * 1024
#: An agent report's body limit (see the module docstring for its size).
REPORT_BODY_LIMIT = 4 * 1024 * 1024
#: Characters of an offending input a 422 shows.
ECHO_CHARS = 200
#: Errors a 422 lists (a list of 4096 bad items is 4096 errors).
MAX_ERRORS = 20


def body_limit_for(path: str) -> int:
    """The body limit of a request path."""
    if path.startswith("/v1/jobs/") and path.endswith("/reports"):
        return REPORT_BODY_LIMIT
    return BODY_LIMIT


def _mib(n: int) -> str:
    return f"{n} bytes ({n / 1024 / 1024:g} MiB)"


def _json(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


class RequestLimits:
    """ASGI middleware: body size limits and NUL-free URLs (the module docstring)."""

    def __init__(self, app: ASGIApp, max_headers: int = 100) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        query = unquote(scope.get("query_string", b"").decode("latin-1"))
        if "\x00" in path or "\x00" in query:
            where = "path" if "\x00" in path else "query string"
            loc = "path" if "\x00" in path else "query"
            error = {"loc": [loc], "msg": f"the URL's {where} holds a NUL character (%00)",
                     "type": "value_error"}  # fmt: skip
            await JSONResponse({"detail": [error]}, 422)(scope, receive, send)
            return
        if len(scope.get("headers") or ()) > self.max_headers:
            msg = f"the request has more than {self.max_headers} header fields"
            await _json(431, msg)(scope, receive, send)
            return
        limit = body_limit_for(path)
        what = f"{scope.get('method', '')} {path[:200]}"
        length = _content_length(scope)
        if length is not None and length > limit:
            msg = f"request body is {length} bytes; the limit for {what} is {_mib(limit)}"
            await _json(413, msg)(scope, receive, send)
            return
        if length is not None:  # the server reads exactly Content-Length bytes
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read the body here, up to the limit, and hand
        # the app what was read. Raising from ``receive`` instead does not work: the
        # HTTP middleware's task group wraps it, and FastAPI answers a vague 400.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                msg = f"request body is over {limit} bytes; the limit for {what} is {_mib(limit)}"
                await _json(413, msg)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers") or []:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _printable(x: Any) -> Any:
    """Strings with unpaired surrogates spelled as escapes: an answer is UTF-8, and
    one that echoed ``\udce4`` as it came failed to encode (a 500)."""
    if isinstance(x, str):
        return x.encode("utf-8", "backslashreplace").decode("utf-8") if not x.isascii() else x
    if isinstance(x, dict):
        return {_printable(k): _printable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_printable(v) for v in x]
    return x


def _short(x: Any) -> Any:
    """A value as a 422 may show it: JSON-safe (NaN spelled out), and cut when long."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    try:
        text = json.dumps(x, allow_nan=False, default=str)
    except (TypeError, ValueError, RecursionError):
        text = repr(x)
    else:
        if len(text) <= ECHO_CHARS:
            return x
    return f"{text[:ECHO_CHARS]}... ({len(text)} characters, cut)"


def validation_detail(errors: list[Any]) -> list[Any]:
    """pydantic's errors with every ``input`` (and ``ctx`` value) cut to ECHO_CHARS."""
    out: list[Any] = []
    for err in errors[:MAX_ERRORS]:
        e = dict(err)
        if "input" in e:
            e["input"] = _short(e["input"])
        if isinstance(e.get("ctx"), dict):
            e["ctx"] = {
                k: _short(str(v) if isinstance(v, Exception) else v) for k, v in e["ctx"].items()
            }
        out.append(e)
    if len(errors) > MAX_ERRORS:
        out.append({"loc": [], "msg": f"{len(errors) - MAX_ERRORS} more errors not shown",
                    "type": "too_many_errors"})  # fmt: skip
    return _printable(jsonable_encoder(out))


def validation_error_response(e: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": validation_detail(list(e.errors()))}, status_code=422)


async def http_error_handler(request: Request, e: Exception) -> Response:
    """FastAPI's own answer, but a body too deeply nested for ``json.loads`` (which
    recurses: about 1,000 levels) says so instead of "There was an error parsing the
    body"."""
    assert isinstance(e, StarletteHTTPException)
    if e.status_code == 400 and isinstance(e.__cause__, RecursionError):
        return _json(400, TOO_DEEP)
    if e.status_code == 422 and not isinstance(e.detail, list):
        # Every 422 has the one documented shape, a list of {loc, msg, type}: a route's
        # own check (a token's name, a chaos action) reads like a field's.
        error = {"loc": [], "msg": str(e.detail), "type": "value_error"}
        return JSONResponse({"detail": [error]}, 422, headers=e.headers)
    if e.status_code == 405:
        # Starlette names the methods of the first route whose path matched; a path
        # served by several routes (GET and POST /v1/jobs) allows all of theirs.
        allowed = _allowed_methods(request)
        if allowed:
            return JSONResponse(
                {"detail": str(e.detail)}, 405, headers={"Allow": ", ".join(allowed)}
            )
    return await http_exception_handler(request, e)


#: The answer to a body ``json.loads`` cannot read for its depth (every route's).
TOO_DEEP = (
    f"the JSON body is nested too deeply to read; request bodies may nest {MAX_JSON_DEPTH} levels"
)


def _allowed_methods(request: Request) -> list[str]:
    from starlette.routing import Match

    # Asked method by method: included routers nest, and each answers ``matches``.
    routes = request.app.router.routes
    return [
        m
        for m in ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
        if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)
    ]


async def validation_error_handler(_request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError)
    return validation_error_response(e)
