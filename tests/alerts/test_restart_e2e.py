"""A real ``skyresume serve`` sends alerts to a real receiver; it is stopped while an
incident closes and the job fails, and started again: the receiver gets every event
exactly once (nothing lost while it was down, nothing repeated after)."""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from webhook_receiver import SECRET, Receiver

from orchestrator.domain.protocol import ORDER
from orchestrator.domain.status import JobStatus
from orchestrator.store import repo
from orchestrator.store.models import ProtocolStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from operator_service import Serve

pytestmark = pytest.mark.long


def wait_for(receiver: Receiver, events: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events <= set(receiver.delivered()):
            return
        time.sleep(0.2)
    pytest.fail(f"waited for {sorted(events)}, got {receiver.delivered()}")


def test_each_event_reaches_the_receiver_once_across_a_service_restart(
    tmp_path: Path, receiver: Receiver
) -> None:
    serve = Serve(
        tmp_path / "home",
        SKYRESUME_ALERT_WEBHOOK_URL=receiver.url,
        SKYRESUME_ALERT_WEBHOOK_SECRET=SECRET,
        SKYRESUME_ALERTS_INTERVAL_S="0.3",
    )
    serve.start()
    try:
        job = serve.new_job()
        serve.add_attempt(job)
        now = datetime.now(UTC)
        with serve.sessionmaker() as s, s.begin():
            repo.set_status(s, job, JobStatus.PROVISIONING, now=now)
            repo.set_status(s, job, JobStatus.RUNNING, now=now)
            ev, _ = repo.record_event(
                s, job, idempotency_key="k1", kind="incident", failure_class="node_lost",
                node_id="n0", message="no heartbeat from n0", occurred_at=now, now=now,
            )  # fmt: skip
            incident = ev.id
            s.add(
                ProtocolStep(job_id=job, incident_id=incident, step=ORDER[0].value, started_at=now)
            )
        wait_for(receiver, {f"incident_opened:{incident}"})

        serve.stop()
        later = now + timedelta(seconds=5)
        with serve.sessionmaker() as s, s.begin():
            first = s.query(ProtocolStep).filter_by(incident_id=incident).one()
            first.finished_at, first.outcome = later, "ok"
            for step in ORDER[1:]:
                s.add(
                    ProtocolStep(
                        job_id=job, incident_id=incident, step=step.value, started_at=later,
                        finished_at=later, outcome="ok",
                    )
                )  # fmt: skip
            repo.set_status(s, job, JobStatus.FAILED, reason="restart limit reached", now=later)
        serve.start()
        wait_for(
            receiver,
            {f"incident_opened:{incident}", f"incident_closed:{incident}", f"job_failed:{job}"},
        )
        time.sleep(2)  # a few more ticks of the loop: nothing is sent again
    finally:
        serve.close()
    got = receiver.delivered()
    assert sorted(got) == sorted(
        [f"incident_opened:{incident}", f"incident_closed:{incident}", f"job_failed:{job}"]
    ), got
    assert all(g["signed"] for g in receiver.got)
    closed = next(g["body"] for g in receiver.got if g["event"] == f"incident_closed:{incident}")
    assert closed["failure_class"] == "node_lost" and closed["mttr_seconds"] == 5.0
