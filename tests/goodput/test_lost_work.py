"""Goodput counts the work a restart threw away (issue 27): steps redone after a
resume from an older checkpoint or from scratch, and for a plain script that sends no
progress reports, the failed attempt's training time when it restarted from scratch."""

from __future__ import annotations

import pytest
from goodput_history import LOST_STEPS, JobHistory, plain_script_job, steps_end

from orchestrator.domain.status import JobStatus
from orchestrator.store.goodput import job_goodput


def test_a_plain_script_restarted_from_scratch_loses_its_training_time(session):
    h = plain_script_job(session)
    session.commit()
    r = job_goodput(session, h.id)
    (inc,) = r.incidents
    # Up at 120 s, the node lost at 1,320 s: 20 minutes of training thrown away.
    assert inc.lost_work_seconds == pytest.approx(1200.0)
    assert r.lost_work_seconds == pytest.approx(1200.0)
    assert inc.steps_lost is None  # no steps to count: the time is what was lost
    assert r.productive_seconds + r.failure_seconds + r.lost_work_seconds + r.idle_seconds == (
        pytest.approx(r.wall_seconds)
    )
    assert r.productive_seconds < r.wall_seconds - 1200


def test_a_plain_script_with_its_own_snapshot_has_unknown_not_zero_lost_work(session):
    own = {"path": "{node_disk}/snapshot.pt", "resume_arg": "--snapshot_path"}
    h = plain_script_job(session, checkpoint={"uri": "file:///ckpt", "own": own})
    session.commit()
    (inc,) = job_goodput(session, h.id).incidents
    assert (inc.steps_lost, inc.resume_step) == (None, None)  # unknown, said as unknown


def test_a_restart_from_scratch_loses_every_step_trained(session):
    h = JobHistory(session, "minimal")
    h.status(JobStatus.PROVISIONING, 30)
    h.attempt(1, 60, 1340, up=120, last_step=2687, end_reason="node lost")
    h.status(JobStatus.RUNNING, 130)
    lost = h.incident(1320, "node_lost", LOST_STEPS, last_step=2687, attempt=1)
    h.attempt(2, steps_end(1320, LOST_STEPS[:4]), None, resume_step=0, incident_id=lost.id)
    session.commit()
    r = job_goodput(session, h.id)
    (inc,) = r.incidents
    assert inc.steps_lost == 2687
    assert inc.lost_work_seconds == pytest.approx(2687 * 1.9)  # the slowest rank's step
