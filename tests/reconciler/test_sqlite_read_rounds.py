"""On SQLite a reconcile round reads without the write lock, and the lease survives a
locked database (issue 25).

At 0.3 cores and 2,048 nodes (``bench/overload.py``) every transaction began
``BEGIN IMMEDIATE``, the rounds' reads too, so the heartbeat flush and the lease
renewal waited out the busy timeout behind reads, and the killed node was never
found. These run on a real SQLite file with a busy timeout of 0.2 s, so anything that
would wait for the lock fails at once with "database is locked" instead of waiting.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from test_protocol_store import World, start_running
from testkit import short_busy_timeout

from orchestrator.launchers.base import LaunchHandle
from orchestrator.store import agents, db


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    url = f"sqlite:///{tmp_path / 'test.db'}"
    db.upgrade(url)
    w = World(url, tmp_path)
    start_running(w)
    short_busy_timeout(w.engine)
    yield w
    w.engine.dispose()


class PausedStatus:
    """The world's launcher, whose ``status`` waits until ``go`` is set: a round held
    inside its gather, as SkyPilot's status (up to 5 s a cluster) holds one."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.inside = threading.Event()
        self.go = threading.Event()

    def status(self, handle: LaunchHandle) -> Any:
        self.inside.set()
        assert self.go.wait(30), "the test never let the round go on"
        return self.inner.status(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def beat(w: World, node: int, step: int) -> None:
    nid = f"{w.job}-a1-n{node}"
    ranks = [{"rank": 2 * node + i, "step": step, "report_age_s": 0.1} for i in range(2)]
    with w.sm.begin() as s:
        agents.record_heartbeat(s, w.job, 1, nid, {"state": "running", "ranks": ranks}, now=w.now)


def test_writers_and_the_lease_renewal_commit_while_a_round_reads(world):
    w = world
    paused = PausedStatus(w.launcher)
    w.rec.launcher = paused
    assert w.rec.acquire_lease(w.now)
    epoch = w.rec.epoch
    w.now += timedelta(seconds=1)
    with ThreadPoolExecutor(4) as pool:
        round_ = pool.submit(w.rec.reconcile, w.job, w.now)
        assert paused.inside.wait(30)  # the round is inside its gather, reading
        # A burst of heartbeat writes from other threads, and the lease renewal:
        # none waits for the round (before: each failed on "database is locked").
        beats = [pool.submit(beat, w, k % 2, 10 + k) for k in range(12)]
        for b in beats:
            b.result()
        assert w.rec.acquire_lease(w.now) and w.rec.epoch == epoch
        paused.go.set()
        assert round_.result() == []  # a healthy running job: nothing to do
    with w.sm() as s:
        steps = [n.progress["ranks"][0]["step"] for n in agents.list_nodes(s, w.job, 1)]
    assert len(steps) == 2 and min(steps) >= 10  # both nodes' rows are the burst's


def test_a_lease_renewal_that_finds_the_database_locked_keeps_its_epoch_and_retries(world):
    w = world
    assert w.rec.acquire_lease(w.now)
    epoch = w.rec.epoch
    holder = sqlite3.connect(w.engine.url.database, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock throughout
    try:
        assert not w.rec.acquire_lease(w.now + timedelta(seconds=1))
        assert w.rec.epoch == epoch  # not counted as lost: nothing about the lease changed
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert w.rec.acquire_lease(w.now + timedelta(seconds=2)) and w.rec.epoch == epoch


def test_rounds_that_act_still_apply_what_they_decide(world):
    w = world
    w.launcher.dead.add(f"{w.job}-a1-n1")  # the launcher says node 1 is gone
    w.now += timedelta(seconds=1)
    (lost,) = w.rec.reconcile(w.job, w.now)  # read first, then again under the lock
    assert lost.kind == "node_lost" and lost.node_id == f"{w.job}-a1-n1"
    w.now += timedelta(seconds=1)
    w.rec.reconcile(w.job, w.now)
    assert w.status() == "RECOVERING"
