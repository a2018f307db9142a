"""Idempotent submits: ``POST /v1/jobs`` with an ``Idempotency-Key``.

A client whose answer was lost (a timeout, a reset connection) cannot tell whether
its job was made; retrying without a key made a second job, which trained twice on
the operator's bill. With a key, the first submit stores (key, job, the spec's
digest) in the job's own transaction, and a retry with the same key and spec gets
that job back. The same key with another spec is refused: a key names one
submission, and silently answering with a job of a different spec would be worse
than the duplicate it prevents.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrator.domain.spec import JobSpec
from orchestrator.store import repo
from orchestrator.store.models import Job, JobSubmission
from orchestrator.store.repo import utcnow


class KeyReused(ValueError):
    """The key was used for a submission of another spec (the message names the job)."""


@dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool
    """False: the key's earlier submission, returned again."""


def spec_digest(spec: JobSpec) -> str:
    doc = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


def submit_job(
    session: Session, spec: JobSpec, key: str | None, *, task_yaml: str | None = None,
    now: datetime | None = None,
) -> Submitted:  # fmt: skip
    """Create the job, or (same ``key`` and spec as before) return the one made then.
    ``task_yaml``: the text of the spec's SkyPilot task, stored with the job."""
    if key is None:
        return Submitted(repo.create_job(session, spec, task_yaml=task_yaml, now=now), True)
    digest = spec_digest(spec)
    earlier = session.get(JobSubmission, key)
    if earlier is None:
        try:
            with session.begin_nested():  # two retries racing: one row wins
                job = repo.create_job(session, spec, task_yaml=task_yaml, now=now)
                session.add(JobSubmission(key=key, job_id=job.id, spec_sha256=digest,
                                          created_at=now or utcnow()))  # fmt: skip
                session.flush()
            return Submitted(job, True)
        except IntegrityError:
            earlier = session.get(JobSubmission, key)
            if earlier is None:
                raise
    if earlier.spec_sha256 != digest:
        raise KeyReused(
            f"Idempotency-Key {key!r} was used for job {earlier.job_id} with another "
            "spec; a retry must send the same spec, a new submission a new key"
        )
    return Submitted(repo.get_job(session, earlier.job_id), False)
