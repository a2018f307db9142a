"""The reconciler: gather a snapshot per job, ``decide`` (pure, ``domain.reconcile``),
apply the actions. One leader at a time, by a lease row in the database.

Every action is idempotent against the store: a step row is inserted once and
finished once, an attempt is created once per number, a command is enqueued in the
same transaction as the step that sends it, and the local launcher refuses to start
an attempt twice. So a service killed at any point carries on where it was when it
comes back: the next tick gathers the same facts and decides the same next action.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.contract import Env, step_dir_name
from orchestrator.domain import reconcile as rc
from orchestrator.domain.failures import FailureClass
from orchestrator.domain.plan import Placement
from orchestrator.domain.policy import PastFailure, RecoveryAction, decide_recovery
from orchestrator.domain.protocol import ProtocolStep, StepOutcome
from orchestrator.domain.spec import JobSpec
from orchestrator.domain.status import TERMINAL, IllegalTransition, JobStatus
from orchestrator.launchers.base import LaunchError, LaunchHandle, LaunchRequest
from orchestrator.store import repo
from orchestrator.store.goodput import failed_attempt_last_step, rank_values
from orchestrator.store.models import (
    Attempt,
    FailureEvent,
    Job,
    Lease,
    Node,
    NodeCommand,
)
from orchestrator.store.models import (
    ProtocolStep as StepRow,
)

log = logging.getLogger(__name__)

LEASE_NAME = "reconciler"


def _utc(dt: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; everything here is UTC."""
    if dt is None or dt.tzinfo is not None:
        return dt
    from datetime import UTC

    return dt.replace(tzinfo=UTC)


@dataclass
class Reconciler:
    sessionmaker: sessionmaker[Session]
    launcher: Any
    """A Launcher (``launchers.base``); the local one also stages onto node disks."""
    service_url: str
    config: rc.ReconcileConfig = field(default_factory=rc.ReconcileConfig)
    interval_s: float = 0.5
    holder: str = ""
    lease_s: float = 10.0

    advise_every_s: float = 60.0
    """How often a running job's checkpoint interval is re-advised."""

    def __post_init__(self) -> None:
        self._last_advice: dict[str, datetime] = {}
        self.holder = self.holder or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- running --------------------------------------------------------------------

    def start(self) -> Reconciler:
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.acquire_lease():
                    self.tick()
            except Exception:  # one bad tick must not end recovery for every job
                log.exception("reconciler tick failed")
            self._stop.wait(self.interval_s)

    def acquire_lease(self, now: datetime | None = None) -> bool:
        now = now or repo.utcnow()
        until = now + timedelta(seconds=self.lease_s)
        with self.sessionmaker() as s:
            try:
                with s.begin():
                    got = s.execute(
                        update(Lease)
                        .where(Lease.name == LEASE_NAME)
                        .where(or_(Lease.holder == self.holder, Lease.expires_at < now))
                        .values(holder=self.holder, expires_at=until)
                    ).rowcount
                    if got:
                        return True
                    if s.get(Lease, LEASE_NAME) is None:
                        s.add(Lease(name=LEASE_NAME, holder=self.holder, expires_at=until))
                        return True
                    return False
            except IntegrityError:  # another replica inserted first
                return False

    def tick(self) -> None:
        with self.sessionmaker() as s:
            ids = list(
                s.scalars(
                    select(Job.id).where(
                        or_(
                            Job.status.not_in([str(t) for t in TERMINAL]),
                            Job.id.in_(select(Attempt.job_id).where(Attempt.state != "ended")),
                        )
                    )
                )
            )
        for job_id in ids:
            try:
                self.reconcile(job_id)
            except Exception:
                log.exception("job %s: reconcile failed", job_id)

    def reconcile(self, job_id: str, now: datetime | None = None) -> list[rc.Action]:
        """One gather -> decide -> apply round for one job; returns what it applied."""
        with self.sessionmaker() as s, s.begin():
            snap, ctx = self.gather(s, job_id, now or repo.utcnow())
            actions = rc.decide(snap, self.config)
            for action in actions:
                log.info("job %s: %s", job_id, action)
                self.apply(s, ctx, snap, action)
            if not actions and snap.status is JobStatus.RUNNING and snap.incident is None:
                self.advise_interval(s, ctx, snap)
        return actions

    # --- checkpoint interval ------------------------------------------------------------

    def advise_interval(self, s: Session, ctx: _Ctx, snap: rc.JobSnapshot) -> int | None:
        """Push Young's interval to a running job when it moved meaningfully.

        Save time: the ranks' measured blocking time (``blocking_s`` of the newest
        checkpoint reports); step time: the slowest rank's; MTBF: the failure history
        of this (cloud, region, instance type), the Llama 3 rate as the prior; restart
        time: this job's measured MTTRs (10 min before any). Nothing is pushed without
        a measured save time: an interval is never guessed. Returns the pushed value.
        """
        from orchestrator.domain.advisor import PlacementKey, advise_from_history

        a, job, spec = ctx.attempt, ctx.job, ctx.spec
        if not spec.checkpoint.adaptive or a is None or snap.attempt is None:
            return None
        last = self._last_advice.get(job.id)
        if last is not None and (snap.now - last).total_seconds() < self.advise_every_s:
            return None
        self._last_advice[job.id] = snap.now
        step_times = [
            v
            for n in s.scalars(select(Node).where(Node.job_id == job.id, Node.attempt == a.number))
            for v in rank_values(n.progress, "step_time")
        ]
        saves = [
            e.details["blocking_s"]
            for e in s.scalars(
                select(FailureEvent)
                .where(FailureEvent.job_id == job.id, FailureEvent.kind == "checkpoint")
                .order_by(FailureEvent.id.desc())
                .limit(5)
            )
            if isinstance((e.details or {}).get("blocking_s"), int | float)
        ]
        if not step_times or not saves or min(saves) <= 0:
            return None
        key = PlacementKey(a.cloud, a.region, a.instance_type)
        gpus = spec.num_nodes * spec.ranks_per_node
        advice, est = advise_from_history(
            key,
            self._exposures(s, snap.now),
            gpus,
            statistics.median(saves),
            self._restart_seconds(s, job.id),
        )
        current = self._current_every(s, job.id, spec.checkpoint.every_steps)
        new = rc.checkpoint_every_update(current, max(step_times), advice.interval_seconds)
        if new is None:
            return None
        text = (
            f"checkpoint every {new} steps (was {current}): Young's interval "
            f"{advice.interval_minutes:.1f} min for {statistics.median(saves):.2f} s blocking "
            f"saves and an MTBF of {advice.mtbf_hours:.1f} h on {gpus} ranks "
            f"({est.observed_failures} failures in {est.observed_gpu_hours:.1f} GPU-h of "
            f"{a.cloud}/{a.region}/{a.instance_type} history); expected loss "
            f"{advice.lost.total:.2%}"
        )
        repo.record_event(
            s,
            job.id,
            idempotency_key=f"interval-a{a.number}-{new}",
            kind="checkpoint_interval",
            message=text,
            details={"every_steps": new, "previous": current, **advice.to_json_dict()},
            now=snap.now,
        )
        s.add(
            NodeCommand(
                job_id=job.id,
                attempt=a.number,
                node_id=None,
                type="set_checkpoint_every",
                args={"every_steps": new},
                created_at=snap.now,
            )
        )
        return new

    def _current_every(self, s: Session, job_id: str, default: int) -> int:
        e = s.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job_id, FailureEvent.kind == "checkpoint_interval")
            .order_by(FailureEvent.id.desc())
        ).first()
        return int(e.details["every_steps"]) if e is not None else default

    def _restart_seconds(self, s: Session, job_id: str) -> float:
        mttrs = [i["mttr_s"] for i in incidents(s, job_id) if i["mttr_s"]]
        return statistics.median(mttrs) if mttrs else 600.0

    def _exposures(self, s: Session, now: datetime) -> list[Any]:
        """GPU-hours and incidents per (cloud, region, instance type), every job."""
        from orchestrator.domain.advisor import Exposure, PlacementKey

        hours: dict[PlacementKey, float] = {}
        fails: dict[PlacementKey, int] = {}
        keys: dict[tuple[str, int], PlacementKey] = {}
        for a in s.scalars(select(Attempt)):
            k = PlacementKey(a.cloud, a.region, a.instance_type)
            keys[(a.job_id, a.number)] = k
            end = _utc(a.ended_at) or now
            per_node = int((a.knobs or {}).get("ranks_per_node", 1))
            span = max(0.0, (end - (_utc(a.started_at) or now)).total_seconds())
            hours[k] = hours.get(k, 0.0) + span / 3600 * a.num_nodes * per_node
        for e in s.scalars(select(FailureEvent).where(FailureEvent.kind == "incident")):
            k = keys.get((e.job_id, int((e.details or {}).get("attempt", 0))))
            if k is not None:
                fails[k] = fails.get(k, 0) + 1
        return [Exposure(k, h, fails.get(k, 0)) for k, h in hours.items()]

    # --- gather -----------------------------------------------------------------------

    def gather(self, s: Session, job_id: str, now: datetime) -> tuple[rc.JobSnapshot, _Ctx]:
        job = repo.get_job(s, job_id)
        spec = JobSpec.model_validate(job.spec)
        attempt = s.scalars(
            select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number.desc())
        ).first()
        ctx = _Ctx(job=job, spec=spec, attempt=attempt)
        view = None
        failures: tuple[rc.Failure, ...] = ()
        if attempt is not None:
            view = self._attempt_view(s, job_id, attempt, now)
            failures = tuple(self._failures(s, job_id, attempt.number))
        incident = self._open_incident(s, job_id)
        snap = rc.JobSnapshot(
            job_id=job_id,
            status=JobStatus(job.status),
            now=now,
            num_nodes=spec.num_nodes,
            ranks_per_node=spec.ranks_per_node,
            heartbeat_timeout_s=spec.restarts.heartbeat_timeout_s,
            grace_s=spec.restarts.grace_period_s,
            attempt=view,
            failures=failures,
            incident=incident,
        )
        return snap, ctx

    def _attempt_view(self, s: Session, job_id: str, a: Attempt, now: datetime) -> rc.AttemptView:
        handle = _handle(a)
        nodes = s.scalars(select(Node).where(Node.job_id == job_id, Node.attempt == a.number))
        exits = {
            e.node_id: e
            for e in s.scalars(
                select(FailureEvent).where(
                    FailureEvent.job_id == job_id,
                    FailureEvent.kind == "node_exit",
                    FailureEvent.node_id.like(f"{job_id}-a{a.number}-%"),
                )
            )
        }
        alive_ids: set[str] | None = None
        if handle is not None and a.state != "ended":
            try:
                st = self.launcher.status(handle)
                alive_ids = set(st.nodes_up) if st.state != "unknown" else None
            except Exception:  # a launcher that cannot be read is not a dead cluster
                log.exception("job %s: launcher status failed", job_id)
        views = []
        for n in nodes:
            prog = n.progress or {}
            ranks = tuple(
                rc.RankView(
                    rank=int(r.get("rank", -1)),
                    step=r.get("step"),
                    resumed_step=(r.get("resumed") or {}).get("step"),
                    resumed_digest=(r.get("resumed") or {}).get("manifest_digest"),
                    report_age_s=r.get("report_age_s"),
                )
                for r in prog.get("ranks", []) or []
                if isinstance(r, dict)
            )
            ev = exits.get(n.node_id)
            views.append(
                rc.NodeView(
                    node_id=n.node_id,
                    node_rank=n.node_rank,
                    last_heartbeat_at=_utc(n.last_heartbeat_at) or _utc(n.registered_at),
                    alive=None if alive_ids is None else n.node_id in alive_ids,
                    exited=ev is not None or n.state == "exited",
                    exit_code=(ev.details or {}).get("exit_code") if ev is not None else None,
                    ranks=ranks,
                )
            )
        registered = {v.node_id for v in views}
        vanished = tuple(
            n
            for n in (handle.node_ids if handle is not None else ())
            if alive_ids is not None and n not in alive_ids and n not in registered
        )
        return rc.AttemptView(
            vanished=vanished,
            number=a.number,
            state=a.state,
            started_at=_utc(a.started_at) or now,
            num_nodes=a.num_nodes,
            ranks_per_node=int((a.knobs or {}).get("ranks_per_node", 1)),
            expected_step=a.resume_step,
            validated_step=a.validated_step,
            launched=handle is not None,
            nodes=tuple(sorted(views, key=lambda v: v.node_rank)),
        )

    def _failures(self, s: Session, job_id: str, number: int) -> list[rc.Failure]:
        rows = s.scalars(
            select(FailureEvent)
            .where(
                FailureEvent.job_id == job_id,
                FailureEvent.kind.in_(sorted(rc.FAILURE_KINDS)),
            )
            .order_by(FailureEvent.id)
        )
        out = []
        for e in rows:
            d = e.details or {}
            of_attempt = d.get("attempt") == number or (
                e.node_id is not None and e.node_id.startswith(f"{job_id}-a{number}-")
            )
            if not of_attempt:
                continue
            code = d.get("exit_code")
            if e.kind == "rank_exit" and code in rc.CLEAN_EXITS and not d.get("signal"):
                continue
            try:
                cls = FailureClass(e.failure_class or "unknown")
            except ValueError:
                cls = FailureClass.UNKNOWN
            out.append(
                rc.Failure(
                    event_id=e.id,
                    kind=e.kind,
                    failure_class=cls,
                    occurred_at=_utc(e.occurred_at) or repo.utcnow(),
                    node_id=e.node_id,
                    rank=e.rank,
                    exit_code=code if isinstance(code, int) else None,
                    message=e.message or "",
                )
            )
        return out

    def _open_incident(self, s: Session, job_id: str) -> rc.IncidentView | None:
        inc = s.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job_id, FailureEvent.kind == "incident")
            .order_by(FailureEvent.id.desc())
        ).first()
        if inc is None:
            return None
        rows = s.scalars(select(StepRow).where(StepRow.incident_id == inc.id))
        steps = {
            ProtocolStep(r.step): rc.StepView(
                started_at=_utc(r.started_at) or repo.utcnow(),
                finished_at=_utc(r.finished_at),
                outcome=StepOutcome(r.outcome) if r.outcome else None,
                detail=r.detail or "",
            )
            for r in rows
        }
        validate = steps.get(ProtocolStep.VALIDATE)
        if validate is not None and validate.finished_at is not None:
            return None
        if any(v.outcome is StepOutcome.FAILED for v in steps.values()):
            return None  # the job failed with it
        return rc.IncidentView(
            event_id=inc.id,
            attempt=int((inc.details or {}).get("attempt", 0)),
            failure_class=FailureClass(inc.failure_class or "unknown"),
            steps=steps,
        )

    # --- apply ------------------------------------------------------------------------

    def apply(self, s: Session, ctx: _Ctx, snap: rc.JobSnapshot, action: rc.Action) -> None:
        now = snap.now
        match action:
            case rc.SetStatus(status=st, reason=reason):
                self._set_status(s, ctx.job.id, st, reason, now)
            case rc.Launch(number=n, incident_id=inc):
                self._launch(s, ctx, n, inc, now)
            case rc.RecordFailure():
                number = ctx.attempt.number if ctx.attempt else 0
                where = action.node_id or "all"
                repo.record_event(
                    s,
                    ctx.job.id,
                    idempotency_key=f"{action.kind}-a{number}-{where}-{action.rank}",
                    kind=action.kind,
                    failure_class=str(action.failure_class),
                    node_id=action.node_id,
                    rank=action.rank,
                    message=action.message,
                    details={"attempt": number, "detected_by": "reconciler"},
                    now=now,
                )
            case rc.OpenIncident(cause=cause, attempt=number, last_step=last):
                inc, _ = repo.record_event(
                    s,
                    ctx.job.id,
                    idempotency_key=f"incident-a{number}",
                    kind="incident",
                    failure_class=str(cause.failure_class),
                    node_id=cause.node_id,
                    rank=cause.rank,
                    message=cause.message,
                    details={
                        "attempt": number,
                        "cause_event_id": cause.event_id,
                        "last_step": last,
                    },
                    occurred_at=cause.occurred_at,
                    now=now,
                )
                self._step(s, ctx.job.id, inc.id, ProtocolStep.DETECT, cause.occurred_at)
                self._finish(
                    s,
                    inc.id,
                    ProtocolStep.DETECT,
                    StepOutcome.OK,
                    f"{cause.failure_class} ({cause.kind}) on {cause.node_id or 'the attempt'}: "
                    f"{cause.message}"[:1000],
                    now,
                )
                if ctx.attempt is not None and ctx.attempt.state != "ended":
                    ctx.attempt.state = "stopping"
            case rc.StartStep(incident_id=i, step=step):
                self._step(s, ctx.job.id, i, step, now)
            case rc.FinishStep(incident_id=i, step=step, outcome=outcome, detail=detail):
                self._finish(s, i, step, outcome, detail, now)
            case rc.SendCommand(attempt=number, type=type_, args=args):
                s.add(
                    NodeCommand(
                        job_id=ctx.job.id,
                        attempt=number,
                        node_id=None,
                        type=type_,
                        args=dict(args),
                        created_at=now,
                    )
                )
            case rc.RunStep(incident_id=i, step=step):
                self._step(s, ctx.job.id, i, step, now)
                if step is ProtocolStep.CONFIRM_CHECKPOINT:
                    self._confirm(s, ctx, snap, i, now)
                elif step is ProtocolStep.SELECT_REPLACEMENT:
                    self._select(s, ctx, snap, i, now)
                elif step is ProtocolStep.STAGE:
                    self._stage(s, ctx, snap, i, now)
            case rc.Release(attempt=number, reason=reason):
                self._release(s, ctx.job.id, number, reason, now)
            case rc.MarkValidated(attempt=number, step=step):
                a = self._attempt(s, ctx.job.id, number)
                if a is not None:
                    a.validated_step = step
                    if a.state in ("launching", "running"):
                        a.state = "running"

    def _set_status(
        self, s: Session, job_id: str, st: JobStatus, reason: str, now: datetime
    ) -> None:
        job = repo.get_job(s, job_id)
        if JobStatus(job.status) is st:
            return
        # Refused moves are logged by the store: e.g. cancelled by an operator meanwhile.
        with contextlib.suppress(IllegalTransition):
            repo.set_status(s, job_id, st, reason=reason, now=now)

    def _attempt(self, s: Session, job_id: str, number: int) -> Attempt | None:
        return s.scalars(
            select(Attempt).where(Attempt.job_id == job_id, Attempt.number == number)
        ).first()

    def _step(self, s: Session, job_id: str, inc: int, step: ProtocolStep, at: datetime) -> None:
        exists = s.scalars(
            select(StepRow).where(StepRow.incident_id == inc, StepRow.step == str(step))
        ).first()
        if exists is None:
            s.add(StepRow(job_id=job_id, incident_id=inc, step=str(step), started_at=at))
            s.flush()

    def _finish(
        self,
        s: Session,
        inc: int,
        step: ProtocolStep,
        outcome: StepOutcome,
        detail: str,
        now: datetime,
    ) -> None:
        row = s.scalars(
            select(StepRow).where(StepRow.incident_id == inc, StepRow.step == str(step))
        ).first()
        if row is None or row.finished_at is not None:
            return
        row.finished_at = now
        row.outcome = str(outcome)
        row.detail = detail[:2000]
        s.flush()

    def _fail(self, s: Session, ctx: _Ctx, reason: str, now: datetime) -> None:
        self._set_status(s, ctx.job.id, JobStatus.FAILED, reason[:2000], now)
        if ctx.attempt is not None:
            self._release(s, ctx.job.id, ctx.attempt.number, reason, now)

    def _release(self, s: Session, job_id: str, number: int, reason: str, now: datetime) -> None:
        a = self._attempt(s, job_id, number)
        if a is None or a.state == "ended":
            return
        handle = _handle(a)
        if handle is not None:
            self.launcher.down(handle)
        a.state = "ended"
        a.ended_at = now
        a.end_reason = reason[:2000]

    # protocol steps with I/O --------------------------------------------------------------

    def _confirmed(self, s: Session, job_id: str, inc: int) -> dict[str, Any] | None:
        e = s.scalars(
            select(FailureEvent).where(
                FailureEvent.job_id == job_id,
                FailureEvent.idempotency_key == f"confirmed-{inc}",
            )
        ).first()
        return dict(e.details) if e is not None else None

    def _confirm(
        self, s: Session, ctx: _Ctx, snap: rc.JobSnapshot, inc: int, now: datetime
    ) -> None:
        from orchestrator.cloud.storage import StorageError, list_checkpoints

        uri = ctx.spec.checkpoint.uri.rstrip("/")
        try:
            found = list_checkpoints(uri)
        except StorageError as e:
            self._finish(s, inc, ProtocolStep.CONFIRM_CHECKPOINT, StepOutcome.FAILED, str(e), now)
            self._fail(s, ctx, f"checkpoint storage unreadable: {e}", now)
            return
        complete = [c for c in found if c.complete]
        incident = s.get(FailureEvent, inc)
        last = (incident.details or {}).get("last_step") if incident else None
        if complete:
            best = complete[-1]
            lost = f"{last - best.step} steps lost" if isinstance(last, int) else "steps lost: ?"
            details = {"step": best.step, "uri": f"{uri}/{step_dir_name(best.step)}"}
            text = (
                f"step_{best.step} complete on all ranks (manifest + COMMIT, "
                f"{best.files} files, {best.size} bytes); last step seen {last}; {lost}"
            )
        else:
            details = {"step": None, "uri": None}
            text = f"no complete checkpoint under {uri}: restarting from step 0"
        repo.record_event(
            s,
            ctx.job.id,
            idempotency_key=f"confirmed-{inc}",
            kind="checkpoint_confirmed",
            message=text,
            details={**details, "incident_id": inc},
            now=now,
        )
        self._finish(s, inc, ProtocolStep.CONFIRM_CHECKPOINT, StepOutcome.OK, text, now)
        # Only now, with the checkpoint confirmed, are the old nodes released.
        if ctx.attempt is not None:
            self._release(s, ctx.job.id, ctx.attempt.number, f"incident {inc}", now)

    def _select(self, s: Session, ctx: _Ctx, snap: rc.JobSnapshot, inc: int, now: datetime) -> None:
        job, spec = ctx.job, ctx.spec
        step = ProtocolStep.SELECT_REPLACEMENT
        if job.restart_count >= spec.restarts.max_restarts:
            reason = f"restart limit reached ({spec.restarts.max_restarts} restarts)"
            self._finish(s, inc, step, StepOutcome.FAILED, reason, now)
            self._fail(s, ctx, reason, now)
            return
        incident = s.get(FailureEvent, inc)
        assert incident is not None
        past = [
            PastFailure(FailureClass(e.failure_class or "unknown"), e.message or "")
            for e in s.scalars(
                select(FailureEvent)
                .where(
                    FailureEvent.job_id == job.id,
                    FailureEvent.kind == "incident",
                    FailureEvent.id < inc,
                )
                .order_by(FailureEvent.id)
            )
        ]
        decision = decide_recovery(
            FailureClass(incident.failure_class or "unknown"), incident.message or "", past
        )
        if decision.action is RecoveryAction.FAIL_FAST:
            self._finish(s, inc, step, StepOutcome.FAILED, decision.reason, now)
            self._fail(s, ctx, decision.reason, now)
            return
        try:
            placement = self._placement(s, spec, inc)
        except (LaunchError, ValueError) as e:
            self._finish(s, inc, step, StepOutcome.FAILED, str(e), now)
            self._fail(s, ctx, f"no replacement: {e}", now)
            return
        knobs = placement.knobs
        text = (
            f"{decision.action}: {placement.num_nodes} x {placement.instance_type} "
            f"({self.launcher.name}, {placement.region})"
            + (
                f"; knobs: micro-batch {knobs.micro_batch} x {knobs.grad_accum} accumulation, "
                f"activation checkpointing every {knobs.activation_checkpoint_every or '-'} "
                f"for {placement.gpu_memory_gib:g} GiB"
                if knobs is not None and placement.gpu_memory_gib
                else ""
            )
        )
        self._finish(s, inc, step, StepOutcome.OK, text, now)

    def _stage(self, s: Session, ctx: _Ctx, snap: rc.JobSnapshot, inc: int, now: datetime) -> None:
        from orchestrator.cloud.storage import StorageError, stage_checkpoint
        from orchestrator.contract import ManifestError

        step = ProtocolStep.STAGE
        confirmed = self._confirmed(s, ctx.job.id, inc) or {}
        want = confirmed.get("step")
        if want is None:
            self._finish(s, inc, step, StepOutcome.SKIPPED, "fresh start: nothing to stage", now)
            return
        node_disk = getattr(self.launcher, "node_disk", None)
        if node_disk is None:
            self._finish(
                s,
                inc,
                step,
                StepOutcome.SKIPPED,
                f"ranks stage {confirmed['uri']} from object storage when they start",
                now,
            )
            return
        number = (ctx.attempt.number if ctx.attempt else 0) + 1
        total = 0
        t0 = time.perf_counter()
        for k in range(ctx.spec.num_nodes):
            dest = Path(node_disk(ctx.job.id, number, k)) / "staged"
            try:
                got = stage_checkpoint(ctx.spec.checkpoint.uri, str(dest))
            except (StorageError, ManifestError, OSError) as e:
                reason = f"checkpoint step_{want} could not be staged: {e}"
                self._finish(s, inc, step, StepOutcome.FAILED, reason, now)
                self._fail(s, ctx, reason, now)
                return
            if got.step != want:
                why = "; ".join(f"step_{c.step}: {c.reason}" for c in got.skipped if c.step >= want)
                reason = (
                    f"checkpoint step_{want} failed verification ({why or 'not found'}); "
                    f"refusing to train on it. The newest verified one is step_{got.step}"
                )
                self._finish(s, inc, step, StepOutcome.FAILED, reason, now)
                self._fail(s, ctx, reason, now)
                return
            total += got.downloaded_bytes
        took = time.perf_counter() - t0
        self._finish(
            s,
            inc,
            step,
            StepOutcome.OK,
            f"step_{want} staged and verified (sha256) on {ctx.spec.num_nodes} node disks: "
            f"{total} bytes copied in {took:.2f} s",
            now,
        )

    def _placement(self, s: Session, spec: JobSpec, inc: int | None) -> Placement:
        """The launcher's placement, the failed region excluded after a preemption or
        a lost node, and training knobs replanned for the GPU memory it declares."""
        from orchestrator.domain.memory import plan_memory
        from orchestrator.domain.policy import BLAMES_REGION

        placement_for = getattr(self.launcher, "placement_for", None)
        if placement_for is None:
            raise LaunchError(f"launcher {self.launcher.name!r} cannot place jobs")
        kwargs: dict[str, Any] = {}
        incident = s.get(FailureEvent, inc) if inc is not None else None
        if incident is not None:
            number = int((incident.details or {}).get("attempt", 0))
            failed = self._attempt(s, incident.job_id, number)
            cls = FailureClass(incident.failure_class or "unknown")
            if failed is not None and cls in BLAMES_REGION and failed.region != "local":
                kwargs["exclude_regions"] = [failed.region]
            kwargs["replacement"] = True
        placement: Placement = placement_for(spec, **kwargs)
        if spec.model is not None and placement.gpu_memory_gib and placement.knobs is None:
            plan = plan_memory(
                spec.model, placement.gpu_memory_gib, spec.num_nodes * spec.ranks_per_node
            )  # DoesNotFit names the model, the memory and the smallest estimate
            placement = replace(
                placement,
                knobs=plan.knobs,
                reasons=(
                    *placement.reasons,
                    *plan.reasons,
                ),
            )
        return placement

    def _launch(self, s: Session, ctx: _Ctx, number: int, inc: int | None, now: datetime) -> None:
        """Two ticks: the first records the attempt (committed with the tick), the
        second starts its nodes. An agent registering must find its attempt, or the
        service would answer 409 and the agent would stop as superseded."""
        job, spec = ctx.job, ctx.spec
        a = self._attempt(s, job.id, number)
        if a is None:
            confirmed = self._confirmed(s, job.id, inc) if inc is not None else None
            try:
                placement = self._placement(s, spec, inc)
            except (LaunchError, ValueError) as e:
                if inc is not None:
                    self._step(s, job.id, inc, ProtocolStep.LAUNCH, now)
                    self._finish(s, inc, ProtocolStep.LAUNCH, StepOutcome.FAILED, str(e), now)
                self._fail(s, ctx, f"no placement: {e}", now)
                return
            resume_step = (confirmed or {}).get("step")
            if resume_step is None and inc is not None:
                resume_step = 0  # no complete checkpoint: a fresh start, validated at 0
            s.add(
                Attempt(
                    job_id=job.id,
                    number=number,
                    cloud=placement.cloud,
                    region=placement.region,
                    zone=placement.zone,
                    instance_type=placement.instance_type,
                    accelerator=placement.accelerator,
                    num_nodes=placement.num_nodes,
                    spot=placement.spot,
                    price_per_node_hour=placement.price_per_node_hour,
                    knobs={
                        "ranks_per_node": spec.ranks_per_node,
                        "gpu_memory_gib": placement.gpu_memory_gib,
                        "accelerator_count": placement.accelerator_count,
                        **(placement.knobs.to_dict() if placement.knobs else {}),
                    },
                    resume_step=resume_step,
                    started_at=now,
                    state="launching",
                    launcher=self.launcher.name,
                    incident_id=inc,
                )
            )
            s.flush()
            return
        inc = inc if inc is not None else a.incident_id
        confirmed = self._confirmed(s, job.id, inc) if inc is not None else None
        resume_step = a.resume_step
        placement = _placement_of(a)
        env = {
            Env.SERVICE_URL: self.service_url,
            Env.JOB_ID: job.id,
            Env.ATTEMPT: str(number),
            Env.CHECKPOINT_URI: spec.checkpoint.uri,
            Env.CHECKPOINT_EVERY: str(spec.checkpoint.every_steps),
            Env.CHECKPOINT_KEEP: str(spec.checkpoint.keep),
            Env.RESUME_FROM: "latest",
        }
        if inc is not None and (confirmed or {}).get("step") is not None:
            staged = getattr(self.launcher, "node_disk", None) is not None
            env[Env.RESUME_FROM] = (
                f"{{node_disk}}/staged/{step_dir_name(int(confirmed['step']))}"  # type: ignore[index]
                if staged
                else str(confirmed["uri"])  # type: ignore[index]
            )
            env[Env.EXPECTED_STEP] = str(resume_step)
        elif inc is not None:
            env[Env.RESUME_FROM] = "none"
            env[Env.EXPECTED_STEP] = "0"
        if spec.model is not None:
            env[Env.GLOBAL_BATCH] = str(spec.model.global_batch)
            env[Env.MICRO_BATCH] = str(spec.model.micro_batch)
        if placement.knobs is not None:
            env[Env.MICRO_BATCH] = str(placement.knobs.micro_batch)
            env[Env.GRAD_ACCUM] = str(placement.knobs.grad_accum)
            env[Env.ACTIVATION_CHECKPOINT_EVERY] = str(placement.knobs.activation_checkpoint_every)
        request = LaunchRequest(
            job_id=job.id,
            attempt=number,
            placement=placement,
            command=spec.task.command or "",
            env=env,
            ranks_per_node=spec.ranks_per_node,
            grace_s=spec.restarts.grace_period_s,
            task=spec.task,
        )
        try:
            handle = self.launcher.launch(request)
        except LaunchError as e:
            if inc is not None:
                self._step(s, job.id, inc, ProtocolStep.LAUNCH, now)
                self._finish(s, inc, ProtocolStep.LAUNCH, StepOutcome.FAILED, str(e), now)
            a.state = "ended"
            a.ended_at = now
            a.end_reason = f"launch failed: {e}"
            self._set_status(s, job.id, JobStatus.FAILED, f"launch failed: {e}", now)
            return
        a.handle = {
            "cluster_name": handle.cluster_name,
            "launcher": handle.launcher,
            "node_ids": list(handle.node_ids),
        }
        a.state = "running" if a.state == "launching" else a.state
        a.cluster_name = handle.cluster_name
        job.restart_count = max(job.restart_count, number - 1)
        if inc is not None:
            self._step(s, job.id, inc, ProtocolStep.LAUNCH, now)
            self._finish(
                s,
                inc,
                ProtocolStep.LAUNCH,
                StepOutcome.OK,
                f"attempt {number}: {placement.num_nodes} nodes x {spec.ranks_per_node} ranks, "
                f"resume from {env[Env.RESUME_FROM]} (expected step {resume_step})",
                now,
            )
            self._step(s, job.id, inc, ProtocolStep.VALIDATE, now)
            self._set_status(s, job.id, JobStatus.PROVISIONING, f"attempt {number} launched", now)


@dataclass
class _Ctx:
    job: Job
    spec: JobSpec
    attempt: Attempt | None


def _handle(a: Attempt) -> LaunchHandle | None:
    h = a.handle
    if not h:
        return None
    return LaunchHandle(h["cluster_name"], h["launcher"], tuple(h.get("node_ids", ())))


def incidents(s: Session, job_id: str) -> list[dict[str, Any]]:
    """Every incident of a job with its protocol steps, oldest first (for API and CLI)."""
    out = []
    for inc in s.scalars(
        select(FailureEvent)
        .where(FailureEvent.job_id == job_id, FailureEvent.kind == "incident")
        .order_by(FailureEvent.id)
    ):
        rows = list(
            s.scalars(select(StepRow).where(StepRow.incident_id == inc.id).order_by(StepRow.id))
        )
        steps = [
            {
                "step": r.step,
                "started_at": _utc(r.started_at),
                "finished_at": _utc(r.finished_at),
                "seconds": (
                    (r.finished_at - r.started_at).total_seconds() if r.finished_at else None
                ),
                "outcome": r.outcome,
                "detail": r.detail,
            }
            for r in rows
        ]
        done = [r for r in rows if r.finished_at is not None]
        mttr = (
            (max(r.finished_at for r in done) - inc.occurred_at).total_seconds()  # type: ignore[type-var]
            if done and len(done) == len(ProtocolStep)
            else None
        )
        nxt = s.scalars(select(Attempt).where(Attempt.incident_id == inc.id)).first()
        number = (inc.details or {}).get("attempt")
        nodes = s.scalars(select(Node).where(Node.job_id == job_id, Node.attempt == number))
        last = failed_attempt_last_step(
            inc.details, [v for n in nodes for v in rank_values(n.progress, "step")]
        )
        resumed = nxt.validated_step if nxt is not None else None
        out.append(
            {
                "id": inc.id,
                "failure_class": inc.failure_class,
                "node_id": inc.node_id,
                "message": inc.message,
                "attempt": (inc.details or {}).get("attempt"),
                "occurred_at": _utc(inc.occurred_at),
                "last_step": last,
                "resumed_step": resumed,
                "steps_lost": (
                    last - resumed if isinstance(last, int) and isinstance(resumed, int) else None
                ),
                "mttr_s": mttr,
                "steps": steps,
            }
        )
    return out


def _placement_of(a: Attempt) -> Placement:
    """The placement an attempt was recorded with (launching must not re-plan it)."""
    from orchestrator.domain.plan import TrainingKnobs

    k = a.knobs or {}
    knobs = (
        TrainingKnobs(
            k["micro_batch"], k.get("grad_accum", 1), k.get("activation_checkpoint_every", 0)
        )
        if "micro_batch" in k
        else None
    )
    return Placement(
        cloud=a.cloud,
        region=a.region,
        instance_type=a.instance_type,
        accelerator=a.accelerator,
        accelerator_count=int(k.get("accelerator_count", 0)),
        num_nodes=a.num_nodes,
        spot=a.spot,
        zone=a.zone,
        gpu_memory_gib=k.get("gpu_memory_gib"),
        price_per_node_hour=a.price_per_node_hour,
        knobs=knobs,
    )
