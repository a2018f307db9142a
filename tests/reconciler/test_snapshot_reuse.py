"""The reconciler keeps each node's parsed view between ticks (``ProgressCache``,
issue 25: at 2,048 nodes, parsing every node's progress was most of a tick). A kept
view must never make a snapshot differ from one read afresh: checked here on SQLite
and PostgreSQL while the rows change under it, in every way a node's row changes."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update
from test_protocol_store import World, start_running

from orchestrator.domain import reconcile as rc
from orchestrator.store import agents
from orchestrator.store.liveness import LiveHeartbeats
from orchestrator.store.models import Attempt, Job, Node
from orchestrator.store.snapshot import ProgressCache, gather_snapshot


@pytest.fixture
def world(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    w = World(db_url, tmp_path)
    yield w
    w.engine.dispose()


def read_both(w: World, cache: ProgressCache) -> rc.JobSnapshot:
    """The snapshot through the cache, after checking it equals one read afresh."""
    with w.sm() as s:
        kept, _ = gather_snapshot(s, w.job, w.now, w.launcher, cache)
        fresh, _ = gather_snapshot(s, w.job, w.now, w.launcher)
    assert kept == fresh
    return kept


def nodes(snap: rc.JobSnapshot) -> dict[str, rc.NodeView]:
    assert snap.attempt is not None
    return {n.node_id: n for n in snap.attempt.nodes}


def steps(view: rc.NodeView) -> list[int | None]:
    return [r.step for r in view.ranks]


def test_a_kept_view_never_makes_the_snapshot_differ_from_a_fresh_read(world):
    w = world
    start_running(w)
    cache = ProgressCache()
    first = nodes(read_both(w, cache))
    n0, n1 = sorted(first)

    # Nothing changed: the very same views (nothing decoded or parsed again).
    again = nodes(read_both(w, cache))
    assert all(again[k] is first[k] for k in first)

    # One node beats: its view is new and says so; the other's is kept.
    w.now += timedelta(seconds=1)
    with w.sm.begin() as s:
        body = {"state": "running", "ranks": [{"rank": 0, "step": 7}, {"rank": 1, "step": 7}]}
        agents.record_heartbeat(s, w.job, 1, n0, body, now=w.now)
    beat = nodes(read_both(w, cache))
    assert steps(beat[n0]) == [7, 7] and beat[n0].last_heartbeat_at == w.now
    assert beat[n1] is first[n1]

    # The progress changes and its time does not (a write that is no beat): the
    # content is the key, not the time.
    with w.sm.begin() as s:
        s.execute(
            update(Node)
            .where(Node.job_id == w.job, Node.node_id == n1)
            .values(progress={"ranks": [{"rank": 2, "step": 9, "report_age_s": 0.5}]})
        )
    assert steps(nodes(read_both(w, cache))[n1]) == [9]

    # An exit report: the same progress, the rest of the view changes.
    w.report(1, 0, {"key": "x", "kind": "node_exit", "exit_code": 1, "reason": "rank 0 died"})
    exited = nodes(read_both(w, cache))
    assert exited[n0].exited and exited[n0].exit_code == 1

    # A beat in this replica's memory, newer than SQL: read through the cache too, and
    # once it is flushed, SQL's row again.
    live = LiveHeartbeats(w.sm)
    live.hold()
    live.record(w.job, 1, n1, {"state": "running", "ranks": [{"rank": 2, "step": 11}]})
    assert steps(nodes(read_both(w, cache))[n1]) == [11]
    live.record(w.job, 1, n1, {"state": "running", "ranks": [{"rank": 2, "step": 12}]})
    assert steps(nodes(read_both(w, cache))[n1]) == [12]
    assert live.flush()
    assert steps(nodes(read_both(w, cache))[n1]) == [12]


def test_the_reconciler_forgets_the_views_of_a_job_once_it_is_over(world):
    w = world
    start_running(w)
    assert w.rec.acquire_lease()
    w.rec.tick(w.now)
    assert w.rec.progress.of(w.job)  # a running job's nodes are kept
    with w.sm.begin() as s:  # over, and its nodes given back: no longer reconciled
        s.execute(update(Job).where(Job.id == w.job).values(status="CANCELLED"))
        s.execute(update(Attempt).where(Attempt.job_id == w.job).values(state="ended"))
    w.rec.tick(w.now)
    assert w.rec.progress.of(w.job) == {}
