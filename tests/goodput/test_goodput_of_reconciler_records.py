"""Goodput on what the real reconciler writes (not on hand-built rows): a node is lost,
the restart protocol runs its seven steps with a fake launcher and agents played
through the store functions the agent routes call, and the report must agree with
the reconciler's own incident record."""

from __future__ import annotations

import hashlib
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from testkit import FakeLauncher

from orchestrator.contract import COMMIT_NAME, MANIFEST_NAME, Manifest, ManifestFile, commit_marker
from orchestrator.domain.protocol import ORDER
from orchestrator.domain.spec import validate_job_spec
from orchestrator.reconciler.loop import Reconciler
from orchestrator.store import agents, db, repo
from orchestrator.store.goodput import job_goodput
from orchestrator.store.incidents import incidents

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _checkpoint(root: Path, step: int) -> None:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    files = []
    for r in range(4):
        data = os.urandom(256)
        (d / f"__{r}_0.distcp").write_bytes(data)
        files.append(ManifestFile(f"__{r}_0.distcp", len(data), hashlib.sha256(data).hexdigest()))
    (d / ".metadata").write_bytes(b"meta")
    files.append(ManifestFile(".metadata", 4, hashlib.sha256(b"meta").hexdigest()))
    m = Manifest(step, 4, T0.isoformat(), tuple(files)).to_json()
    (d / MANIFEST_NAME).write_bytes(m)
    (d / COMMIT_NAME).write_bytes(commit_marker(m))


@pytest.mark.slow
def test_goodput_agrees_with_the_reconcilers_incident_after_a_lost_node(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    sm = db.make_sessionmaker(engine)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    launcher = FakeLauncher(tmp_path / "disks")
    spec = validate_job_spec(
        {
            "name": "t",
            "task": {"template": "gpt-cpu", "command": "python train.py"},
            "num_nodes": 2,
            "ranks_per_node": 2,
            "checkpoint": {"uri": f"file://{ckpt}", "every_steps": 10},
            "restarts": {"max_restarts": 3, "heartbeat_timeout_s": 30, "grace_period_s": 60},
        }
    )
    now = T0
    with sm.begin() as s:
        job = repo.create_job(s, spec, now=now).id
    rec = Reconciler(sm, launcher, "http://svc")

    def tick(seconds: float) -> str:
        nonlocal now
        now += timedelta(seconds=seconds)
        rec.reconcile(job, now=now)
        with sm() as s:
            return repo.get_job(s, job).status

    def agents_up(attempt: int, *, resumed: int, step: int) -> None:
        with sm.begin() as s:
            for k in range(2):
                nid = f"{job}-a{attempt}-n{k}"
                agents.register_node(s, job, attempt, nid, node_rank=k, now=now)
                ranks = [
                    {
                        "rank": 2 * k + i,
                        "step": step,
                        "step_time": 0.5 + 0.25 * i,
                        "resumed": {"step": resumed, "manifest_digest": f"d{resumed}"},
                        "report_age_s": 0.1,
                    }
                    for i in range(2)
                ]
                body = {"state": "running", "ranks": ranks}
                agents.record_heartbeat(s, job, attempt, nid, body, now=now)

    assert tick(1) == "PROVISIONING"
    tick(1)  # the attempt is committed first; its nodes start on the next tick
    agents_up(1, resumed=0, step=0)
    tick(1)  # every node registered: the attempt is up
    assert tick(1) == "RUNNING"
    _checkpoint(ckpt, 20)
    agents_up(1, resumed=0, step=27)
    tick(60)  # an hour of training would be the same story; a minute keeps it short
    launcher.dead.add(f"{job}-a1-n1")
    tick(1)
    assert tick(1) == "RECOVERING"
    tick(1)
    with sm.begin() as s:
        agents.record_report(
            s,
            job,
            1,
            f"{job}-a1-n0",
            {"key": "x", "kind": "node_exit", "exit_code": 1, "reason": "stopped"},
            now=now,
        )
    for _ in range(30):
        tick(5)
        if any(r.attempt == 2 for r in launcher.launched):
            break
    agents_up(2, resumed=20, step=20)
    with sm.begin() as s:  # each new node staged step 20 before its ranks started
        for k in range(2):
            nid = f"{job}-a2-n{k}"
            uri = f"file://{ckpt}/step_20"
            body = {"key": "staged", "kind": "staged", "node_id": nid, "step": 20, "ok": True,
                    "detail": "", "bytes": 1024, "seconds": 0.2, "uri": uri}  # fmt: skip
            agents.record_report(s, job, 2, nid, body, now=now)
    for _ in range(5):
        if tick(3) == "RUNNING":
            break
    assert tick(0) == "RUNNING"
    tick(30)

    with sm() as s:
        (theirs,) = incidents(s, job)
        report = job_goodput(s, job, now=now)
    engine.dispose()

    (mine,) = report.incidents
    assert mine.id == theirs["id"] and mine.failure_class == theirs["failure_class"] == "node_lost"
    assert (mine.last_step, mine.resume_step, mine.steps_lost) == (27, 20, theirs["steps_lost"])
    assert (mine.failed_attempt, mine.recovered_by) == (1, 2)
    assert list(mine.step_seconds) == [str(s) for s in ORDER]  # all seven, in order
    assert not mine.ongoing and report.live
    assert mine.mttr_seconds == pytest.approx(theirs["mttr_s"])
    assert report.step_seconds == pytest.approx(0.75)  # the slowest rank
    assert mine.lost_work_seconds == pytest.approx(7 * 0.75)
    parts = (
        report.productive_seconds
        + report.idle_seconds
        + report.failure_seconds
        + report.lost_work_seconds
        + report.checkpoint_seconds
    )
    assert parts == pytest.approx(report.wall_seconds)
    assert 0 < report.effective_training_fraction < 1
