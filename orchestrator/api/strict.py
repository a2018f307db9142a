"""Operator routes refuse query parameters they do not have.

FastAPI ignores an unknown query parameter, so ``GET /v1/jobs?limt=5`` answers as if no
limit were asked for. The operator-facing routers use :class:`StrictQueryRoute`, which
answers 422 naming each unknown parameter, as an unknown field of a JSON body is
answered (``extra="forbid"``). The agents' routes stay lenient: an older agent may
send what a newer service no longer reads.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response


def query_names(dependant: Dependant) -> frozenset[str]:
    """Every query parameter a route reads, its dependencies' included."""
    names: set[str] = set()
    stack = [dependant]
    while stack:
        d = stack.pop()
        names.update(f.alias for f in d.query_params)
        stack.extend(d.dependencies)
    return frozenset(names)


class StrictQueryRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        allowed = query_names(self.dependant)

        async def strict(request: Request) -> Response:
            unknown = sorted(set(request.query_params) - allowed)
            if unknown:
                raise RequestValidationError(
                    [
                        {
                            "loc": ("query", name),
                            "msg": "unknown query parameter"
                            + (
                                f" (this route takes: {', '.join(sorted(allowed))})"
                                if allowed
                                else " (this route takes none)"
                            ),
                            "type": "extra_forbidden",
                            "input": request.query_params.get(name),
                        }
                        for name in unknown
                    ]
                )
            return await handler(request)

        return strict
