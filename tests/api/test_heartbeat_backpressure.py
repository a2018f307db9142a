"""The heartbeat route under load, through the real app on SQLite and PostgreSQL:
refused fast (503 + Retry-After) while the event loop lags, a longer period in every
answer once the fleet is big, and the fleet's intake as the reconciler samples it."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from testkit import job_spec

from orchestrator import __version__
from orchestrator.api import backpressure as bp
from orchestrator.api.backpressure import HeartbeatAdmission, Pressure
from orchestrator.contract import AGENT_PROTOCOL
from orchestrator.store import intake
from orchestrator.store.models import Attempt, Node

AGENT = {"agent_version": __version__, "agent_build": "source", "protocol": AGENT_PROTOCOL}


def url(job_id: str, node: str) -> str:
    return f"/v1/jobs/{job_id}/attempts/1/nodes/{node}"


def register(client: TestClient, job_id: str, node: str) -> dict[str, Any]:
    body = {"node_rank": int(node[1:]), "hostname": "h", "ranks": [], **AGENT}
    r = client.post(url(job_id, node) + "/register", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def beat(client: TestClient, job_id: str, node: str) -> Any:
    return client.post(url(job_id, node) + "/heartbeat", json={"state": "running", "ranks": []})


@pytest.fixture
def job(client: TestClient) -> Iterator[str]:
    client.app.state.liveness.hold()  # type: ignore[attr-defined]
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    with client.app.state.sessionmaker() as s, s.begin():  # type: ignore[attr-defined]
        s.add(
            Attempt(
                job_id=job_id, number=1, cloud="local", region="local", instance_type="cpu",
                num_nodes=3, spot=True, knobs={}, started_at=datetime.now(UTC),
                state="running", launcher="local",
            )
        )  # fmt: skip
    yield job_id


def test_a_small_fleet_beats_at_the_base_period(client, job):
    assert register(client, job, "n0")["heartbeat_s"] == 1.0
    r = beat(client, job, "n0")
    assert r.status_code == 200 and r.json() == {}


def test_a_big_fleet_is_told_a_longer_period_in_every_answer(client, job):
    client.app.state.liveness.fleet_nodes = 2048  # what the flush counts at that size
    assert register(client, job, "n0")["heartbeat_s"] == 8.0
    assert beat(client, job, "n0").json() == {"interval_s": 8.0}


def test_the_fleet_size_counts_registered_nodes_before_their_first_beat(client, job):
    live = client.app.state.liveness
    for n in ("n0", "n1", "n2"):
        register(client, job, n)
    assert live.flush()
    assert live.fleet_nodes == 3  # a big fleet's first beats are told its period
    assert beat(client, job, "n0").status_code == 200
    assert live.flush() and live.fleet_nodes == 3


def test_a_refused_beat_is_503_with_retry_after_and_never_reaches_the_route(client, job):
    register(client, job, "n0")
    assert beat(client, job, "n0").status_code == 200
    first = client.app.state.liveness.latest(job, "n0")
    pressure = client.app.state.pressure
    assert pressure.max_lag_s is None  # an embedded app never refuses; serve arms it
    pressure.arm(-1.0)  # any lag at all is too much: beats are refused
    r = beat(client, job, "n0")  # n0 was heard just now: this beat is an extra
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1" and r.json()["interval_s"] == 1.0
    assert "the event loop is" in r.json()["detail"]
    assert client.app.state.liveness.latest(job, "n0") is first  # not recorded
    assert client.get(f"/v1/jobs/{job}").status_code == 200  # other routes are served
    metrics = client.get("/metrics").text
    assert 'skyresume_heartbeats_refused_total{signal="lag"} 1.0' in metrics
    assert "skyresume_heartbeat_interval_seconds 10.0" in metrics  # behind: the longest


def test_while_behind_a_node_not_heard_for_half_its_period_is_still_admitted(client, job):
    # Shedding takes extra beats, never a node's only one: refusing by time alone
    # would leave some healthy nodes unheard while their peers are heard, which
    # ``domain.silence`` reads, rightly, as a node gone quiet.
    register(client, job, "n0")
    register(client, job, "n1")
    assert beat(client, job, "n0").status_code == 200
    client.app.state.pressure.arm(-1.0)
    assert beat(client, job, "n1").status_code == 200  # never heard: it needs the beat
    assert beat(client, job, "n0").status_code == 503  # heard just now: an extra
    live = client.app.state.liveness
    with live._lock:  # n0's beat half a period (0.5 s of 1 s) old
        b = live._latest[(job, "n0")]
        live._latest[(job, "n0")] = replace(b, at=b.at - timedelta(seconds=0.6))
    r = beat(client, job, "n0")
    assert r.status_code == 200 and r.json() == {"interval_s": 10.0}  # told to beat less


def test_connections_waiting_in_the_accept_queue_mean_the_service_is_behind():
    """A real listening socket: connections the kernel completed that nobody accepted."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    clients = [socket.create_connection(srv.getsockname()) for _ in range(5)]
    try:
        assert bp.accept_queue([srv]) == 5
        srv.accept()[0].close()
        assert bp.accept_queue([srv]) == 4
    finally:
        for c in clients:
            c.close()
        srv.close()
    assert bp.accept_queue([srv]) is None  # closed: unknown, never "none waiting"


def test_the_accept_queues_peak_of_the_last_second_counts():
    # asyncio accepts every waiting connection at once: a reading taken as a beat
    # arrives is short, so the probe thread's recent peak is what says "behind".
    pressure = Pressure(lambda: 10)
    pressure.arm(10.0, max_accept_queue=64)
    t = time.monotonic()
    pressure.note_accept_queue(900, now=t)
    pressure.note_accept_queue(0, now=t + 0.001)
    assert pressure.behind() == ("accept_queue", "900 connections wait to be accepted")
    pressure.note_accept_queue(3, now=t + 5.0)  # the 900 is more than a second older
    assert pressure.accept_queue == 3 and pressure.behind() is None
    pressure.note_accept_queue(None)
    assert pressure.accept_queue is None  # unreadable: unknown, not zero


def test_serve_arms_a_probe_thread_that_reads_the_listening_socket():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    clients = [socket.create_connection(srv.getsockname()) for _ in range(3)]
    pressure = Pressure(lambda: 10)
    try:
        pressure.arm(10.0, sockets=[srv], max_accept_queue=2)
        deadline = time.monotonic() + 10.0
        while pressure.accept_queue is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pressure.accept_queue == 3
        assert pressure.behind() == ("accept_queue", "3 connections wait to be accepted")
    finally:
        pressure.disarm()
        for c in clients:
            c.close()
        srv.close()


def test_too_many_beats_in_flight_mean_the_service_is_behind():
    pressure = Pressure(lambda: 10)
    pressure.arm(10.0, max_in_flight=2)
    pressure.in_flight = 3
    assert pressure.behind() == ("in_flight", "3 heartbeats are in flight")


def test_while_the_event_loop_lags_beats_are_refused_and_other_requests_pass():
    """A real lag: the loop is blocked for 0.8 s, as a starved or busy service's is."""
    reached: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(mw: HeartbeatAdmission, path: str) -> int:
        sent: list[dict[str, Any]] = []

        async def send(m: dict[str, Any]) -> None:
            sent.append(m)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}"}

        await mw({"type": "http", "method": "POST", "path": path}, receive, send)
        return int(sent[0]["status"])

    async def main() -> list[int]:
        mw = HeartbeatAdmission(inner, pressure=Pressure(lambda: 10, max_lag_s=0.5))
        beat_path = "/v1/jobs/j/attempts/1/nodes/n0/heartbeat"
        first = await call(mw, beat_path)  # starts the probe; no lag yet
        await asyncio.sleep(0.1)
        time.sleep(0.8)  # the loop runs nothing for 0.8 s
        late = [await call(mw, beat_path), await call(mw, "/v1/jobs/j/attempts/1/nodes/n0/reports")]
        await asyncio.sleep(0.2)  # the loop catches up: the probe measures again
        return [first, *late, await call(mw, beat_path)]

    assert asyncio.run(main()) == [200, 503, 200, 200]
    assert reached.count("/v1/jobs/j/attempts/1/nodes/n0/heartbeat") == 2


def test_the_fleet_intake_counts_nodes_heard_in_the_window_memory_included(client, job):
    maker = client.app.state.sessionmaker
    for n in ("n0", "n1", "n2"):
        register(client, job, n)
    with maker() as s, s.begin():  # SQL says all three were last heard 2 minutes ago
        old = datetime.now(UTC) - timedelta(seconds=120)
        s.execute(update(Node).where(Node.job_id == job).values(last_heartbeat_at=old))
    client.app.state.liveness.flush()
    for n in ("n0", "n1"):  # two beat now; their beats wait in the batch
        assert beat(client, job, n).status_code == 200
    with maker() as s:
        smp = intake.fleet_intake(s, datetime.now(UTC), window_s=4.0)
    assert (smp.heard, smp.expected) == (2, 3)
    with maker() as s:
        later = intake.fleet_intake(s, datetime.now(UTC) + timedelta(seconds=10), window_s=4.0)
    assert (later.heard, later.expected) == (0, 3)


def test_each_intake_sample_counts_the_nodes_heard_since_the_one_before(client, job):
    # ``fresh``: the beats taken in over the interval, what ``domain.silence`` weighs a
    # silent node's silence against. The first sample has nothing to compare with.
    maker = client.app.state.sessionmaker
    for n in ("n0", "n1", "n2"):
        register(client, job, n)
    seen: dict[tuple[str, str, int], datetime] = {}
    with maker() as s:
        first = intake.fleet_intake(s, datetime.now(UTC), 4.0, seen)
        again = intake.fleet_intake(s, datetime.now(UTC), 4.0, seen)
    assert (first.fresh, again.fresh) == (0, 0)
    time.sleep(0.01)
    for n in ("n0", "n2"):
        assert beat(client, job, n).status_code == 200
    with maker() as s:
        after = intake.fleet_intake(s, datetime.now(UTC), 4.0, seen)
        then = intake.fleet_intake(s, datetime.now(UTC), 4.0, seen)
    assert (after.fresh, after.expected, then.fresh) == (2, 3, 0)


def test_beats_waiting_long_for_their_commit_mean_the_service_is_behind(client, job):
    # SQL is what other replicas' reconcilers read: a late flush there is silence.
    live, pressure = client.app.state.liveness, client.app.state.pressure
    register(client, job, "n0")
    assert live.flush()
    pressure.arm(10.0, max_unflushed_s=0.05)
    assert pressure.behind() is None  # nothing waits for a commit
    assert beat(client, job, "n0").status_code == 200  # waits in the batch
    time.sleep(0.1)
    signal, why = pressure.behind() or ("", "")
    assert signal == "flush" and "for their commit" in why
    assert live.flush()
    assert live.unflushed_s == 0.0 and pressure.behind() is None
