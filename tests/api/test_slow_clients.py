"""The service as ``serve`` runs it (uvicorn with ``api/connections.uvicorn_config``),
over real sockets: slow and idle clients cannot starve it, a head too large is
refused before it is buffered, and ``X-Forwarded-For`` sets nothing unless a proxy
the operator named sent it.

The limits under test are the configured ones, set small here so the claims are
quick to check: a head deadline of ``HEAD_TIMEOUT_S``; every idle connection must be
closed by ``HEAD_TIMEOUT_S + CLOSE_MARGIN_S`` (the margin is generous: a loaded CI
machine runs eight test sessions at once)."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from testkit import job_with_running_attempt, served

from orchestrator import __version__
from orchestrator.contract import AGENT_PROTOCOL

HEAD_TIMEOUT_S = 3.0
CLOSE_MARGIN_S = 5.0
IDLE = 500


@pytest.fixture
def plain(tmp_path):  # type: ignore[no-untyped-def]
    """An app on SQLite: the connection limits touch no store, one database is enough."""
    from orchestrator.app import create_app
    from orchestrator.settings import Settings
    from orchestrator.store import db

    url = f"sqlite:///{tmp_path / 'limits.db'}"
    db.upgrade(url)
    settings = Settings(home=tmp_path / "home", database_url=url)
    application = create_app(settings)
    yield application, settings
    application.state.engine.dispose()


def _settings(settings: Any, **kw: Any) -> Any:
    return settings.model_copy(update={"header_timeout_s": HEAD_TIMEOUT_S, **kw})


def _wait_closed(socks: list[socket.socket], until: float) -> list[socket.socket]:
    """The sockets the server has not closed by ``until`` (EOF or reset read)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    open_ = set(socks)
    while open_ and time.monotonic() < until:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if not data:
                sel.unregister(s)
                open_.discard(s)
    sel.close()
    return list(open_)


def test_idle_and_slowloris_connections_do_not_starve_an_authenticated_call(plain):
    app, settings = plain
    auth = {"Authorization": f"Bearer {app.state.token}"}
    with served(app, _settings(settings)) as url:
        host, port = url.removeprefix("http://").split(":")
        # Warm (the first call opens the pool's connection): the claim is about the
        # idle connections' cost, not a cold start's.
        assert httpx.get(f"{url}/v1/jobs", headers=auth, timeout=30).status_code == 200
        idle = [socket.create_connection((host, int(port))) for _ in range(IDLE)]
        time.sleep(0.5)  # let the server accept them all before the call
        loris = socket.create_connection((host, int(port)))
        loris.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        stop = threading.Event()

        def trickle() -> None:  # one byte of header every 0.5 s, never the blank line
            while not stop.wait(0.5):
                with contextlib.suppress(OSError):
                    loris.sendall(b"a")

        threading.Thread(target=trickle, daemon=True).start()
        opened = time.monotonic()
        try:
            t0 = time.perf_counter()
            r = httpx.get(f"{url}/v1/jobs", headers=auth, timeout=10)
            took = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            assert took < 1.0, f"an authenticated call took {took:.2f} s beside {IDLE} idle"
            left = _wait_closed([*idle, loris], opened + HEAD_TIMEOUT_S + CLOSE_MARGIN_S)
            assert not left, f"{len(left)} of {IDLE + 1} idle connections still open"
        finally:
            stop.set()
            for s in [*idle, loris]:
                s.close()


def test_a_head_over_the_limit_is_refused_before_it_is_buffered(plain):
    app, settings = plain
    with served(app, _settings(settings, max_header_bytes=16 * 1024)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 64 * 1024)
            answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("trusted", ["", "127.0.0.1"], ids=["no-proxy", "trusted-proxy"])
def test_a_forwarded_for_header_sets_a_nodes_address_only_from_a_trusted_proxy(
    app, settings, trusted
):
    from orchestrator.store.models import Node

    job = job_with_running_attempt(app)
    body = {"node_rank": 0, "ranks": [], "agent_version": __version__, "protocol": AGENT_PROTOCOL}
    with served(app, _settings(settings, trusted_proxies=trusted)) as url:
        r = httpx.post(
            f"{url}/v1/jobs/{job}/attempts/1/nodes/n0/register",
            json=body,
            headers={"Authorization": f"Bearer {app.state.token}", "X-Forwarded-For": "10.9.9.9"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    with app.state.sessionmaker() as s:
        node = s.query(Node).filter_by(job_id=job, node_id="n0").one()
        seen = node.progress["client_ip"]
    assert seen == ("10.9.9.9" if trusted else "127.0.0.1")
