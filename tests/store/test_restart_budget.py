"""Which relaunches spend the job's restart budget (``restarts.max_restarts``): a
recovery from a failure does; an elastic grow, a planned reshape, does not."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from orchestrator.contract import AttemptState
from orchestrator.domain.spec import validate_job_spec
from orchestrator.store import db, repo, work
from orchestrator.store.models import Attempt

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SPEC = {
    "name": "t",
    "task": {"template": "gpt-cpu", "command": "python train.py"},
    "num_nodes": 3,
    "min_nodes": 2,
    "checkpoint": {"uri": "file:///tmp/ckpt", "every_steps": 10},
}


@pytest.mark.parametrize(
    "failure_class, counted",
    [("node_lost", 1), ("preemption_notice", 1), ("elastic_grow", 0)],
)
def test_an_attempt_up_spends_a_restart_unless_it_is_a_planned_grow(db_url, failure_class, counted):
    sm = db.make_sessionmaker(db.make_engine(db_url))
    with sm.begin() as s:
        job = repo.create_job(s, validate_job_spec(SPEC), now=T0)
        inc, _ = repo.record_event(
            s, job.id, idempotency_key="incident-a1", kind="incident",
            failure_class=failure_class, message="m", details={"attempt": 1}, now=T0,
        )  # fmt: skip
        recovery = Attempt(
            job_id=job.id, number=2, cloud="local", region="r", instance_type="cpu",
            num_nodes=3, spot=True, knobs={}, started_at=T0,
            state=AttemptState.LAUNCHING, handle={"node_ids": []}, incident_id=inc.id,
        )  # fmt: skip
        s.add(recovery)
        s.flush()
        work.attempt_up(s, job, job.id, 2, ("h0", "h1", "h2"), T0)
        assert job.restart_count == counted
        # Up once: a second report of the same attempt spends nothing more.
        work.attempt_up(s, job, job.id, 2, ("h0", "h1", "h2"), T0)
        assert job.restart_count == counted
