"""Leadership is fenced: the lease's epoch is checked in the transaction of every
write the reconciler makes, and launches are keyed so that a new leader adopts the
old one's request instead of starting a second set of nodes. Hand-built states on
SQLite and PostgreSQL, a fixed clock, two reconcilers on one database."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from testkit import FakeLauncher

from orchestrator.domain.reconcile import LaunchPhase, LaunchProgress
from orchestrator.domain.spec import validate_job_spec
from orchestrator.domain.status import JobStatus
from orchestrator.launchers.base import LaunchHandle, LaunchRequest
from orchestrator.reconciler import loop
from orchestrator.reconciler.loop import Reconciler
from orchestrator.store import db, repo, work
from orchestrator.store.models import Attempt, FailureEvent, Lease, NodeCommand

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TTL = 10.0


@dataclass
class KeyedLauncher(FakeLauncher):
    """A fake provider that holds requests by launch key, as the real launchers do:
    asked again for a key it holds, it answers with that request."""

    requests: dict[str, LaunchHandle] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    """Every key a new set of nodes was started for, in order."""

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        key = request.launch_key
        if key not in self.requests:
            self.started.append(key)
            handle = super().launch(request)
            self.requests[key] = LaunchHandle(
                key, self.name, handle.node_ids, handle.hosts, f"req-{key}"
            )
        return self.requests[key]


class Crash(BaseException):
    """The service dies here (not an Exception: nothing in the reconciler catches it)."""


@dataclass
class Pair:
    """One job, one database, two replicas' reconcilers (A and B) and a launcher."""

    sm: Callable
    launcher: KeyedLauncher
    job: str
    a: Reconciler
    b: Reconciler

    def attempts(self) -> list[Attempt]:
        with self.sm() as s:
            return list(s.query(Attempt).filter_by(job_id=self.job).order_by(Attempt.number))

    def lease(self) -> tuple[str, int, datetime] | None:
        with self.sm() as s:
            return work.lease_holder(s)


@pytest.fixture
def pair(db_url: str, tmp_path: Path) -> Iterator[Pair]:
    engine = db.make_engine(db_url)
    sm = db.make_sessionmaker(engine)
    spec = validate_job_spec(
        {
            "name": "t",
            "task": {"template": "gpt-cpu", "command": "python train.py"},
            "num_nodes": 2,
            "ranks_per_node": 2,
            "checkpoint": {"uri": f"file://{tmp_path / 'ckpt'}", "every_steps": 10},
        }
    )
    with sm.begin() as s:
        job = repo.create_job(s, spec, now=T0).id
    launcher = KeyedLauncher(tmp_path / "disks")

    def rec(name: str) -> Reconciler:
        return Reconciler(sm, launcher, "http://svc", holder=name, lease_s=TTL)

    yield Pair(sm, launcher, job, rec("A"), rec("B"))
    engine.dispose()


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_the_epoch_grows_only_when_the_lease_changes_holder(pair):
    p = pair
    assert p.a.acquire_lease(at(0)) and p.a.epoch == 1
    assert p.a.acquire_lease(at(5)) and p.a.epoch == 1  # a renewal is no new epoch
    assert not p.b.acquire_lease(at(14)) and p.b.epoch is None  # renewed at 5: valid to 15
    assert p.b.acquire_lease(at(16)) and p.b.epoch == 2
    assert not p.a.acquire_lease(at(17)) and p.a.epoch is None
    assert p.a.acquire_lease(at(40)) and p.a.epoch == 3
    assert p.lease()[:2] == ("A", 3)


def test_a_stale_epochs_write_is_refused_and_rolled_back(pair):
    p = pair
    assert p.a.acquire_lease(at(0))
    assert p.b.acquire_lease(at(11))  # A went silent past its lease
    with pytest.raises(work.NotLeader), p.sm.begin() as s:
        s.add(NodeCommand(job_id=p.job, attempt=1, type="stop", args={}, created_at=at(12)))
        s.flush()
        work.fence(s, "A", 1, TTL, at(12))
    with p.sm.begin() as s:
        assert s.query(NodeCommand).count() == 0  # the write went with the fence
        work.fence(s, "B", 2, TTL, at(12))  # the current epoch's passes
        assert s.get(Lease, work.LEASE_NAME).epoch == 2


@pytest.mark.parametrize(
    "holder,epoch,when",
    [("A", 2, 5.0), ("B", 1, 5.0), ("A", 1, 10.5)],
    ids=["wrong-epoch", "wrong-holder", "taken-over-after-expiry"],
)
def test_a_fence_needs_the_holder_and_the_epoch(pair, holder, epoch, when):
    p = pair
    assert p.a.acquire_lease(at(0))
    if when > TTL:
        assert p.b.acquire_lease(at(when))  # A's lease ran out and B took it: epoch 2
    with pytest.raises(work.NotLeader), p.sm.begin() as s:
        work.fence(s, holder, epoch, TTL, at(when))
    if when > TTL:
        return
    with p.sm.begin() as s:
        work.fence(s, "A", 1, TTL, at(5))  # and renews the lease
    assert p.lease()[2] == at(5 + TTL)


def test_a_lease_that_ran_out_but_nobody_took_is_renewed_by_its_holders_fence(pair):
    p = pair
    assert p.a.acquire_lease(at(0))
    with p.sm.begin() as s:
        work.fence(s, "A", 1, TTL, at(30))
    assert p.lease() == ("A", 1, at(30 + TTL))
    assert not p.b.acquire_lease(at(35))  # renewed: B takes nothing


def test_a_round_whose_reads_outlast_the_lease_still_acts(pair, monkeypatch):
    """Seen through SkyPilot's provisioner (issue 19, one cluster per node): one
    gather read two clusters' requests, 5 s each at most, longer than the 10 s lease;
    every round then refused its own fence and rolled back, twice a tick, for 230 s
    while the nodes were up. The fence now renews a lease nobody took."""
    p = pair
    clock = [at(0)]
    monkeypatch.setattr(repo, "utcnow", lambda: clock[0])
    assert p.a.acquire_lease()
    real = loop.gather_snapshot

    def slow_reads(s, job_id, now, launcher, *cache):  # type: ignore[no-untyped-def]
        out = real(s, job_id, now, launcher, *cache)
        clock[0] += timedelta(seconds=TTL + 2)  # the launcher's reads took that long
        return out

    monkeypatch.setattr(loop, "gather_snapshot", slow_reads)
    acted = p.a.reconcile(p.job)
    assert any(type(x).__name__ == "RecordAttempt" for x in acted), acted
    assert p.lease()[:2] == ("A", 1)


def test_a_new_leader_takes_over_only_after_the_ttl(pair):
    p = pair
    assert p.a.acquire_lease(at(0))
    assert p.b.reconcile(p.job, now=at(5)) == []  # A's lease is valid: B does nothing
    assert p.attempts() == []
    acted = p.b.reconcile(p.job, now=at(11))  # A silent for longer than the TTL
    assert any(type(x).__name__ == "RecordAttempt" for x in acted)
    assert [a.number for a in p.attempts()] == [1]
    assert p.lease()[:2] == ("B", 2)


def _pause_a_after_gather(monkeypatch, p: Pair, meanwhile: Callable[[], None]) -> None:
    """A is stopped (SIGSTOP) between reading its snapshot and its first write;
    ``meanwhile`` happens while it is stopped."""
    real = loop.gather_snapshot
    paused = []

    def gather(s, job_id, now, launcher, *cache):  # type: ignore[no-untyped-def]
        out = real(s, job_id, now, launcher, *cache)
        if not paused and s.info.get("who") == "A":
            paused.append(True)
            meanwhile()
        return out

    monkeypatch.setattr(loop, "gather_snapshot", gather)
    real_sm = p.a.sessionmaker

    def tagged():  # type: ignore[no-untyped-def]
        s = real_sm()
        s.info["who"] = "A"
        return s

    p.a.sessionmaker = tagged  # type: ignore[assignment]


def test_a_paused_leader_that_resumes_does_nothing(pair):
    """A leads and is stopped between two ticks; B takes over after the TTL and
    launches attempt 1. A resumes believing it leads (its clock says its lease is
    still valid): its fence is refused, it drops leadership, and it does nothing."""
    p = pair
    assert p.a.reconcile(p.job, now=at(0))  # A leads: attempt 1 recorded
    assert p.a.epoch == 1
    assert p.b.reconcile(p.job, now=at(12))  # B: the attempt's nodes started
    assert p.b.epoch == 2
    with p.sm.begin() as s:  # something for a stale A to act on: the job was cancelled
        repo.set_status(s, p.job, JobStatus.CANCELLED, reason="operator", now=at(12))
    assert p.a.reconcile(p.job, now=at(5)) == []  # even on a clock that says it leads
    assert p.a.epoch is None
    assert p.launcher.started == [f"{p.job}-a1"] and p.launcher.downed == []
    assert p.attempts()[0].state != "ended"  # the release is B's to make
    assert p.lease()[:2] == ("B", 2)


def test_a_leader_paused_inside_its_transaction_commits_nothing(pair, monkeypatch, db_url):
    """A read its snapshot (attempt 1 with no nodes yet: launch it) and stopped before
    its first write; B took over and launched. A resumes with its stale decision: the
    fence refuses it, the transaction rolls back, and it never calls the launcher."""
    if db_url.startswith("sqlite"):
        pytest.skip(
            "SQLite: a transaction holds the write lock from BEGIN IMMEDIATE, so no "
            "replica can take over inside it (one replica only on SQLite)"
        )
    p = pair
    assert p.a.reconcile(p.job, now=at(0))  # A leads: attempt 1 recorded

    def b_takes_over() -> None:
        assert p.b.reconcile(p.job, now=at(12))
        assert p.b.epoch == 2

    _pause_a_after_gather(monkeypatch, p, b_takes_over)
    assert p.a.reconcile(p.job, now=at(5)) == []
    assert p.a.epoch is None
    assert p.launcher.started == [f"{p.job}-a1"]  # one set of nodes, B's
    (a1,) = p.attempts()
    assert a1.handle["request_id"] == f"req-{p.job}-a1"
    assert p.lease()[:2] == ("B", 2)


def test_a_leader_paused_past_its_lease_that_nobody_took_reads_again_and_goes_on(pair):
    p = pair
    assert p.a.reconcile(p.job, now=at(0))
    assert p.a.acquire_lease(at(0))
    acted = p.a.reconcile(p.job, now=at(60))  # nobody took it: its fence renews it
    assert p.a.epoch == 1  # nobody else held it: the same epoch
    assert any(type(x).__name__ == "StartNodes" for x in acted)
    assert p.launcher.started == [f"{p.job}-a1"]


def test_a_launch_the_old_leader_made_but_never_recorded_is_adopted_not_repeated(pair, monkeypatch):
    """The old leader dies between the launcher accepting the request and the commit
    of its handle: the attempt is recorded with no handle. The new leader asks for the
    same key and is answered with the same request: the nodes are launched once."""
    p = pair
    assert p.a.reconcile(p.job, now=at(0))  # attempt 1 recorded

    def crash(name: str, attempt: int | None = None) -> None:
        if name == "launch-accepted":
            raise Crash(name)

    monkeypatch.setattr(loop, "crash_point", crash)
    with pytest.raises(Crash):
        p.a.reconcile(p.job, now=at(1))
    assert p.launcher.started == [f"{p.job}-a1"]
    assert p.attempts()[0].handle is None  # nothing of it was committed
    monkeypatch.setattr(loop, "crash_point", lambda name, attempt=None: None)
    assert p.b.reconcile(p.job, now=at(12))
    assert p.launcher.started == [f"{p.job}-a1"]  # adopted, not launched again
    assert p.attempts()[0].handle["request_id"] == f"req-{p.job}-a1"


def test_after_a_failed_request_the_next_try_is_a_launch_of_its_own(pair):
    p = pair
    assert p.a.reconcile(p.job, now=at(0))
    assert p.a.reconcile(p.job, now=at(1))  # asked for: key <job>-a1
    p.launcher.provisioning[f"{p.job}-a1"] = LaunchProgress(LaunchPhase.FAILED, "boot died")
    assert p.a.reconcile(p.job, now=at(2))  # the request failed: recorded
    for k in range(3, 60):
        p.a.reconcile(p.job, now=at(k))
        if len(p.launcher.started) > 1:
            break
    assert p.launcher.started == [f"{p.job}-a1", f"{p.job}-a1-t1"]
    with p.sm() as s:
        assert s.query(FailureEvent).filter_by(job_id=p.job, kind="launch_failed").count() == 1


def _waiting_on_a_lock(p: Pair) -> bool:
    with p.sm() as s:
        n = s.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        ).scalar_one()
    return bool(n)


def test_a_takeover_waits_for_the_fenced_transaction_and_then_takes_nothing(pair, db_url):
    """On PostgreSQL the fence holds the lease row until its transaction commits: a
    replica whose clock says the lease ran out waits, then finds it renewed."""
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite has no row locks (one replica only)")
    p = pair
    assert p.a.acquire_lease(at(0))
    got: list[int | None] = []
    with p.sm() as s, s.begin():
        work.fence(s, "A", 1, TTL, at(9))  # renewed to 19, not committed yet

        def take() -> None:
            with p.sm() as s2:
                got.append(work.acquire_lease(s2, "B", TTL, at(12)))

        t = threading.Thread(target=take)
        t.start()
        for _ in range(400):  # until B's UPDATE is seen waiting on the row (or give up)
            if _waiting_on_a_lock(p) or got:
                break
            time.sleep(0.025)
        assert not got  # B is still waiting while A's transaction is open
        assert _waiting_on_a_lock(p)
    t.join(30)
    assert got == [None]  # A committed its renewal first: nothing to take
    assert p.lease()[:2] == ("A", 1)


def test_a_holder_stopped_inside_its_fenced_transaction_is_cut_off_by_the_server(pair, db_url):
    """A holder that stops while it holds the lease row (SIGSTOP, a partition) loses
    its session after the lease's length (``idle_in_transaction_session_timeout``):
    the takeover goes through and the stopped holder's commit fails."""
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite has no row locks (one replica only)")
    p = pair
    short = 1.0  # the lease, and so the server's cut-off, in seconds
    with p.sm() as s:
        assert work.acquire_lease(s, "A", short, at(0)) == 1
    s = p.sm()
    s.begin()
    work.fence(s, "A", 1, short, at(0.5))  # renewed to 1.5; then A stops, holding it
    with p.sm() as s2:
        assert work.acquire_lease(s2, "B", short, at(2)) == 2  # waited for the cut-off
    with pytest.raises(Exception, match=r"idle-in-transaction|terminat|closed"):
        s.commit()
    s.close()
    assert p.lease()[:2] == ("B", 2)
