"""Seed data and helpers for the dashboard tests (a module, so tests can import them)."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

# The failure-history builder lives with the goodput tests; both folders use it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "goodput"))

from goodput_history import LOST_STEPS, JobHistory, at, two_incident_job

from orchestrator.domain.status import JobStatus
from orchestrator.store.models import Checkpoint, Job, JobTransition, ProgressSample

#: The running job's time series: 2 ranks, one sample every 10 s from 110 s to 400 s.
SAMPLE_TIMES = list(range(110, 401, 10))

#: What a hostile job or log could carry into a page.
EVIL = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def seed(app) -> dict[str, str]:
    """Two jobs through the models: a finished one with two incidents, and a running
    one whose name, messages, log lines and class carry markup."""
    with app.state.sessionmaker() as s:
        good = two_incident_job(s, "gpt-7b-spot")
        bad = JobHistory(s, "evil", submitted=50)
        bad.status(JobStatus.PROVISIONING, 60).status(JobStatus.RUNNING, 400)
        bad.attempt(1, 100, None, region="eu-west-1", instance_type="p5.48xlarge", last_step=70)
        bad.event(
            300,
            "rank_exit",
            "user_code_error",
            message=f"Traceback: ValueError {EVIL}",
            details={"log_tail": ["line 1", f"raise ValueError('{EVIL}')"]},
            node_id="n0",
        )
        bad.incident(350, f"weird{EVIL}"[:64], LOST_STEPS, last_step=70, attempt=1, finished=3)
        for rank in (0, 1):
            for k, t in enumerate(SAMPLE_TIMES):
                s.add(
                    ProgressSample(
                        job_id=bad.id,
                        attempt=1,
                        node_id=f"{bad.id}-a1-n0",
                        rank=rank,
                        at=at(t),
                        step=2 * k,
                        step_time=0.5,
                        loss=4.0 - 0.1 * k - 0.01 * rank,
                        grad_norm=1.0 + 0.01 * k,
                    )
                )
        s.add(
            Checkpoint(
                job_id=bad.id,
                step=20,
                uri="s3://ckpt/evil/20",
                status="complete",
                created_at=at(210),
            )
        )
        # The API refuses such a name (spec validation); the store must still be safe.
        s.get(Job, bad.id).name = f"x{EVIL}"[:63]
        s.add(
            JobTransition(
                job_id=bad.id,
                from_status="RUNNING",
                to_status="RUNNING",
                reason=EVIL,
                at=datetime(2026, 11, 3, 8, 7, tzinfo=UTC),
            )
        )
        s.commit()
        return {"good": good.id, "evil": bad.id}


def make_app(url: str, home: Path):  # type: ignore[no-untyped-def]
    from orchestrator.app import create_app
    from orchestrator.settings import Settings
    from orchestrator.store import db

    db.upgrade(url)
    return create_app(Settings(home=home, database_url=url))


def client(app):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    return TestClient(app, follow_redirects=False)


def login(c, token: str) -> None:  # type: ignore[no-untyped-def]
    r = c.post("/dashboard/login", data={"token": token, "next": "/dashboard/"})
    assert r.status_code == 303, r.text
