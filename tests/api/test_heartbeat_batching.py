"""Heartbeats through the real app, batched (store/liveness.py), on SQLite and PostgreSQL.

The app is held in batching mode without its flusher thread (``liveness.hold()``), so
each test decides when a flush happens: what detection sees *before* the flush is the
claim that matters (a beat sitting in a batch must never make a node look lost).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, update
from testkit import FakeLauncher, job_spec

from orchestrator import __version__
from orchestrator.contract import AGENT_PROTOCOL, EventKind
from orchestrator.domain.reconcile import ReconcileConfig, detect
from orchestrator.store import agents
from orchestrator.store.models import Attempt, Job, Node
from orchestrator.store.snapshot import gather_snapshot

AGENT = {"agent_version": __version__, "agent_build": "source", "protocol": AGENT_PROTOCOL}


def add_attempt(maker: Any, job_id: str, number: int, state: str = "running") -> None:
    with maker() as s, s.begin():
        s.add(
            Attempt(
                job_id=job_id, number=number, cloud="local", region="local",
                instance_type="cpu", num_nodes=1, spot=True, knobs={},
                started_at=datetime.now(UTC), state=state, launcher="local",
            )
        )  # fmt: skip


def url(job_id: str, node: str, attempt: int = 1) -> str:
    return f"/v1/jobs/{job_id}/attempts/{attempt}/nodes/{node}"


def register(client: TestClient, job_id: str, node: str, attempt: int = 1) -> None:
    body = {"node_rank": int(node.rsplit("n", 1)[-1]), "hostname": "h", "ranks": [], **AGENT}
    r = client.post(url(job_id, node, attempt) + "/register", json=body)
    assert r.status_code == 200, r.text


def beat(client: TestClient, job_id: str, node: str, step: int, **kw: Any) -> int:
    ranks = [{"rank": k, "local_rank": k, "pid": 100 + k, "alive": True, "step": step}
             for k in range(2)]  # fmt: skip
    body = {"state": "running", "ranks": ranks, **kw}
    return client.post(url(job_id, node) + "/heartbeat", json=body).status_code


def silence_in_sql(maker: Any, job_id: str, seconds: float) -> None:
    """Make the SQL rows say the nodes were last heard ``seconds`` ago."""
    with maker() as s, s.begin():
        when = datetime.now(UTC) - timedelta(seconds=seconds)
        s.execute(update(Node).where(Node.job_id == job_id).values(last_heartbeat_at=when))


def sql_node(maker: Any, job_id: str, node: str) -> Node:
    with maker() as s:
        (row,) = [n for n in agents.list_nodes(s, job_id) if n.node_id == node]
        return row


def lost(maker: Any, job_id: str, tmp_path: Any) -> str | None:
    """What the reconciler's detection says of the job right now (a node id, or None)."""
    with maker() as s:
        snap, _ = gather_snapshot(s, job_id, datetime.now(UTC), FakeLauncher(root=tmp_path))
    assert snap.attempt is not None
    found = detect(snap, snap.attempt, ReconcileConfig())
    if found is None:
        return None
    assert found.kind == EventKind.NODE_LOST, found
    return found.node_id


@pytest.fixture
def job(client: TestClient) -> Iterator[str]:
    client.app.state.liveness.hold()  # type: ignore[attr-defined]
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    add_attempt(client.app.state.sessionmaker, job_id, 1)  # type: ignore[attr-defined]
    yield job_id


def test_a_batched_beat_counts_for_detection_before_any_flush(client, job, tmp_path):
    maker, live = client.app.state.sessionmaker, client.app.state.liveness
    register(client, job, "n0")
    silence_in_sql(maker, job, 120)  # SQL alone: silent for 2 min, past the 30 s timeout
    assert lost(maker, job, tmp_path) == "n0"
    assert beat(client, job, "n0", step=7) == 200
    assert live.pending == 1 and live.flushes == 0
    assert lost(maker, job, tmp_path) is None
    with maker() as s:
        snap, _ = gather_snapshot(s, job, datetime.now(UTC), FakeLauncher(root=tmp_path))
    assert snap.attempt is not None
    assert [r.step for r in snap.attempt.nodes[0].ranks] == [7, 7]  # progress, too
    assert sql_node(maker, job, "n0").progress["ranks"] == []  # still only in memory


def test_after_a_flush_the_beat_is_in_sql_with_what_register_wrote(client, job):
    maker, live = client.app.state.sessionmaker, client.app.state.liveness
    register(client, job, "n0")
    assert beat(client, job, "n0", step=9, acked_command=4) == 200
    assert live.flush()
    row = sql_node(maker, job, "n0")
    assert row.state == "running"
    assert [r["step"] for r in row.progress["ranks"]] == [9, 9]
    assert row.progress["acked_command"] == 4 and row.progress["hostname"] == "h"
    assert beat(client, job, "n0", step=10) == 200  # acked nothing new: no rewind
    assert live.flush()
    assert sql_node(maker, job, "n0").progress["acked_command"] == 4


def test_a_flush_is_one_transaction_for_many_nodes(client, job):
    maker, live = client.app.state.sessionmaker, client.app.state.liveness
    nodes = [f"n{k}" for k in range(40)]
    for n in nodes:
        register(client, job, n)
    for n in nodes:
        assert beat(client, job, n, step=3) == 200
    engine = client.app.state.engine
    seen = {"statements": 0, "commits": 0}

    def on_statement(*_a: Any) -> None:
        seen["statements"] += 1

    def on_commit(*_a: Any) -> None:
        seen["commits"] += 1

    event.listen(engine, "before_cursor_execute", on_statement)
    event.listen(engine, "commit", on_commit)
    try:
        assert live.flush()
    finally:
        event.remove(engine, "before_cursor_execute", on_statement)
        event.remove(engine, "commit", on_commit)
    assert seen["commits"] == 1
    # rows SELECT, one executemany UPDATE, the currency read (jobs, attempts), and the
    # backend's own BEGIN: a handful, not one per node
    assert seen["statements"] <= 6, seen
    with maker() as s:
        assert {n.node_id for n in agents.list_nodes(s, job) if n.state == "running"} == set(nodes)


def test_a_failed_flush_keeps_the_batch_and_the_next_flush_writes_it(client, job):
    maker, live = client.app.state.sessionmaker, client.app.state.liveness
    register(client, job, "n0")
    register(client, job, "n1")
    assert beat(client, job, "n0", step=1, acked_command=5) == 200
    assert beat(client, job, "n1", step=1) == 200
    engine = client.app.state.engine

    def blink(_conn, _cursor, statement, *_a: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE NODES"):
            raise ConnectionError("the database blinked")

    event.listen(engine, "before_cursor_execute", blink)
    try:
        assert live.flush() is False
    finally:
        event.remove(engine, "before_cursor_execute", blink)
    assert live.pending == 2 and live.failed_flushes == 1
    assert sql_node(maker, job, "n0").progress["ranks"] == []
    assert beat(client, job, "n0", step=2) == 200  # newer than the kept one; acks nothing
    assert live.flush()
    row = sql_node(maker, job, "n0")
    assert [r["step"] for r in row.progress["ranks"]] == [2, 2]
    assert row.progress["acked_command"] == 5  # the failed batch's ack is not lost
    assert sql_node(maker, job, "n1").state == "running"


def test_a_stale_attempt_is_refused_from_the_warm_cache_at_once(client, job):
    register(client, job, "n0")
    assert beat(client, job, "n0", step=1) == 200  # the cache knows the job now
    add_attempt(client.app.state.sessionmaker, job, 2)  # this replica's commit
    assert beat(client, job, "n0", step=2) == 409
    ghost = client.post(url(job, "ghost") + "/heartbeat", json={"state": "running"})
    assert ghost.status_code == 409  # the attempt is checked before the node


def test_register_hands_back_the_cursor_of_a_beat_still_in_the_batch(client, job):
    register(client, job, "n0")
    assert beat(client, job, "n0", step=1, acked_command=12) == 200
    body = {"node_rank": 0, "hostname": "h", "ranks": [], **AGENT}
    r = client.post(url(job, "n0") + "/register", json=body)
    assert r.status_code == 200 and r.json()["command_cursor"] == 12
    assert client.app.state.liveness.flush()
    row = sql_node(client.app.state.sessionmaker, job, "n0")
    assert row.state == "registered"  # the older beat, flushed after, did not undo it


def test_stop_flushes_what_is_left(client, job):
    live = client.app.state.liveness
    register(client, job, "n0")
    live.start(interval_s=3600.0)  # no flush on its own during the test
    assert beat(client, job, "n0", step=4) == 200
    live.stop()
    assert sql_node(client.app.state.sessionmaker, job, "n0").state == "running"


def test_without_a_flusher_each_beat_is_written_through(client, job):
    live = client.app.state.liveness
    live.stop()  # undo the fixture's hold: an embedded app that never started one
    register(client, job, "n0")
    assert beat(client, job, "n0", step=5) == 200
    assert live.pending == 0
    row = sql_node(client.app.state.sessionmaker, job, "n0")
    assert [r["step"] for r in row.progress["ranks"]] == [5, 5]


@pytest.fixture
def replica_b(app, settings) -> Iterator[TestClient]:
    """A second app (another replica) on the same database."""
    from orchestrator.app import create_app

    other = create_app(settings)
    with TestClient(other) as c:
        c.headers["Authorization"] = f"Bearer {other.state.token}"
        other.state.liveness.hold()
        yield c
    other.state.engine.dispose()


def test_a_beat_to_replica_b_counts_on_replica_a_after_bs_flush(client, job, replica_b, tmp_path):
    a_maker = client.app.state.sessionmaker
    register(replica_b, job, "n0")
    silence_in_sql(a_maker, job, 120)
    assert beat(replica_b, job, "n0", step=8) == 200
    assert lost(a_maker, job, tmp_path) == "n0"  # A cannot see B's memory
    assert replica_b.app.state.liveness.flush()
    assert lost(a_maker, job, tmp_path) is None
    with a_maker() as s:
        snap, _ = gather_snapshot(s, job, datetime.now(UTC), FakeLauncher(root=tmp_path))
    assert snap.attempt is not None and snap.attempt.nodes[0].ranks[0].step == 8


def test_a_replicas_older_beat_never_overwrites_a_newer_row(client, job, replica_b):
    maker = client.app.state.sessionmaker
    register(client, job, "n0")
    assert beat(replica_b, job, "n0", step=1) == 200  # B holds the older beat
    assert beat(client, job, "n0", step=2) == 200
    assert client.app.state.liveness.flush()  # A writes the newer one first
    assert replica_b.app.state.liveness.flush()
    assert [r["step"] for r in sql_node(maker, job, "n0").progress["ranks"]] == [2, 2]


def test_a_stale_attempt_made_on_another_replica_is_refused_after_the_next_flush(
    client, job, replica_b
):
    register(client, job, "n0")
    assert beat(client, job, "n0", step=1) == 200
    r = replica_b.post(f"/v1/jobs/{job}/cancel")
    assert r.status_code in (200, 202), r.text
    assert client.app.state.liveness.flush()  # A re-reads what it cached
    assert beat(client, job, "n0", step=2) == 409
    with client.app.state.sessionmaker() as s:
        assert s.get(Job, job) is not None


def test_a_node_registered_on_another_replica_is_accepted_on_a_cache_miss(client, job, replica_b):
    register(replica_b, job, "n0")  # A's cache has never heard of the job or the node
    assert beat(client, job, "n0", step=1) == 200
    assert beat(client, "j-nope", "n0", step=1) == 404  # an unknown job, as before
    assert beat(client, job, "n9", step=1) == 404  # a node nobody registered


def test_a_finished_job_is_forgotten_at_the_next_flush_and_its_late_beats_still_get_409(
    client, job
):
    live = client.app.state.liveness
    register(client, job, "n0")
    assert beat(client, job, "n0", step=1) == 200
    assert client.post(f"/v1/jobs/{job}/cancel").status_code in (200, 202)
    assert live.flush()  # the beat is written, then the over job leaves memory
    assert live.latest(job, "n0") is None
    assert sql_node(client.app.state.sessionmaker, job, "n0").state == "running"
    assert beat(client, job, "n0", step=2) == 409
