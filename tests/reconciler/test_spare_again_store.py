"""A shrunk elastic job whose standby launch was refused asks for its replacement again,
through the real reconciler on a real database (SQLite and PostgreSQL) with a fake
launcher: nothing before the wait, then one standby launch beside the group (node
ranks past the refused try's, never on a group host), and the grow once it
registered. A later try that is refused again waits twice as long."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from testkit import FakeLauncher

from orchestrator.contract import Env, EventKind
from orchestrator.domain import reconcile as rc
from orchestrator.domain.reconcile import LauncherAbilities
from orchestrator.domain.spec import validate_job_spec
from orchestrator.domain.status import JobStatus
from orchestrator.reconciler.loop import Reconciler
from orchestrator.store import agents, db, records, repo
from orchestrator.store.models import Attempt, FailureEvent, Node
from orchestrator.store.snapshot import gather_snapshot

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
JOINS = LauncherAbilities(restarts_in_place=True, keeps_survivors=True, releases_single_nodes=True)


class Shrunk:
    """Attempt 2 of a 3-node job (``min_nodes: 2``) trains on 2 nodes; its standby
    launch was refused when it started."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.engine = db.make_engine(url)
        self.sm = db.make_sessionmaker(self.engine)
        self.launcher = FakeLauncher(tmp / "disks")
        self.launcher.abilities = JOINS
        self.now = T0
        spec = validate_job_spec({
            "name": "elastic", "task": {"template": "gpt-cpu", "command": "python train.py"},
            "num_nodes": 3, "min_nodes": 2, "ranks_per_node": 1,
            "checkpoint": {"uri": f"file://{tmp}/ckpt", "every_steps": 10},
            "restarts": {"max_restarts": 3, "heartbeat_timeout_s": 30},
            "elastic": {"shrink": "always"},
        })  # fmt: skip
        with self.sm.begin() as s:
            self.job = repo.create_job(s, spec, now=T0 - timedelta(seconds=600)).id
            for st in (JobStatus.PROVISIONING, JobStatus.RUNNING):
                repo.set_status(s, self.job, st, reason="test", now=T0 - timedelta(seconds=500))
            group = [f"{self.job}-a2-n0", f"{self.job}-a2-n1"]
            refused = T0 - timedelta(seconds=5)
            s.add(Attempt(
                job_id=self.job, number=2, cloud="fake", region="r1", zone=None,
                instance_type="cpu", accelerator=None, num_nodes=3, spot=True,
                price_per_node_hour=0.5, resume_step=40, validated_step=40,
                started_at=T0 - timedelta(seconds=30), state="running",
                knobs={"verb": "shrink", "train_nodes": 2, "keep": [], "ranks_per_node": 1,
                       "spare_released": "the standby launch was refused: no capacity",
                       "spare_released_at": refused.isoformat()},
                handle={"verb": "shrink", "cluster_name": "c-group", "launcher": "fake",
                        "node_ids": group, "hosts": ["h2-0", "h2-1"], "request_id": "r",
                        "requested_at": (T0 - timedelta(seconds=30)).isoformat(),
                        "up_at": (T0 - timedelta(seconds=20)).isoformat()},
            ))  # fmt: skip
            s.flush()
            for k, nid in enumerate(group):
                agents.register_node(s, self.job, 2, nid, node_rank=k, now=T0,
                                     client_ip=f"10.0.0.{k + 2}")  # fmt: skip
        self.beat()
        self.rec = Reconciler(self.sm, self.launcher, "http://svc")

    def beat(self) -> None:
        """The group's agents beat: each rank is at step 50, resumed from 40."""
        with self.sm.begin() as s:
            for k in range(2):
                ranks = [{"rank": k, "step": 50, "step_time": 0.5, "report_age_s": 0.1,
                          "resumed": {"step": 40, "manifest_digest": "d40"}}]  # fmt: skip
                body = {"state": "running", "ranks": ranks}
                agents.record_heartbeat(s, self.job, 2, f"{self.job}-a2-n{k}", body, now=self.now)

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)
        self.beat()
        self.rec.reconcile(self.job, now=self.now)

    def plan(self) -> records.LaunchPlan:
        with self.sm() as s:
            a = s.query(Attempt).filter_by(job_id=self.job, number=2).one()
            return records.launch_plan_of(a)

    def spare(self) -> rc.SpareView | None:
        with self.sm() as s:
            snap, _rows = gather_snapshot(s, self.job, self.now, self.launcher)
        assert snap.attempt is not None
        return snap.attempt.spare

    def standbys(self) -> list:
        return [r for r in self.launcher.launched if r.env.get(Env.STANDBY) == "1"]


@pytest.fixture
def shrunk(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    w = Shrunk(db_url, tmp_path)
    yield w
    w.engine.dispose()


def test_a_refused_standby_is_asked_for_again_beside_the_group_once_the_wait_passed(shrunk):
    w = shrunk
    w.tick(30.0)  # 35 s after the refusal: the wait is 60 s
    assert w.standbys() == []
    w.tick(30.0)
    (req,) = w.standbys()
    # One node, ranked past the refused try's (2), told the group's rendezvous; its
    # size bounds its rank (the agent refuses a rank past it).
    assert (req.node_rank_base, req.placement.num_nodes, req.placement.region) == (3, 1, "r1")
    assert req.env[Env.NNODES] == "4" and req.env[Env.MASTER_ADDR] == "10.0.0.2"
    assert {"h2-0", "h2-1"} <= set(req.exclude_hosts)
    plan = w.plan()
    assert (plan.spare_try, plan.spare_base, plan.spare_released) == (2, 3, None)
    assert plan.spare_cluster == f"{w.job}-a2-b3"
    spare = w.spare()
    assert spare is not None and not spare.released and spare.tries == 2
    assert spare.asked_at == w.now
    w.tick(5.0)
    assert len(w.standbys()) == 1  # asked once: the try is provisioning


def test_a_replacement_asked_for_again_that_registers_grows_the_group(shrunk):
    w = shrunk
    w.tick(65.0)
    assert len(w.standbys()) == 1
    with w.sm.begin() as s:
        agents.register_node(s, w.job, 2, f"{w.job}-a2-n3", node_rank=3, now=w.now,
                             client_ip="10.0.0.9")  # fmt: skip
    w.tick(1.0)
    with w.sm() as s:
        grows = s.query(FailureEvent).filter_by(job_id=w.job, kind=EventKind.GROW).all()
    assert len(grows) == 1
    assert f"{w.job}-a2-n3 registered: growing from 2 to 3 nodes" in grows[0].message


def test_a_try_refused_again_is_recorded_and_the_next_waits_twice_as_long(shrunk):
    w = shrunk
    w.launcher.stocked_out.add("r1")
    w.tick(65.0)
    plan = w.plan()
    assert plan.spare_try == 2 and plan.spare_released is not None
    assert "(try 2) was refused: InsufficientInstanceCapacity" in plan.spare_released
    assert w.spare() is not None and w.spare().released  # type: ignore[union-attr]
    w.launcher.stocked_out.clear()
    w.tick(100.0)  # the third try waits 120 s after the second's refusal
    assert w.standbys() == []
    w.tick(25.0)
    (req,) = w.standbys()
    assert req.node_rank_base == 4 and w.plan().spare_try == 3
    with w.sm() as s:
        notes = [e.message for e in s.query(FailureEvent).filter_by(
            job_id=w.job, kind=EventKind.ELASTIC).order_by(FailureEvent.id)]  # fmt: skip
    assert any("(try 2) was refused" in m for m in notes)
    assert any("asking again for 1 replacement (try 3" in m for m in notes)


def test_an_earlier_trys_silent_spare_ends_neither_the_group_nor_the_new_try(shrunk):
    w = shrunk
    # The first try's spare had registered (node rank 2) before it was given back.
    with w.sm.begin() as s:
        agents.register_node(s, w.job, 2, f"{w.job}-a2-n2", node_rank=2,
                             now=T0 - timedelta(seconds=200))  # fmt: skip
        s.query(Node).filter_by(job_id=w.job, node_id=f"{w.job}-a2-n2").one().last_heartbeat_at = (
            T0 - timedelta(seconds=200)
        )
    w.tick(65.0)
    assert len(w.standbys()) == 1
    spare = w.spare()
    assert spare is not None and spare.nodes == ()
    assert f"{w.job}-a2-n2" in spare.past_ids
    w.tick(5.0)
    with w.sm() as s:
        job = repo.get_job(s, w.job)
        assert job.status == JobStatus.RUNNING.value  # no incident for the old spare
    assert not w.spare().released  # type: ignore[union-attr]


def test_a_capacity_refusal_is_remembered_with_the_nodes_it_asked_for(shrunk):
    """What lets the planner offer an elastic job fewer nodes where a launch of more
    was refused (``planner.capacity_short``): the refusal's node count, stored."""
    from orchestrator.domain.plan import Placement
    from orchestrator.store import work
    from orchestrator.store.snapshot import placement_history

    w = shrunk
    p = Placement("fake", "r1", "cpu", None, 0, 3, True, price_per_node_hour=0.5)
    with w.sm.begin() as s:
        work.record_launch_failure(s, w.job, 2, p, "InsufficientInstanceCapacity",
                                   capacity=True, now=w.now)  # fmt: skip
    with w.sm() as s:
        (refused,) = placement_history(s, w.now)
    assert (refused.region, refused.failure_class, refused.num_nodes) == (
        "r1", "capacity_unavailable", 3,
    )  # fmt: skip
