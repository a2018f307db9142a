"""What happened that someone should hear about, read from the store.

An event has a key that names it once and for all (``incident_opened:42``,
``job_failed:<job>``): the outbox's unique (key, target) constraint is what makes a
restarted service, or a second replica, queue it once. Detection reads only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.domain.protocol import ProtocolStep as Step
from orchestrator.domain.status import JobStatus
from orchestrator.store.models import FailureEvent, Job, ProtocolStep


class AlertKind(StrEnum):
    INCIDENT_OPENED = "incident_opened"  # the restart protocol started (detect step)
    INCIDENT_CLOSED = "incident_closed"  # its validate step ended, or the job ended
    JOB_FAILED = "job_failed"
    JOB_SUCCEEDED = "job_succeeded"


@dataclass(frozen=True)
class AlertEvent:
    key: str
    kind: AlertKind
    job_id: str
    job_name: str
    at: datetime
    text: str
    """One line for people (Slack's ``text``)."""
    fields: dict[str, Any] = field(default_factory=dict)

    def body(self, dashboard_url: str = "") -> dict[str, Any]:
        """A Slack-compatible body: ``text`` is what Slack shows; the rest is for
        receivers that read JSON (Slack ignores keys it does not know)."""
        link = f"{dashboard_url.rstrip('/')}/dashboard/jobs/{self.job_id}" if dashboard_url else ""
        return {
            "text": self.text + (f" <{link}|open>" if link else ""),
            "event": self.kind.value,
            "event_id": self.key,
            "job_id": self.job_id,
            "job_name": self.job_name,
            "at": self.at.isoformat(),
            **self.fields,
        }


def _utc(d: datetime) -> datetime:
    return d if d.tzinfo else d.replace(tzinfo=UTC)


def detect_events(s: Session, *, since: datetime | None = None) -> list[AlertEvent]:
    """Every event visible now (``since``: only incidents and jobs touched after it).
    The caller drops the keys it has already queued."""
    jobs_q = select(Job)
    if since is not None:
        jobs_q = jobs_q.where(Job.updated_at >= since)
    out: list[AlertEvent] = []
    for j in s.scalars(jobs_q):
        st = JobStatus(j.status)
        if st in (JobStatus.FAILED, JobStatus.SUCCEEDED):
            kind = AlertKind.JOB_FAILED if st is JobStatus.FAILED else AlertKind.JOB_SUCCEEDED
            out.append(
                AlertEvent(
                    f"{kind.value}:{j.id}",
                    kind,
                    j.id,
                    j.name,
                    _utc(j.updated_at),
                    f"skyresume: job {j.name} ({j.id}) {st.value.lower()}"
                    + (f": {j.status_reason}" if j.status_reason else ""),
                    {"status": st.value, "reason": j.status_reason},
                )
            )
    steps_q = select(ProtocolStep)
    if since is not None:
        touched = select(ProtocolStep.incident_id).where(
            (ProtocolStep.started_at >= since) | (ProtocolStep.finished_at >= since)
        )
        steps_q = steps_q.where(ProtocolStep.incident_id.in_(touched))
    by_incident: dict[int, list[ProtocolStep]] = defaultdict(list)
    for r in s.scalars(steps_q):
        by_incident[r.incident_id].append(r)
    if not by_incident:
        return out
    events = {
        e.id: e for e in s.scalars(select(FailureEvent).where(FailureEvent.id.in_(by_incident)))
    }
    jobs = {
        j.id: j
        for j in s.scalars(
            select(Job).where(Job.id.in_({r[0].job_id for r in by_incident.values()}))
        )
    }
    for inc, steps in sorted(by_incident.items()):
        job = jobs[steps[0].job_id]
        ev = events.get(inc)
        cls = (ev.failure_class if ev else None) or "unknown"
        common = {"incident_id": inc, "failure_class": cls, "node_id": ev.node_id if ev else None}
        opened = min(_utc(r.started_at) for r in steps)
        out.append(
            AlertEvent(
                f"{AlertKind.INCIDENT_OPENED.value}:{inc}",
                AlertKind.INCIDENT_OPENED,
                job.id,
                job.name,
                opened,
                f"skyresume: incident #{inc} opened on job {job.name} ({job.id}): {cls}"
                + (f" on {ev.node_id}" if ev and ev.node_id else ""),
                {**common, "message": (ev.message or "")[:500] if ev else ""},
            )
        )
        validate = next((r for r in steps if r.step == Step.VALIDATE.value), None)
        failed = next((r for r in steps if r.outcome == "failed"), None)
        ended: datetime | None = None
        outcome = ""
        if validate is not None and validate.finished_at is not None:
            ended, outcome = _utc(validate.finished_at), validate.outcome or "ok"
        elif JobStatus(job.status).is_terminal():  # the job ended mid-protocol
            ended = _utc(job.updated_at)
            outcome = f"failed at {failed.step}" if failed else f"job {job.status.lower()}"
        if ended is not None:
            mttr = (ended - _utc(ev.occurred_at)).total_seconds() if ev else None
            out.append(
                AlertEvent(
                    f"{AlertKind.INCIDENT_CLOSED.value}:{inc}",
                    AlertKind.INCIDENT_CLOSED,
                    job.id,
                    job.name,
                    ended,
                    f"skyresume: incident #{inc} closed on job {job.name} ({job.id}): "
                    f"{cls}, {outcome}" + (f", MTTR {mttr:.1f} s" if mttr is not None else ""),
                    {**common, "outcome": outcome, "mttr_seconds": mttr},
                )
            )
    return out
