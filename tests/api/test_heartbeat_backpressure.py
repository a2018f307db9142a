"""The heartbeat route under load, through the real app on SQLite and PostgreSQL:
refused fast (503 + Retry-After) while the event loop lags, a longer period in every
answer once the fleet is big, and the fleet's intake as the reconciler samples it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from testkit import job_spec

from orchestrator import __version__
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
    pressure = client.app.state.pressure
    assert pressure.max_lag_s is None  # an embedded app never refuses; serve arms it
    pressure.arm(-1.0)  # any lag at all is too much: every beat is refused
    r = beat(client, job, "n0")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "2" and r.json()["interval_s"] == 2.0
    assert client.app.state.liveness.latest(job, "n0") is None  # not recorded
    assert client.get(f"/v1/jobs/{job}").status_code == 200  # other routes are served
    metrics = client.get("/metrics").text
    assert "skyresume_heartbeats_refused_total 1.0" in metrics
    assert "skyresume_heartbeat_interval_seconds 1.0" in metrics


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
