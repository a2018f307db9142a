"""Goodput gathered from the database (SQLite and PostgreSQL) as the reconciler writes it."""

from __future__ import annotations

import pytest
from goodput_history import LOST_STEPS, NOTICE_STEPS, JobHistory, at, reread, two_incident_job

from orchestrator.domain.protocol import ORDER
from orchestrator.domain.status import JobStatus
from orchestrator.store import repo
from orchestrator.store.goodput import job_goodput
from orchestrator.store.incidents import fleet_incidents


def test_incident_mttr_is_its_protocol_steps_and_steps_lost_is_last_step_minus_resume(session):
    h = two_incident_job(session)
    reread(session)
    r = job_goodput(session, h.id)

    notice, lost = r.incidents
    assert (notice.failure_class, lost.failure_class) == ("preemption_notice", "node_lost")
    assert (notice.kind, lost.kind) == ("preemption_notice", "node_lost")  # the causes
    assert notice.mttr_seconds == pytest.approx(sum(s for _, s in NOTICE_STEPS))
    assert notice.step_seconds == pytest.approx({str(k): v for k, v in NOTICE_STEPS})
    assert list(notice.step_seconds) == [str(s) for s in ORDER]  # protocol order
    assert lost.mttr_seconds == pytest.approx(349.0)
    # The emergency save came after the last heartbeat: nothing redone, not -3.
    assert (notice.last_step, notice.resume_step, notice.steps_lost) == (1872, 1875, 0)
    assert (lost.last_step, lost.resume_step, lost.steps_lost) == (4263, 4200, 63)
    assert lost.lost_work_seconds == pytest.approx(63 * 1.9)
    assert (notice.failed_attempt, notice.recovered_by) == (1, 2)
    assert (lost.failed_attempt, lost.recovered_by) == (2, 3)
    assert (lost.cloud, lost.region, lost.instance_type) == ("gcp", "us-central1", "a2-highgpu-8g")
    assert not notice.ongoing and not lost.ongoing
    assert [s.outcome for s in lost.steps][:2] == ["ok", "skipped"]


def test_wall_time_is_productive_plus_idle_failure_and_lost_work(session):
    h = two_incident_job(session)
    reread(session)
    r = job_goodput(session, h.id)

    assert r.wall_seconds == pytest.approx(18_000)
    assert r.idle_seconds == pytest.approx(300)  # queued until the first launch
    assert r.failure_seconds == pytest.approx(460 + 349)
    assert r.lost_work_seconds == pytest.approx(63 * 1.9)
    assert r.step_seconds == pytest.approx(1.9)  # the slowest rank, not the mean rank
    parts = (
        r.productive_seconds
        + r.idle_seconds
        + r.failure_seconds
        + r.lost_work_seconds
        + r.checkpoint_seconds
    )
    assert parts == pytest.approx(r.wall_seconds)
    assert r.effective_training_fraction == pytest.approx((18_000 - 300 - 809 - 119.7) / 18_000)
    assert r.restart_count == 2 and not r.live


def test_each_incident_is_priced_at_the_plan_of_the_attempt_that_failed(session):
    h = two_incident_job(session)
    reread(session)
    r = job_goodput(session, h.id)

    notice, lost = r.incidents
    assert notice.usd == pytest.approx(460 * 2 * 11.57 / 3600)  # AWS attempt
    assert lost.usd == pytest.approx((349 + 63 * 1.9) * 2 * 8.82 / 3600)  # GCP attempt
    assert r.lost_usd == pytest.approx(notice.usd + lost.usd)
    up = [(3650 - 300, 11.57), (10_830 - (3600 + 137.7), 8.82), (18_000 - 10_897.5, 8.82)]
    assert r.total_usd == pytest.approx(sum(s * 2 * p / 3600 for s, p in up))


def test_unknown_price_is_unknown_dollars_not_zero(session):
    h = JobHistory(session)
    h.status(JobStatus.PROVISIONING, 10)
    h.attempt(1, 20, 1000, price=None, last_step=400)
    ev = h.incident(900, "nccl_timeout", LOST_STEPS, last_step=400)
    h.attempt(2, 1000, None, resume_step=300, incident_id=ev.id)
    reread(session)
    r = job_goodput(session, h.id, now=at(5000))
    assert r.incidents[0].usd is None and r.lost_usd is None and r.total_usd is None
    assert r.incidents[0].steps_lost == 100


def test_recovery_in_progress_runs_until_now_with_steps_lost_unknown(session):
    h = JobHistory(session)
    h.status(JobStatus.PROVISIONING, 0).status(JobStatus.RUNNING, 200)
    h.attempt(1, 60, 2000, last_step=900)
    h.incident(2000, "gpu_hardware", NOTICE_STEPS, last_step=900, finished=5)  # launching
    h.status(JobStatus.RECOVERING, 2000)
    reread(session)

    r = job_goodput(session, h.id, now=at(2500))
    (inc,) = r.incidents
    assert inc.ongoing and r.live
    assert inc.steps_lost is None and inc.recovered_by is None
    assert inc.mttr_seconds == pytest.approx(500)  # detection to now, so far
    assert inc.steps[-1].step == "launch" and inc.steps[-1].finished_at is None
    assert "validate" not in inc.step_seconds
    assert r.wall_seconds == pytest.approx(2500)
    # An hour later the same open incident has cost an hour more.
    later = job_goodput(session, h.id, now=at(6100))
    assert later.incidents[0].mttr_seconds == pytest.approx(500 + 3600)


def test_without_last_step_the_failed_attempts_last_heartbeat_stands_in(session):
    h = JobHistory(session)
    h.status(JobStatus.PROVISIONING, 0)
    h.attempt(1, 60, 3000, last_step=1234)
    ev = h.incident(3000, "host_oom_killed", LOST_STEPS, last_step=None)
    h.attempt(2, 3100, None, resume_step=1200, incident_id=ev.id)
    reread(session)
    (inc,) = job_goodput(session, h.id, now=at(4000)).incidents
    assert (inc.last_step, inc.steps_lost) == (1234, 34)


def test_job_that_never_launched_is_all_idle(session):
    h = JobHistory(session, submitted=0)
    reread(session)
    r = job_goodput(session, h.id, now=at(600))
    assert r.idle_seconds == pytest.approx(600) and r.productive_seconds == 0
    assert r.effective_training_fraction == 0 and r.incidents == () and r.total_usd == 0


def test_unknown_job_is_not_found(session):
    with pytest.raises(repo.NotFound, match="j-nope"):
        job_goodput(session, "j-nope")


def test_fleet_places_each_incident_where_it_happened(session):
    a = two_incident_job(session, "gpt-a")
    b = JobHistory(session, "gpt-b", submitted=100)
    b.status(JobStatus.PROVISIONING, 100)
    b.attempt(1, 200, None, cloud="aws", region="eu-west-1", instance_type="p5.48xlarge")
    b.event(500, "anomaly", "slow_peer")  # an event without a recovery is not an incident
    b.incident(900, "nccl_transport", LOST_STEPS, last_step=10, finished=2)
    reread(session)

    rows = fleet_incidents(session)
    assert [(r.job_id, r.failure_class, r.region, r.instance_type) for r in rows] == [
        (b.id, "nccl_transport", "eu-west-1", "p5.48xlarge"),
        (a.id, "preemption_notice", "us-east-1", "p4d.24xlarge"),
        (a.id, "node_lost", "us-central1", "a2-highgpu-8g"),
    ]
    assert [r.failure_class for r in fleet_incidents(session, since=at(5000))] == ["node_lost"]
    assert len(fleet_incidents(session, job_ids=[b.id])) == 1
