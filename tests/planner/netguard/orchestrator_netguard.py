"""Refuse non-loopback sockets (connect and name lookups) in this process."""

from __future__ import annotations

import socket
from collections.abc import Callable

LOOPBACK = {"127.0.0.1", "::1", "localhost", "0.0.0.0", ""}


class NetworkBlocked(OSError):
    """A test tried to reach the network."""


def _host(address: object) -> str | None:
    if isinstance(address, tuple) and address:
        return str(address[0])
    return None  # AF_UNIX paths and the like are local


def install() -> Callable[[], None]:
    """Patch the socket module; returns the function that undoes it."""
    if getattr(socket, "_skyresume_guard", False):
        return lambda: None
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def connect(self: socket.socket, address: object) -> None:
        host = _host(address)
        if host is not None and host not in LOOPBACK and not host.startswith("127."):
            raise NetworkBlocked(f"network blocked in tests: connect to {address!r}")
        return real_connect(self, address)  # type: ignore[arg-type]

    def connect_ex(self: socket.socket, address: object) -> int:
        host = _host(address)
        if host is not None and host not in LOOPBACK and not host.startswith("127."):
            raise NetworkBlocked(f"network blocked in tests: connect to {address!r}")
        return real_connect_ex(self, address)  # type: ignore[arg-type]

    def getaddrinfo(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        h = host.decode() if isinstance(host, bytes) else host
        if h is not None and h not in LOOPBACK and not str(h).startswith("127."):
            raise NetworkBlocked(f"network blocked in tests: name lookup of {h!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    socket.getaddrinfo = getaddrinfo
    socket._skyresume_guard = True  # type: ignore[attr-defined]

    def undo() -> None:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
        socket.socket.connect_ex = real_connect_ex  # type: ignore[method-assign]
        socket.getaddrinfo = real_getaddrinfo
        socket._skyresume_guard = False  # type: ignore[attr-defined]

    return undo
