"""The agent obeys the service's back-pressure: a 503 with ``Retry-After`` (or a 429)
delays its next heartbeat by that long with jitter, is never logged as the service
being unreachable, and a longer ``interval_s`` in an answer becomes its period.

The service here is a scripted stdlib HTTP server (the answers are the point, and the
real route's answers are tested in tests/api/test_heartbeat_backpressure.py); the
agent, its client and its heartbeat loop are the real ones."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from orchestrator.agent import client as cl
from orchestrator.agent.main import Agent, AgentConfig


class _Script:
    """What the server answers, beat after beat, and when each beat came."""

    def __init__(self, answers: list[tuple[int, dict[str, str], dict[str, Any]]]) -> None:
        self.answers = answers
        self.arrivals: list[float] = []
        self.lock = threading.Lock()

    def next(self) -> tuple[int, dict[str, str], dict[str, Any]]:
        with self.lock:
            self.arrivals.append(time.monotonic())
            return self.answers.pop(0) if self.answers else (200, {}, {})


@pytest.fixture
def scripted() -> Iterator[tuple[str, list[_Script]]]:
    scripts: list[_Script] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            node = self.path.split("/nodes/")[1].split("/")[0]
            status, headers, body = scripts[int(node[1:])].next()
            raw = json.dumps(body).encode()
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *_a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", scripts
    server.shutdown()


def _beating(url: str, k: int, tmp_path) -> Agent:  # type: ignore[no-untyped-def]
    cfg = AgentConfig(
        job_id="j", attempt=1, node_id=f"n{k}", node_rank=k, nnodes=2, nproc_per_node=1,
        command=("true",), service_url=url, local_dir=tmp_path / f"n{k}",
        log_dir=tmp_path / f"n{k}", heartbeat_s=0.2,
    )  # fmt: skip
    agent = Agent(cfg, token="t", environ={})
    agent._registered.set()
    threading.Thread(target=agent._heartbeat_loop, name=f"hb{k}", daemon=True).start()
    return agent


def _gaps(s: _Script) -> list[float]:
    return [b - a for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)]


def _wait_for(s: _Script, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(s.arrivals) < n:
        assert time.monotonic() < deadline, f"only {len(s.arrivals)} of {n} beats came"
        time.sleep(0.02)


def test_a_refused_beat_waits_what_the_service_asked_with_jitter_and_is_no_outage(
    scripted, tmp_path, caplog
):
    url, scripts = scripted
    busy = (503, {"Retry-After": "1"}, {"detail": "behind", "interval_s": 1.0})
    scripts += [_Script([busy]), _Script([busy])]
    caplog.set_level(logging.INFO, logger="skyresume.agent")
    agents = [_beating(url, k, tmp_path) for k in (0, 1)]
    try:
        for s in scripts:
            _wait_for(s, 3)
    finally:
        for a in agents:
            a._exit.set()
    refused_gaps = [_gaps(s)[0] for s in scripts]
    # What was asked (1 s), stretched by up to half at random: never sooner.
    assert all(0.98 <= g <= 1.5 + 0.3 for g in refused_gaps), refused_gaps
    assert abs(refused_gaps[0] - refused_gaps[1]) > 0.001, "two refused agents came back in step"
    # Then the agent's own period again (0.2 s), not a lasting slowdown.
    assert all(_gaps(s)[1] < 0.6 for s in scripts), [_gaps(s) for s in scripts]
    assert "unreachable" not in caplog.text and "service busy" in caplog.text


def test_a_longer_interval_in_the_answer_becomes_the_period(scripted, tmp_path):
    url, scripts = scripted
    slower = (200, {}, {"interval_s": 0.6})
    scripts.append(_Script([slower, slower]))
    agent = _beating(url, 0, tmp_path)
    try:
        _wait_for(scripts[0], 3)
    finally:
        agent._exit.set()
    gaps = _gaps(scripts[0])[:2]
    assert all(0.6 * 0.9 - 0.02 <= g <= 0.6 * 1.1 + 0.3 for g in gaps), gaps


@pytest.mark.parametrize(
    ("status", "headers", "body", "want"),
    [
        (429, {}, {}, 1.0),
        (429, {"Retry-After": "3"}, {}, 3.0),
        (503, {}, {"interval_s": 4.0}, 4.0),
    ],
    ids=["429-bare", "429-retry-after", "503-interval-in-body"],
)
def test_the_client_reads_back_pressure_as_busy_not_as_an_outage(
    scripted, status, headers, body, want
):
    url, scripts = scripted
    scripts.append(_Script([(status, headers, body)]))
    c = cl.ServiceClient(url, "t", job_id="j", attempt=1, node_id="n0")
    with pytest.raises(cl.Busy) as e:
        c.heartbeat({})
    assert e.value.retry_after_s == want


def test_a_plain_503_is_still_an_outage(scripted):
    # No Retry-After and no interval: the service failed, it did not ask for less.
    url, scripts = scripted
    scripts.append(_Script([(503, {}, {"detail": "boom"})]))
    c = cl.ServiceClient(url, "t", job_id="j", attempt=1, node_id="n0")
    with pytest.raises(cl.Unreachable) as e:
        c.heartbeat({})
    assert not isinstance(e.value, cl.Busy)


def _beating_slowly(url: str, tmp_path) -> Agent:  # type: ignore[no-untyped-def]
    cfg = AgentConfig(
        job_id="j", attempt=1, node_id="n0", node_rank=0, nnodes=2, nproc_per_node=2,
        command=("true",), service_url=url, local_dir=tmp_path / "n0",
        log_dir=tmp_path / "n0", heartbeat_s=5.0,
    )  # fmt: skip
    agent = Agent(cfg, token="t", environ={})
    agent._registered.set()
    threading.Thread(target=agent._heartbeat_loop, name="hb-slow", daemon=True).start()
    return agent


def test_a_rank_that_regroups_resumes_or_steps_past_its_resume_is_heard_at_once(
    scripted, tmp_path
):
    url, scripts = scripted
    scripts.append(_Script([]))
    agent = _beating_slowly(url, tmp_path)
    try:
        _wait_for(scripts[0], 1)
        for kind, step in (("regroup", 30), ("resumed", 30), ("progress", 31)):
            beats = len(scripts[0].arrivals)
            asked = time.monotonic()
            for rank in (0, 1):  # both ranks of the node, a moment apart: one beat
                doc = {"type": kind, "rank": rank, "generation": 2, "step": step}
                agent.board.ingest(json.dumps(doc).encode())
            _wait_for(scripts[0], beats + 1, timeout=2.0)
            assert scripts[0].arrivals[-1] - asked < 1.0  # the period is 5 s
            time.sleep(0.5)
            assert len(scripts[0].arrivals) == beats + 1
    finally:
        agent._exit.set()
        agent._beat_soon.set()


def test_a_busy_services_wait_is_not_cut_short_by_a_regroup(scripted, tmp_path):
    url, scripts = scripted
    busy = (503, {"Retry-After": "2"}, {"detail": "behind"})
    scripts.append(_Script([busy]))
    agent = _beating_slowly(url, tmp_path)
    try:
        _wait_for(scripts[0], 1)
        agent.board.ingest(json.dumps({"type": "regroup", "rank": 0, "generation": 2}).encode())
        time.sleep(1.0)
        assert len(scripts[0].arrivals) == 1  # the service asked for 2 s at least
        _wait_for(scripts[0], 2, timeout=5.0)
        assert scripts[0].arrivals[1] - scripts[0].arrivals[0] >= 1.95
    finally:
        agent._exit.set()
        agent._beat_soon.set()
