"""Repository functions: the only code that writes jobs, transitions and events.

Each function takes a Session and commits nothing; the caller owns the transaction
(one API request = one transaction). Status changes go through the domain's
transition table; an illegal move raises IllegalTransition, is logged, and writes
nothing.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrator.domain.spec import JobSpec
from orchestrator.domain.status import IllegalTransition, JobStatus, transition
from orchestrator.store.models import FailureEvent, Job, JobTransition

log = logging.getLogger(__name__)


def utcnow() -> datetime:
    return datetime.now(UTC)


class NotFound(LookupError):
    """No row with that id; the API turns it into a 404."""


def new_job_id() -> str:
    return "j-" + secrets.token_hex(5)


def create_job(
    session: Session, spec: JobSpec, *, task_yaml: str | None = None, now: datetime | None = None
) -> Job:
    """A PENDING job; ``task_yaml``: its SkyPilot task's text as read at submit."""
    now = now or utcnow()
    job = Job(
        id=new_job_id(),
        name=spec.name,
        status=JobStatus.PENDING,
        spec=spec.model_dump(mode="json"),
        task_yaml=task_yaml,
        restart_count=0,
        created_at=now,
        updated_at=now,
    )
    session.add(job)
    session.add(
        JobTransition(
            job_id=job.id, from_status=None, to_status=JobStatus.PENDING, reason="submitted", at=now
        )
    )
    session.flush()
    return job


def get_job(session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


@dataclass(frozen=True)
class Page:
    items: list[Any]
    total: int


def list_jobs(
    session: Session, *, status: JobStatus | None = None, limit: int = 50, offset: int = 0
) -> Page:
    q = select(Job)
    count = select(func.count()).select_from(Job)
    if status is not None:
        q = q.where(Job.status == status)
        count = count.where(Job.status == status)
    q = q.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit).offset(offset)
    return Page(list(session.scalars(q)), session.scalar(count) or 0)


def set_status(
    session: Session,
    job_id: str,
    target: JobStatus,
    *,
    reason: str | None = None,
    now: datetime | None = None,
) -> Job:
    """Move a job to ``target`` and append the transition, or raise IllegalTransition."""
    now = now or utcnow()
    job = get_job(session, job_id)
    current = JobStatus(job.status)
    try:
        transition(current, target)
    except IllegalTransition as e:
        log.warning("job %s: refused %s (reason given: %s)", job_id, e, reason)
        raise
    job.status = target
    job.status_reason = reason
    job.updated_at = now
    session.add(
        JobTransition(job_id=job_id, from_status=current, to_status=target, reason=reason, at=now)
    )
    session.flush()
    return job


def list_transitions(session: Session, job_id: str) -> list[JobTransition]:
    q = select(JobTransition).where(JobTransition.job_id == job_id).order_by(JobTransition.id)
    return list(session.scalars(q))


def record_event(
    session: Session,
    job_id: str,
    *,
    idempotency_key: str,
    kind: str,
    failure_class: str | None = None,
    node_id: str | None = None,
    rank: int | None = None,
    message: str | None = None,
    details: dict[str, Any] | None = None,
    occurred_at: datetime | None = None,
    now: datetime | None = None,
) -> tuple[FailureEvent, bool]:
    """Append an event; if the key was seen for this job, return the stored one.

    Returns (event, created). Concurrent posts of the same key are settled by the
    unique constraint: the loser's insert fails and it reads the winner's row.
    """
    get_job(session, job_id)
    existing = _event_by_key(session, job_id, idempotency_key)
    if existing is not None:
        return existing, False
    now = now or utcnow()
    event = FailureEvent(
        job_id=job_id,
        idempotency_key=idempotency_key,
        kind=kind,
        failure_class=failure_class,
        node_id=node_id,
        rank=rank,
        message=message,
        details=details or {},
        occurred_at=occurred_at or now,
        recorded_at=now,
    )
    try:
        with session.begin_nested():
            session.add(event)
            session.flush()
    except IntegrityError:
        winner = _event_by_key(session, job_id, idempotency_key)
        if winner is None:
            raise
        return winner, False
    return event, True


def _event_by_key(session: Session, job_id: str, key: str) -> FailureEvent | None:
    q = select(FailureEvent).where(
        FailureEvent.job_id == job_id, FailureEvent.idempotency_key == key
    )
    return session.scalars(q).first()


def list_events(
    session: Session, job_id: str, *, after: int = 0, limit: int = 100
) -> list[FailureEvent]:
    """Events with id > ``after``, oldest first: ``after`` is the cursor."""
    get_job(session, job_id)
    q = (
        select(FailureEvent)
        .where(FailureEvent.job_id == job_id, FailureEvent.id > after)
        .order_by(FailureEvent.id)
        .limit(limit)
    )
    return list(session.scalars(q))


def list_all_events(session: Session, *, after: int = 0, limit: int = 100) -> list[FailureEvent]:
    """Events of every job with id > ``after``, oldest first."""
    q = select(FailureEvent).where(FailureEvent.id > after).order_by(FailureEvent.id).limit(limit)
    return list(session.scalars(q))
