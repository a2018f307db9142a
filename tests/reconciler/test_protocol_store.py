"""The restart protocol against a real database (SQLite and PostgreSQL) and a real
file:// checkpoint store, with a fake launcher and agents played through the same
store functions the agent routes call."""

from __future__ import annotations

import hashlib
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from testkit import FakeLauncher

from orchestrator.contract import (
    COMMIT_NAME,
    MANIFEST_NAME,
    Env,
    Manifest,
    ManifestFile,
    commit_marker,
)
from orchestrator.domain import reconcile as rc
from orchestrator.domain.protocol import ProtocolStep
from orchestrator.domain.reconcile import LauncherAbilities
from orchestrator.domain.spec import validate_job_spec
from orchestrator.launchers.base import LaunchHandle
from orchestrator.reconciler.loop import Reconciler
from orchestrator.store import agents, db, repo
from orchestrator.store.incidents import incidents
from orchestrator.store.models import Attempt, NodeCommand
from orchestrator.store.models import ProtocolStep as StepRow

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def write_checkpoint(root: Path, step: int, world: int = 4) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    files = []
    for r in range(world):
        data = os.urandom(4096)
        (d / f"__{r}_0.distcp").write_bytes(data)
        files.append(ManifestFile(f"__{r}_0.distcp", len(data), hashlib.sha256(data).hexdigest()))
    (d / ".metadata").write_bytes(b"meta")
    files.append(ManifestFile(".metadata", 4, hashlib.sha256(b"meta").hexdigest()))
    m = Manifest(step, world, T0.isoformat(), tuple(files)).to_json()
    (d / MANIFEST_NAME).write_bytes(m)
    (d / COMMIT_NAME).write_bytes(commit_marker(m))
    return d


class World:
    """A job, a reconciler and a clock; agents are played by hand."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.engine = db.make_engine(url)
        self.sm = db.make_sessionmaker(self.engine)
        self.ckpt = tmp / "ckpt"
        self.ckpt.mkdir()
        self.launcher = FakeLauncher(tmp / "disks")
        self.now = T0
        spec = validate_job_spec(
            {
                "name": "t",
                "task": {"template": "gpt-cpu", "command": "python train.py"},
                "num_nodes": 2,
                "ranks_per_node": 2,
                "checkpoint": {"uri": f"file://{self.ckpt}", "every_steps": 10},
                "restarts": {"max_restarts": 3, "heartbeat_timeout_s": 30, "grace_period_s": 60},
            }
        )
        with self.sm.begin() as s:
            self.job = repo.create_job(s, spec, now=self.now).id
        self.rec = self.reconciler()

    def reconciler(self) -> Reconciler:
        return Reconciler(self.sm, self.launcher, "http://svc")

    def tick(self, seconds: float = 1.0):  # type: ignore[no-untyped-def]
        self.now += timedelta(seconds=seconds)
        return self.rec.reconcile(self.job, now=self.now)

    def status(self) -> str:
        with self.sm() as s:
            return repo.get_job(s, self.job).status

    def agents_up(self, attempt: int, *, resumed: int, step: int) -> None:
        with self.sm.begin() as s:
            for k in range(2):
                nid = f"{self.job}-a{attempt}-n{k}"
                agents.register_node(
                    s,
                    self.job,
                    attempt,
                    nid,
                    node_rank=k,
                    now=self.now,
                    client_ip=f"10.0.0.{k + 2}",
                )
                ranks = [
                    {
                        "rank": 2 * k + i,
                        "step": step,
                        "resumed": {"step": resumed, "manifest_digest": f"d{resumed}"},
                        "report_age_s": 0.1,
                    }
                    for i in range(2)
                ]
                body = {"state": "running", "ranks": ranks}
                agents.record_heartbeat(s, self.job, attempt, nid, body, now=self.now)

    def staged(self, attempt: int, step: int, *, ok: bool = True, detail: str = "") -> None:
        """Every node of ``attempt`` reports staging ``step`` (as its agent does before
        torchrun starts)."""
        for k in range(2):
            nid = f"{self.job}-a{attempt}-n{k}"
            self.report(attempt, k, {
                "key": f"staged-{step}", "kind": "staged", "node_id": nid, "step": step,
                "ok": ok, "detail": detail, "bytes": 100 if ok else 0, "seconds": 0.5,
                "uri": f"file://{self.ckpt}/step_{step}",
            })  # fmt: skip

    def recovered(self, attempt: int, step: int) -> None:
        """The relaunched nodes come up, stage ``step`` and resume from it."""
        self.agents_up(attempt, resumed=step, step=step)
        self.staged(attempt, step)
        self.run_until("RUNNING")

    def report(self, attempt: int, node: int, body: dict) -> None:
        with self.sm.begin() as s:
            nid = f"{self.job}-a{attempt}-n{node}"
            agents.record_report(s, self.job, attempt, nid, body, now=self.now)

    def commands(self) -> list[NodeCommand]:
        with self.sm() as s:
            return list(s.query(NodeCommand).filter_by(job_id=self.job).order_by(NodeCommand.id))

    def run_until_launched(self, attempt: int, limit: int = 30) -> None:
        """Tick until the launcher was asked for ``attempt``."""
        for _ in range(limit):
            self.tick(5.0)
            if any(r.attempt == attempt for r in self.launcher.launched):
                return
        raise AssertionError(f"attempt {attempt} was never launched (job {self.status()})")

    def run_until(self, status: str, limit: int = 30) -> None:
        """Tick (5 s apart: long enough for a grace period to run out) until ``status``."""
        for _ in range(limit):
            self.tick(5.0)
            if self.status() == status:
                return
        raise AssertionError(f"job stayed {self.status()}, wanted {status}")


@pytest.fixture
def world(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    w = World(db_url, tmp_path)
    yield w
    w.engine.dispose()


def start_running(w: World) -> None:
    w.tick()
    assert w.status() == "PROVISIONING"
    assert w.launcher.launched == []  # the attempt is committed before any node starts
    w.tick()
    assert w.launcher.launched[0].env[Env.RESUME_FROM] == "latest"
    w.agents_up(1, resumed=0, step=0)
    w.tick()  # every node registered: the attempt is up
    w.tick()
    assert w.status() == "RUNNING"


def test_a_preemption_runs_all_seven_steps_and_resumes_on_every_rank_at_the_saved_step(world):
    w = world
    start_running(w)
    w.agents_up(1, resumed=0, step=40)
    w.report(1, 1, {"key": "n1", "kind": "preemption_notice", "provider": "aws"})
    w.tick()
    assert w.status() == "RECOVERING"
    w.tick()
    (cmd,) = w.commands()
    assert (cmd.type, cmd.attempt, cmd.node_id) == ("checkpoint_and_stop", 1, None)
    assert cmd.args["grace_s"] == 60.0
    # Every rank saved step 40 and exited 75; the agents say so.
    write_checkpoint(w.ckpt, 30)
    write_checkpoint(w.ckpt, 40)
    for k in range(2):
        w.report(1, k, {"key": "x", "kind": "node_exit", "exit_code": 75, "reason": "saved"})
    w.run_until_launched(2)
    req = w.launcher.launched[1]
    assert req.attempt == 2
    assert req.env[Env.RESUME_FROM] == "{node_disk}/staged/step_40"
    assert req.env[Env.EXPECTED_STEP] == "40"
    assert (req.env[Env.CHECKPOINT_EVERY], req.env[Env.CHECKPOINT_KEEP]) == ("10", "3")
    assert w.launcher.downed == [f"{w.job}-a1"]  # released only after the confirm step
    assert req.placement.region == "r2"  # the region that preempted us (r1) is avoided
    with w.sm() as s:
        assert s.query(Attempt).filter_by(job_id=w.job, number=2).one().region == "r2"
    assert req.env[Env.STAGE_FROM] == f"file://{w.ckpt}/step_40"  # the nodes stage it
    w.recovered(2, 40)
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
    assert inc["failure_class"] == "preemption_notice"
    assert [st["step"] for st in inc["steps"]] == [p.value for p in ProtocolStep]
    assert all(st["outcome"] in ("ok", "skipped") for st in inc["steps"])
    assert (inc["last_step"], inc["resumed_step"], inc["steps_lost"]) == (40, 40, 0)
    assert inc["mttr_s"] is not None and inc["mttr_s"] > 0


def test_a_lost_node_stops_the_survivors_and_resumes_from_the_last_periodic_checkpoint(world):
    w = world
    start_running(w)
    write_checkpoint(w.ckpt, 20)
    w.agents_up(1, resumed=0, step=27)
    w.launcher.dead.add(f"{w.job}-a1-n1")
    w.tick()  # the launcher sees the node gone: recorded
    w.tick()  # the incident opens
    assert w.status() == "RECOVERING"
    w.tick()
    assert [c.type for c in w.commands()] == ["stop"]
    w.report(1, 0, {"key": "x", "kind": "node_exit", "exit_code": 1, "reason": "stopped"})
    w.run_until_launched(2)
    assert w.launcher.launched[1].env[Env.EXPECTED_STEP] == "20"
    w.recovered(2, 20)
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
    assert inc["failure_class"] == "node_lost" and inc["steps_lost"] == 7


def preempt_node_1_after_a_save_at_40(w: World) -> None:
    """Attempt 1 runs, saves step 40, node 1 gets a notice, every rank saves and exits."""
    start_running(w)
    write_checkpoint(w.ckpt, 40)
    w.agents_up(1, resumed=0, step=40)
    w.report(1, 1, {"key": "n1", "kind": "preemption_notice", "provider": "aws"})
    w.tick()
    for k in range(2):
        w.report(1, k, {"key": "x", "kind": "node_exit", "exit_code": 75, "reason": "saved"})


def test_a_preemption_keeps_the_healthy_node_and_launches_one_replacement_beside_it(world):
    w = world
    w.launcher.abilities = LauncherAbilities(
        restarts_in_place=True, keeps_survivors=True, releases_single_nodes=True
    )
    preempt_node_1_after_a_save_at_40(w)
    w.run_until_launched(2)
    # only the lost node was given back; the healthy one stayed provisioned
    assert w.launcher.downed_nodes == [(f"{w.job}-a1-n1",)]
    (kept,) = w.launcher.restarted
    assert (kept.node_rank_base, kept.placement.num_nodes) == (0, 1)
    fresh = w.launcher.launched[-1]
    assert (fresh.node_rank_base, fresh.placement.num_nodes) == (1, 1)
    assert fresh.env[Env.NODE_RANK_BASE] == "1" and "h1-0" in fresh.exclude_hosts
    for req in (kept, fresh):  # one group: its size and a kept node's address
        assert (req.env[Env.NNODES], req.env[Env.MASTER_ADDR]) == ("2", "10.0.0.2")
    w.recovered(2, 40)
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
        a2 = s.query(Attempt).filter_by(job_id=w.job, number=2).one()
    assert [p["cluster_name"] for p in a2.handle["parts"]] == [f"{w.job}-a1", f"{w.job}-a2-b1"]
    assert a2.handle["node_ids"] == [f"{w.job}-a2-n0", f"{w.job}-a2-n1"]
    assert inc["steps_lost"] == 0
    w.report(2, 0, {"key": "e", "kind": "node_exit", "exit_code": 0, "reason": "done"})
    w.report(2, 1, {"key": "e", "kind": "node_exit", "exit_code": 0, "reason": "done"})
    w.run_until("SUCCEEDED")
    assert (f"{w.job}-a2-n0",) in w.launcher.downed_nodes  # every part given back at the end


def test_on_a_launcher_that_refills_clusters_the_next_attempt_launches_onto_the_same_one(world):
    """As on SkyPilot: the lost node is not given back alone (it cannot be), the next
    attempt is launched onto the failed attempt's cluster, which keeps the running
    node and provisions only the missing one."""
    w = world
    refilled: list = []

    def refill(previous, request):  # type: ignore[no-untyped-def]
        refilled.append((previous, request))
        return LaunchHandle(previous.cluster_name, "fake", w.launcher._ids(request), (), "rf")

    w.launcher.abilities = LauncherAbilities(
        restarts_in_place=True, keeps_survivors=True, refills_clusters=True
    )
    w.launcher.refill = refill  # type: ignore[attr-defined]
    preempt_node_1_after_a_save_at_40(w)
    for _ in range(30):
        w.tick(5.0)
        if refilled:
            break
    ((previous, request),) = refilled
    assert previous.cluster_name == f"{w.job}-a1" and request.attempt == 2
    assert request.placement.num_nodes == 2 and request.placement.region == "r1"
    assert w.launcher.downed == [] and len(w.launcher.launched) == 1  # nothing else


def test_a_group_across_two_launches_restarts_in_place_as_one(world):
    """After a replacement joined a kept node, a transport error restarts both where
    they are: each launch in place, node ranks and rendezvous as before."""
    from orchestrator.contract import EventKind
    from orchestrator.domain import reconcile as rc
    from orchestrator.domain.failures import FailureClass
    from orchestrator.store import work

    w = world
    w.launcher.abilities = LauncherAbilities(
        restarts_in_place=True, keeps_survivors=True, releases_single_nodes=True
    )
    preempt_node_1_after_a_save_at_40(w)
    w.run_until_launched(2)
    w.recovered(2, 40)
    with w.sm.begin() as s:
        work.record_failure(s, w.job, 2, rc.RecordFailure(
            EventKind.RANK_EXIT, FailureClass.NCCL_TRANSPORT, f"{w.job}-a2-n1",
            "Connection reset by peer"), w.now)  # fmt: skip
    for k in range(2):
        w.report(2, k, {"key": "y", "kind": "node_exit", "exit_code": 1, "reason": "transport"})
    for _ in range(30):
        w.tick(5.0)
        if len(w.launcher.restarted) >= 3:
            break
    (_, again_kept, again_joined) = w.launcher.restarted
    assert [(r.node_rank_base, r.placement.num_nodes) for r in (again_kept, again_joined)] == [
        (0, 1),
        (1, 1),
    ]
    assert again_joined.env[Env.MASTER_ADDR] == "10.0.0.2"
    assert len(w.launcher.launched) == 2  # nothing new provisioned


def test_a_checkpoint_a_node_cannot_stage_fails_the_job_with_the_node_s_reason(world):
    w = world
    start_running(w)
    write_checkpoint(w.ckpt, 10)
    write_checkpoint(w.ckpt, 20)
    w.launcher.dead.add(f"{w.job}-a1-n0")
    w.run_until_launched(2)
    w.agents_up(2, resumed=20, step=20)
    w.staged(2, 20, ok=False, detail="__1_0.distcp: sha256 mismatch")
    w.run_until("FAILED")
    with w.sm() as s:
        job = repo.get_job(s, w.job)
    assert "could not stage step_20" in job.status_reason
    assert "__1_0.distcp: sha256 mismatch" in job.status_reason
    assert w.launcher.downed[-1] == f"{w.job}-a2"  # nothing trains on it


def test_a_service_restart_mid_protocol_carries_on_where_it_was(world):
    w = world
    start_running(w)
    write_checkpoint(w.ckpt, 10)
    w.launcher.dead.add(f"{w.job}-a1-n1")
    for _ in range(4):
        w.tick()
    w.rec = w.reconciler()  # a new process: nothing in memory
    w.report(1, 0, {"key": "x", "kind": "node_exit", "exit_code": 1, "reason": "stopped"})
    w.run_until_launched(2)
    assert [r.attempt for r in w.launcher.launched] == [1, 2]
    assert [c.type for c in w.commands()] == ["stop"]  # the command was not sent twice


def test_the_restart_limit_ends_the_job_failed_with_the_reason(world):
    w = world
    start_running(w)
    with w.sm.begin() as s:
        repo.get_job(s, w.job).restart_count = 3
    w.launcher.dead.add(f"{w.job}-a1-n1")
    w.run_until("FAILED")
    with w.sm() as s:
        assert "restart limit reached (3 restarts)" in repo.get_job(s, w.job).status_reason
        assert s.query(Attempt).filter_by(job_id=w.job).count() == 1


def test_only_one_reconciler_holds_the_lease(world):
    w = world
    other = w.reconciler()
    assert w.rec.acquire_lease(T0)
    assert not other.acquire_lease(T0 + timedelta(seconds=5))
    assert other.acquire_lease(T0 + timedelta(seconds=11))  # the first one went silent


def _measured(w: World, blocking_s: float | None, step_time: float = 0.1) -> None:
    with w.sm.begin() as s:
        for k in range(2):
            nid = f"{w.job}-a1-n{k}"
            ranks = [
                {
                    "rank": 2 * k + i,
                    "step": 50,
                    "step_time": step_time,
                    "report_age_s": 0.1,
                    "resumed": {"step": 0, "manifest_digest": None},
                }
                for i in range(2)
            ]
            agents.record_heartbeat(
                s, w.job, 1, nid, {"state": "running", "ranks": ranks}, now=w.now
            )
    body = {"key": "c50", "kind": "checkpoint", "step": 50, "path": "/x", "world_size": 4}
    if blocking_s is not None:
        body["blocking_s"] = blocking_s
    w.report(1, 0, body)


def test_a_running_job_moves_toward_the_interval_for_its_measured_save_time_x4_a_push(world):
    w = world
    start_running(w)
    _measured(w, blocking_s=0.5)
    w.tick()
    (cmd,) = w.commands()
    # Llama 3's rate on 4 ranks: the interval for 0.5 s saves is over an hour, tens of
    # thousands of 0.1 s steps; one push moves the 10 steps at most four times.
    assert (cmd.type, cmd.args["every_steps"]) == ("set_checkpoint_every", 40)
    with w.sm() as s:
        (e,) = [e for e in repo.list_events(s, w.job) if e.kind == "checkpoint_interval"]
    assert "was 10" in e.message and "0.500 s blocking saves" in e.message
    assert e.details["interval_seconds"] > 3600
    for _ in range(5):  # the ranks go on reporting: not advised again for a while
        _measured(w, blocking_s=0.5)
        w.tick(5.0)
    assert len(w.commands()) == 1


def test_no_interval_is_pushed_without_a_measured_save_time_or_when_not_adaptive(world):
    w = world
    start_running(w)
    _measured(w, blocking_s=None)
    w.tick()
    assert w.commands() == []
    with w.sm.begin() as s:
        job = repo.get_job(s, w.job)
        job.spec = {**job.spec, "checkpoint": {**job.spec["checkpoint"], "adaptive": False}}
    _measured(w, blocking_s=0.5)
    w.tick(61)
    assert w.commands() == []


def test_a_replacement_with_less_gpu_memory_gets_replanned_knobs_and_the_same_global_batch(
    db_url, tmp_path
):
    """The local launcher's declared memory: 80 GiB first, 40 GiB for replacements."""
    from orchestrator.launchers.local import LocalLauncher, LocalLauncherConfig

    local = LocalLauncher(
        tmp_path / "nodes",
        "http://svc",
        lambda j, a: "t",
        LocalLauncherConfig(gpu_memory_gib=80, replacement_gpu_memory_gib=40),
    )
    w = World(db_url, tmp_path)
    try:
        model = {
            "parameters": 1_300_000_000,
            "layers": 24,
            "hidden_size": 2048,
            "heads": 16,
            "seq_len": 2048,
            "global_batch": 64,
            "micro_batch": 8,
            "sharding": "ddp",
        }
        with w.sm.begin() as s:
            job = repo.get_job(s, w.job)
            job.spec = {**job.spec, "model": model}
        w.launcher.candidates = local.candidates  # type: ignore[method-assign]
        start_running(w)
        first = w.launcher.launched[0].env
        assert first[Env.ACTIVATION_CHECKPOINT_EVERY] == "0"
        write_checkpoint(w.ckpt, 10)
        w.launcher.dead.add(f"{w.job}-a1-n1")
        w.run_until_launched(2)
        second = w.launcher.launched[1].env
        assert second[Env.ACTIVATION_CHECKPOINT_EVERY] == "2"  # recompute to fit 40 GiB
        assert second[Env.GLOBAL_BATCH] == first[Env.GLOBAL_BATCH] == "64"
        knobs = (int(second[Env.MICRO_BATCH]), int(second[Env.GRAD_ACCUM]))
        assert knobs[0] * knobs[1] * 4 == 64  # 4 data-parallel ranks
        with w.sm() as s:
            (sel,) = [r for r in s.query(StepRow).filter_by(step="select_replacement")]
        assert "for 40 GiB" in sel.detail
    finally:
        w.engine.dispose()


def test_a_loss_spike_rolls_back_past_newer_checkpoints_and_stages_the_older_one(world):
    """Checkpoints at 10..40, a spike that began at step 30: the ranks resume from
    step 20, staged and verified, although 30 and 40 are complete."""
    w = world
    start_running(w)
    for step in (10, 20, 30, 40):
        write_checkpoint(w.ckpt, step)
    w.report(
        1, 0,
        {"key": "s", "kind": "anomaly", "rank": 0, "finding": "loss_spike", "step": 30},
    )  # fmt: skip
    w.tick()
    assert w.status() == "RECOVERING"
    for k in range(2):
        w.report(1, k, {"key": "x", "kind": "node_exit", "exit_code": 75, "reason": "stopped"})
    w.run_until_launched(2)
    req = w.launcher.launched[-1]
    assert req.env[Env.RESUME_FROM] == "{node_disk}/staged/step_20"
    assert req.env[Env.EXPECTED_STEP] == "20"
    assert req.env[Env.STAGE_FROM] == f"file://{w.ckpt}/step_20"
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
    assert inc["failure_class"] == "loss_spike" and inc["remedy"] == "rollback_last_good"


def test_a_launch_refused_for_capacity_is_replanned_into_the_next_region(world):
    w = world
    w.launcher.stocked_out.add("r1")
    w.tick()  # attempt 1 recorded in r1
    w.tick()  # refused: InsufficientInstanceCapacity
    w.tick(10)  # after the backoff: re-planned into r2
    w.tick()  # started
    w.tick()  # up
    with w.sm() as s:
        (a,) = s.query(Attempt).filter_by(job_id=w.job).all()
        assert (a.region, a.state) == ("r2", "running")
    assert [r.placement.region for r in w.launcher.launched] == ["r2"]


def test_a_straggler_reported_by_rank_0_is_blamed_on_the_slow_rank_s_node(world):
    w = world
    start_running(w)
    for k, step in enumerate((40, 50)):
        body = {"key": f"s{k}", "kind": "anomaly", "rank": 0, "finding": "slow_peer",
                "step": step, "detail": {"kind": "straggler", "slow_rank": 2}}  # fmt: skip
        w.report(1, 0, body)
        w.tick()
        assert w.status() == "RUNNING"  # two slow windows are noise
    body = {"key": "s2", "kind": "anomaly", "rank": 0, "finding": "slow_peer", "step": 60,
            "detail": {"kind": "straggler", "slow_rank": 2}}  # fmt: skip
    w.report(1, 0, body)
    w.tick()
    assert w.status() == "RECOVERING"
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
    assert inc["failure_class"] == "slow_peer" and inc["node_id"] == f"{w.job}-a1-n1"
    w.tick()
    (cmd,) = w.commands()
    assert cmd.type == "checkpoint_and_stop"  # every node is alive: save first


def test_one_tick_carries_a_recovery_through_every_step_that_only_records(world):
    w = world
    start_running(w)
    w.agents_up(1, resumed=0, step=40)
    w.report(1, 1, {"key": "n1", "kind": "preemption_notice", "provider": "aws"})
    assert w.rec.acquire_lease(w.now)
    w.now += timedelta(seconds=1)
    w.rec.tick(w.now)  # the incident opened, detect done, and the ranks told to save
    assert w.status() == "RECOVERING"
    assert [c.type for c in w.commands()] == ["checkpoint_and_stop"]
    write_checkpoint(w.ckpt, 30)
    write_checkpoint(w.ckpt, 40)
    for k in range(2):
        w.report(1, k, {"key": "x", "kind": "node_exit", "exit_code": 75, "reason": "saved"})
    w.now += timedelta(seconds=1)
    applied = w.rec.reconcile_rounds(w.job, w.now)
    # Confirm, release, select and the new attempt's record: one tick, not one each.
    assert [r.attempt for r in w.launcher.launched] == [1, 2]
    assert w.launcher.downed == [f"{w.job}-a1"]
    assert sum(isinstance(a, rc.FinishStep) for a in applied) >= 3
    # With nothing new, the next tick is one round that applies nothing.
    w.now += timedelta(seconds=1)
    w.rec.reconcile_rounds(w.job, w.now)
    assert w.rec.reconcile_rounds(w.job, w.now) == []

