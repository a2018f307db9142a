"""Failure history as the reconciler writes it, built through the SQLAlchemy models.

``JobHistory`` is a small builder: submit a job, launch attempts with nodes and
their last heartbeat, record incidents with their protocol steps, and end the job.
Times are seconds after ``T0``. The figures are realistic: p4d.24xlarge / a2-
highgpu-8g spot prices, 0.4 s detection of a metadata notice, ~40 s to confirm an
emergency checkpoint, minutes to launch, a ~1.9 s optimizer step.

Shared by tests/goodput and tests/dashboard (the latter puts this folder on sys.path).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from orchestrator.domain.protocol import ProtocolStep
from orchestrator.domain.spec import validate_job_spec
from orchestrator.domain.status import JobStatus
from orchestrator.store import repo
from orchestrator.store.models import Attempt, FailureEvent, Node
from orchestrator.store.models import ProtocolStep as ProtocolStepRow

T0 = datetime(2026, 11, 3, 8, 0, 0, tzinfo=UTC)

P = ProtocolStep

#: A notice-driven recovery: emergency save, then a replacement in another cloud.
NOTICE_STEPS: tuple[tuple[ProtocolStep, float], ...] = (
    (P.DETECT, 0.4),
    (P.SIGNAL, 1.2),
    (P.CONFIRM_CHECKPOINT, 38.0),
    (P.SELECT_REPLACEMENT, 3.1),
    (P.STAGE, 95.0),
    (P.LAUNCH, 310.0),
    (P.VALIDATE, 12.3),
)

#: A node vanished: nothing to signal, resume from the last periodic checkpoint.
LOST_STEPS: tuple[tuple[ProtocolStep, float], ...] = (
    (P.DETECT, 30.0),  # heartbeat timeout
    (P.SIGNAL, 0.0),
    (P.CONFIRM_CHECKPOINT, 2.5),
    (P.SELECT_REPLACEMENT, 4.0),
    (P.STAGE, 61.0),
    (P.LAUNCH, 242.0),
    (P.VALIDATE, 9.5),
)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def job_doc(name: str = "gpt-7b", **overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "task": {"template": "gpt-cpu", "command": "python -m training.examples.train_gpt"},
        "num_nodes": 2,
        "accelerators": ["A100:8"],
        "spot": True,
        "clouds": ["aws", "gcp"],
        "checkpoint": {"uri": "s3://ckpt/gpt-7b", "every_steps": 100, "keep": 2},
    }
    doc.update(overrides)
    return doc


class JobHistory:
    def __init__(
        self,
        session: Session,
        name: str = "gpt-7b",
        *,
        submitted: float = 0.0,
        **spec: Any,
    ):
        self.s = session
        doc = job_doc(name, **spec)
        self.job = repo.create_job(session, validate_job_spec(doc), now=at(submitted))
        self.id = self.job.id
        self._events = 0

    def status(self, status: JobStatus, t: float, reason: str | None = None) -> JobHistory:
        repo.set_status(self.s, self.id, status, reason=reason, now=at(t))
        if status is JobStatus.RECOVERING:
            self.job.restart_count += 1
        return self

    def attempt(
        self,
        number: int,
        start: float,
        end: float | None,
        *,
        cloud: str = "aws",
        region: str = "us-east-1",
        instance_type: str = "p4d.24xlarge",
        price: float | None = 11.57,
        nodes: int = 2,
        resume_step: int | None = None,
        validated_step: int | None = None,
        incident_id: int | None = None,
        end_reason: str | None = None,
        step_time: float | None = 1.9,
        last_step: int | None = None,
        up: float | None = None,
    ) -> Attempt:
        """``up``: when the launcher found every node up (the handle's ``up_at``)."""
        a = Attempt(
            job_id=self.id,
            number=number,
            cloud=cloud,
            region=region,
            zone=None,
            instance_type=instance_type,
            accelerator="A100:8",
            num_nodes=nodes,
            spot=True,
            price_per_node_hour=price,
            knobs={"micro_batch": 4},
            resume_step=resume_step,
            started_at=at(start),
            ended_at=at(end) if end is not None else None,
            end_reason=end_reason,
            state="ended" if end is not None else "running",
            validated_step=validated_step,
            incident_id=incident_id,
            handle={"up_at": at(up).isoformat()} if up is not None else None,
        )
        self.s.add(a)
        for rank_node in range(nodes):
            ranks = []
            for local in range(8):
                rank: dict[str, Any] = {"rank": rank_node * 8 + local, "local_rank": local}
                if last_step is not None:
                    rank["step"] = last_step - (local % 2)  # ranks report a step apart
                if step_time is not None:
                    # The slowest rank sets the pace of synchronous training.
                    rank["step_time"] = step_time if local == 7 else step_time - 0.05
                ranks.append(rank)
            self.s.add(
                Node(
                    job_id=self.id,
                    attempt=number,
                    node_id=f"{self.id}-a{number}-n{rank_node}",
                    node_rank=rank_node,
                    address=f"10.0.{number}.{rank_node}",
                    state="exited" if end is not None else "running",
                    last_heartbeat_at=at(end if end is not None else start + 60),
                    progress={"state": "running", "ranks": ranks, "last_checkpoint": None},
                    registered_at=at(start + 30),
                )
            )
        self.s.flush()
        return a

    def event(
        self,
        t: float,
        kind: str,
        failure_class: str | None,
        *,
        message: str | None = None,
        details: dict[str, Any] | None = None,
        node_id: str | None = None,
    ) -> FailureEvent:
        self._events += 1
        ev, _ = repo.record_event(
            self.s,
            self.id,
            idempotency_key=f"{kind}:{self._events}",
            kind=kind,
            failure_class=failure_class,
            node_id=node_id,
            message=message,
            details=details,
            occurred_at=at(t),
            now=at(t),
        )
        return ev

    def incident(
        self,
        t: float,
        failure_class: str,
        steps: Sequence[tuple[ProtocolStep, float]],
        *,
        last_step: int | None,
        attempt: int | None = None,
        cause_kind: str = "rank_exit",
        message: str | None = None,
        finished: int | None = None,
    ) -> FailureEvent:
        """An incident detected at ``t`` as the reconciler opens one: the cause event,
        then a ``kind="incident"`` event naming the failed attempt and the last step
        seen; its protocol steps run back to back.

        ``finished``: how many steps have ended (the rest: the last one started, open).
        """
        cause = self.event(t, cause_kind, failure_class, message=message)
        details: dict[str, Any] = {"cause_event_id": cause.id, "last_step": last_step}
        if attempt is not None:
            details["attempt"] = attempt
        ev = self.event(t, "incident", failure_class, message=message, details=details)
        clock = t
        done = len(steps) if finished is None else finished
        for i, (step, seconds) in enumerate(steps):
            if i > done:
                break
            open_ = i == done
            self.s.add(
                ProtocolStepRow(
                    job_id=self.id,
                    incident_id=ev.id,
                    step=step.value,
                    started_at=at(clock),
                    finished_at=None if open_ else at(clock + seconds),
                    outcome=None if open_ else ("skipped" if seconds == 0 else "ok"),
                    detail=None,
                )
            )
            clock += seconds
        self.s.flush()
        return ev


def reread(session: Session) -> None:
    """Commit and forget the objects built, so what is read next comes back from the
    database (its types and time zones), as the service would read it."""
    session.commit()
    session.expunge_all()


def steps_end(t: float, steps: Sequence[tuple[ProtocolStep, float]]) -> float:
    return t + sum(s for _, s in steps)


def two_incident_job(session: Session, name: str = "gpt-7b") -> JobHistory:
    """Submitted at 0; first launch at 300 s; preempted (notice) at 3600 s and
    relaunched on GCP; a node lost at 10 800 s, relaunched on GCP; done at 18 000 s."""
    h = JobHistory(session, name)
    h.status(JobStatus.PROVISIONING, 240)
    h.attempt(1, 300, 3650, end_reason="preempted", last_step=1872)
    h.status(JobStatus.RUNNING, 420)
    notice = h.incident(
        3600,
        "preemption_notice",
        NOTICE_STEPS,
        last_step=1872,
        attempt=1,
        cause_kind="preemption_notice",
        message="aws spot instance-action terminate at 2026-11-03T09:02:00Z",
    )
    h.status(JobStatus.RECOVERING, 3600, "preemption notice")
    relaunch = steps_end(3600, NOTICE_STEPS[:5])
    h.attempt(
        2,
        relaunch,
        10_830,
        cloud="gcp",
        region="us-central1",
        instance_type="a2-highgpu-8g",
        price=8.82,
        resume_step=1875,  # the emergency save landed after the last heartbeat
        validated_step=1875,
        incident_id=notice.id,
        end_reason="node lost",
        last_step=4263,
    )
    h.status(JobStatus.RUNNING, steps_end(3600, NOTICE_STEPS))
    lost = h.incident(
        10_800,
        "node_lost",
        LOST_STEPS,
        last_step=4263,
        attempt=2,
        cause_kind="node_lost",
        message="no heartbeat from <node-1> for 30 s",
    )
    h.status(JobStatus.RECOVERING, 10_800, "node lost")
    h.attempt(
        3,
        steps_end(10_800, LOST_STEPS[:5]),
        18_000,
        cloud="gcp",
        region="us-central1",
        instance_type="a2-highgpu-8g",
        price=8.82,
        resume_step=4200,
        validated_step=4200,
        incident_id=lost.id,
        end_reason="succeeded",
        last_step=8000,
    )
    h.status(JobStatus.RUNNING, steps_end(10_800, LOST_STEPS))
    h.status(JobStatus.SUCCEEDED, 18_000, "max steps reached")
    return h


def plain_script_job(session: Session, name: str = "ddp-tutorial", **spec: Any) -> JobHistory:
    """The tutorial's plain script (no progress reports): submitted at 0, up at 120 s,
    a node lost at 1,320 s (20 minutes of training), relaunched from scratch (or, with
    ``checkpoint.own`` in ``spec``, from its own snapshot); done at 3,600 s."""
    h = JobHistory(session, name, **spec)
    h.status(JobStatus.PROVISIONING, 30)
    h.attempt(1, 60, 1340, up=120, step_time=None, end_reason="node lost")
    h.status(JobStatus.RUNNING, 130)
    lost = h.incident(1320, "node_lost", LOST_STEPS, last_step=None, attempt=1)
    h.status(JobStatus.RECOVERING, 1320, "node lost")
    relaunch = steps_end(1320, LOST_STEPS[:4])
    h.attempt(
        2, relaunch, 3600, up=steps_end(1320, LOST_STEPS[:6]), step_time=None,
        resume_step=0, incident_id=lost.id, end_reason="every rank exited 0",
    )  # fmt: skip
    h.status(JobStatus.RUNNING, steps_end(1320, LOST_STEPS))
    h.status(JobStatus.SUCCEEDED, 3600)
    return h
