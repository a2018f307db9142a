"""What a connection may cost the service before it has sent a whole request.

uvicorn (0.35) has a keep-alive timeout between requests and h11's limit on an
incomplete request head, but nothing that bounds how long a client may take to send
its headers or its body: a connection that sends nothing, or one header byte a
minute (slowloris), was held for ever, and 20,000 of them took every file
descriptor, so normal requests were reset. No login is needed to open one.

:class:`GuardedH11Protocol` is uvicorn's own h11 protocol with three additions, all
from ``Settings``:

* a **read deadline per phase**: the request head must be complete within
  ``header_timeout_s`` of the connection opening (or of the first byte of the next
  request on a kept-alive connection), the body within ``body_timeout_s`` of the
  head; past it the connection is closed. While the app handles a request, no
  deadline runs (a slow handler is not the client's fault);
* a **connection cap**, ``max_connections``: one more is closed as it is accepted;
* the head's size, ``max_header_bytes`` (h11's ``max_incomplete_event_size``: a
  longer head is a 400 before more of it is buffered, where httptools buffered 50 MB).

The header count (``max_headers``) is checked by ``api/limits.RequestLimits`` (431).
:func:`uvicorn_config` is the one place ``serve`` (and the tests) build uvicorn's
``Config``, so what runs is what is tested.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    import uvicorn

    from orchestrator.settings import Settings


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and a connection cap (module doc)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096

    _phase: str | None = None
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # connection_lost runs and forgets it
            return
        self._follow_phase()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_phase()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._follow_phase()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _follow_phase(self) -> None:
        """Arm the deadline of what the client owes now: a head (h11 IDLE on its side),
        a body (SEND_BODY), or nothing (the app has the request)."""
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return  # the same phase keeps its deadline: trickled bytes do not extend it
        self._cancel_deadline()
        self._phase = phase
        if phase is not None:
            seconds = self.header_timeout_s if phase == "head" else self.body_timeout_s
            self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self._phase == phase and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(settings: Settings) -> type[GuardedH11Protocol]:
    """The protocol class with ``settings``' limits (uvicorn builds one per connection
    from the class it is given, so the limits are class attributes)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout_s": settings.header_timeout_s,
            "body_timeout_s": settings.body_timeout_s,
            "max_connections": settings.max_connections,
        },
    )


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's ``Config`` for ``app`` with every limit from ``settings`` and forwarded
    headers believed only from ``trusted_proxies``."""
    import uvicorn

    trusted = [p.strip() for p in settings.trusted_proxies.split(",") if p.strip()]
    kw: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": "warning",
        "ssl_certfile": settings.tls_cert,
        "ssl_keyfile": settings.tls_key,
        "http": guarded_protocol(settings),
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "timeout_keep_alive": settings.keep_alive_s,
        # uvicorn's default believes X-Forwarded-For from 127.0.0.1: a local process
        # could then set a node's stored address (its MASTER_ADDR on a relaunch).
        "proxy_headers": bool(trusted),
        "forwarded_allow_ips": trusted or None,
        "server_header": False,
    }
    kw.update(overrides)
    return uvicorn.Config(app, **kw)
