"""The reconciler: gather a snapshot per job (``store.snapshot``), ``decide`` (pure,
``domain.reconcile``), apply the actions. One leader at a time, by a lease row.

The apply side decides nothing: each action has one small executor that carries it
out against the store or the launcher and, for the actions that do I/O (starting
nodes, giving them back), records what happened (a launch request, a refused one)
for ``decide`` to read on the next tick. Launches are requests the launcher answers
at once and ``decide`` polls (``Launcher.progress``); nothing here waits on one. The
nodes stage checkpoints themselves: the service never copies one.

Every executor is idempotent against the store: a step row is inserted once and
finished once, an attempt is recorded once per number, a command is enqueued in the
same transaction as the step that sends it, and launchers refuse to start an
attempt twice. So a service killed at any point carries on where it was when it
comes back: the next tick gathers the same facts and decides the same next action.

Leadership is fenced. The lease's epoch (``work.acquire_lease``) is the fencing
token: every transaction that applies an action checks it (``work.fence``, a
conditional UPDATE of the lease row) before its first write or launcher call, in the
same transaction, so a leader that was paused or cut off past its lease and comes
back finds its fence refused, rolls the whole transaction back, drops leadership and
reads again: it never acts on what it saw before the pause. The one thing a fence
cannot roll back is a launcher call already made; launches are therefore keyed by
(job, attempt, try) (``LaunchRequest.launch_try``), and a launcher asked again for a
key it already holds answers with that request instead of starting new nodes: a new
leader that finds an attempt recorded with no handle adopts the launch the old one
made, if it made one.

On SQLite, whose one write lock a write transaction takes at BEGIN (``store.db``),
a round reads and decides in a read transaction first and takes the lock only when
it has something to apply: then it reads and decides again under the lock and
applies what it decided there, so what is applied was read under the lock, as on
PostgreSQL, where a round is one transaction.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import statistics
import threading
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import cast

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.contract import AttemptState, CommandType, Env, EventKind, Membership
from orchestrator.domain import reconcile as rc
from orchestrator.domain.status import IllegalTransition, JobStatus
from orchestrator.launchers.base import (
    CapacityError,
    ConfirmsDown,
    Launcher,
    LaunchError,
    LaunchHandle,
    LaunchRequest,
    RefillingLauncher,
    SubmitUncertain,
    TaskRejected,
)
from orchestrator.store import agents, db, records, repo, work
from orchestrator.store.intake import IntakeLog
from orchestrator.store.models import Attempt
from orchestrator.store.snapshot import (
    ProgressCache,
    Rows,
    attempt_row,
    gather_snapshot,
    parts_of,
    placement_of,
)

log = logging.getLogger(__name__)


@dataclass
class Reconciler:
    sessionmaker: sessionmaker[Session]
    launcher: Launcher
    service_url: str
    service_ca_pem: str | None = None
    """PEM certificates nodes verify an https ``service_url`` with (``ca_bundle``)."""
    config: rc.ReconcileConfig = field(default_factory=rc.ReconcileConfig)
    interval_s: float = 0.5
    holder: str = ""
    lease_s: float = 10.0

    advise_every_s: float = 60.0
    """How often a running job's checkpoint interval is re-advised."""
    teardown_poll_s: float = 15.0
    """How often teardowns asked for and not yet confirmed are polled (each poll is a
    provider request per cluster: SkyPilot's status is not free)."""
    heard_since: datetime | None = None
    """When this service started hearing agents (set by :meth:`start`): a node's
    silence is counted from then at the earliest (``JobSnapshot.heard_since``)."""
    intake: IntakeLog = field(default_factory=IntakeLog)
    """The fleet's heartbeat intake, one sample per tick (``JobSnapshot.intake``): time
    the service heard too little or did not run is not held against nodes."""
    progress: ProgressCache = field(default_factory=ProgressCache)
    """Each node's view as the last tick parsed it: an unchanged row is not parsed again."""

    def __post_init__(self) -> None:
        self._last_advice: dict[str, datetime] = {}
        self._last_teardowns: datetime | None = None
        self.epoch: int | None = None
        """The lease epoch this replica holds (None: not the leader, or it lost it)."""
        self.holder = self.holder or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reads_first = db.serializes_writers(self.sessionmaker)
        """Rounds read in a read transaction first (SQLite: see the module docstring)."""

    # --- running --------------------------------------------------------------------

    def start(self) -> Reconciler:
        self.heard_since = self.heard_since or repo.utcnow()
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
                self.epoch = None  # a broken connection proves nothing: re-read the lease
                log.exception("reconciler tick failed")
            self._stop.wait(self.interval_s)

    def acquire_lease(self, now: datetime | None = None) -> bool:
        try:
            with self.sessionmaker() as s:
                epoch = work.acquire_lease(s, self.holder, self.lease_s, now or repo.utcnow())
        except OperationalError as e:
            if not db.database_locked(e):
                raise
            # SQLite's write lock was held by others for the whole busy timeout. That
            # says nothing about who leads: the lease row is as it was, a takeover
            # moves its epoch, and every write is fenced on it. So the epoch is kept
            # and the renewal tried again next interval; this round acts on nothing.
            log.warning("reconciler %s: lease renewal waited out a locked database", self.holder)
            return False
        if epoch != self.epoch:
            log.info("reconciler %s: leader at epoch %s (was %s)", self.holder, epoch, self.epoch)
        self.epoch = epoch
        return epoch is not None

    def tick(self, now: datetime | None = None) -> bool:
        """One pass over every job (each job's rounds back to back while they only
        record, ``reconcile_rounds``); True when some job's round applied an action."""
        with db.read_session(self.sessionmaker) as s:
            ids = work.jobs_to_reconcile(s)
            self.intake.sample(s, now or repo.utcnow())
        self.progress.keep(ids)
        busy = False
        for job_id in ids:
            if self.epoch is None:  # lost the lease during this tick: the new leader goes on
                return busy
            try:
                busy = bool(self.reconcile_rounds(job_id, now)) or busy
            except Exception:
                log.exception("job %s: reconcile failed", job_id)
        at = now or repo.utcnow()
        if self._last_teardowns is None or (
            (at - self._last_teardowns).total_seconds() >= self.teardown_poll_s
        ):
            self._last_teardowns = at
            try:
                self.finish_teardowns(at)
            except Exception:
                log.exception("confirming teardowns failed")
        return busy

    def reconcile_rounds(self, job_id: str, now: datetime | None = None) -> list[rc.Action]:
        """The job's rounds back to back while the core says the next one follows at
        once (``rc.decides_again_at_once``: the round only recorded what the next reads),
        at most ``rc.MAX_ROUNDS_AT_ONCE``; returns every action applied, in order."""
        applied: list[rc.Action] = []
        previous: list[rc.Action] = []
        for _ in range(rc.MAX_ROUNDS_AT_ONCE):
            actions = self.reconcile(job_id, now)
            applied += actions
            if not rc.decides_again_at_once(actions, previous):
                break
            previous = actions
        return applied

    def reconcile(self, job_id: str, now: datetime | None = None) -> list[rc.Action]:
        """One gather -> decide -> apply round for one job, fenced by the lease; returns
        what it applied (nothing when this replica is not the leader)."""
        for _ in range(2):
            if self.epoch is None and not self.acquire_lease(now):
                return []
            try:
                return self._reconcile_fenced(job_id, now)
            except work.NotLeader as e:
                # Everything of this round was rolled back; whatever it saw may be stale.
                log.warning("job %s: %s; dropping leadership and reading again", job_id, e)
                self.epoch = None
        return []

    def _reconcile_fenced(self, job_id: str, now: datetime | None) -> list[rc.Action]:
        if self._reads_first and not self._would_write(job_id, now):
            return []
        with self.sessionmaker() as s, s.begin():
            snap, rows = self._gather(s, job_id, now)
            actions = rc.decide(snap, self.config)
            if actions:
                self._fence(s, now)
            for action in actions:
                log.info("job %s: %s", job_id, action)
                self.apply(s, rows, snap, action)
            if not actions and snap.status is JobStatus.RUNNING and snap.incident is None:
                self.advise_interval(s, rows, snap, now=now)
        return actions

    def _would_write(self, job_id: str, now: datetime | None) -> bool:
        """The round, read and decided in a read transaction, has an action to apply or
        an interval advice due (SQLite). Most rounds have neither; taking the write lock
        for their reads (seconds for 2,048 nodes on a starved service, and the
        launcher's status calls within them) made the heartbeat flush and the lease
        renewal wait out the busy timeout behind them (``bench/overload.py``, 0.3
        cores). A round that acts reads again under the lock: its launcher calls are
        made twice."""
        with db.read_session(self.sessionmaker) as s:
            snap, rows = self._gather(s, job_id, now)
            if rc.decide(snap, self.config):
                return True
            return (
                snap.status is JobStatus.RUNNING
                and snap.incident is None
                and self._advice_due(rows, snap)
            )

    def _gather(self, s: Session, job_id: str, now: datetime | None) -> tuple[rc.JobSnapshot, Rows]:
        snap, rows = gather_snapshot(s, job_id, now or repo.utcnow(), self.launcher, self.progress)
        if self.heard_since is not None:
            snap = replace(snap, heard_since=self.heard_since, intake=self.intake.samples())
        return snap, rows

    def _fence(self, s: Session, now: datetime | None) -> None:
        """Before the first write of a transaction: this replica still leads at its
        epoch (``work.fence``), read on the clock of now, not the snapshot's."""
        if self.epoch is None:
            raise work.NotLeader(f"{self.holder} holds no lease")
        work.fence(s, self.holder, self.epoch, self.lease_s, now or repo.utcnow())

    # --- checkpoint interval ------------------------------------------------------------

    def advise_interval(
        self, s: Session, rows: Rows, snap: rc.JobSnapshot, *, now: datetime | None = None
    ) -> int | None:
        """Push Young's interval to a running job when it moved meaningfully.

        Save time: the ranks' measured blocking time (``blocking_s`` of the newest
        checkpoint reports); step time: the slowest rank's; MTBF: the failure history
        of this (cloud, region, instance type), the Llama 3 rate as the prior until
        failures outweigh it (``advisor.estimate_rate``); restart
        time: this job's measured MTTRs (10 min before any). Nothing is pushed without
        a measured save time: an interval is never guessed. Returns the pushed value.
        """
        from orchestrator.domain.advisor import (
            PlacementKey,
            advise_from_history,
            next_checkpoint_every,
        )

        a, job, spec = rows.attempt, rows.job, rows.spec
        if a is None or not self._advice_due(rows, snap):
            return None
        self._last_advice[job.id] = snap.now
        facts = work.interval_facts(s, job.id, a.number, spec.checkpoint.every_steps, snap.now)
        if not facts.step_times or not facts.saves or min(facts.saves) <= 0:
            return None
        key = PlacementKey(a.cloud, a.region, a.instance_type)
        gpus = spec.num_nodes * spec.ranks_per_node
        save = statistics.median(facts.saves)
        advice, est = advise_from_history(key, facts.exposures, gpus, save, facts.restart_seconds)
        current = facts.current_every
        # Bounded, and at most a factor per push (the advisor's rule, issue 27).
        new = next_checkpoint_every(current, max(facts.step_times), advice.interval_seconds)
        if new is None:
            return None
        self._fence(s, now)  # a command to the nodes: only the leader sends one
        mtbf_h = advice.mtbf_hours
        mtbf = f"{mtbf_h:.1f} h" if mtbf_h >= 1 else f"{mtbf_h * 60:.1f} min"
        text = (
            f"checkpoint every {new} steps (was {current}; at most x4 a push): Daly's "
            f"interval {advice.interval_minutes:.1f} min for {save:.3f} s blocking "
            f"saves and an MTBF of {mtbf} on {gpus} ranks "
            f"({est.observed_failures} failures in {est.observed_gpu_hours:.1f} GPU-h of "
            f"{a.cloud}/{a.region}/{a.instance_type} history); expected loss "
            f"{advice.lost.total:.2%}"
        )
        repo.record_event(
            s,
            job.id,
            idempotency_key=f"interval-a{a.number}-{new}",
            kind=EventKind.CHECKPOINT_INTERVAL,
            message=text,
            details={"every_steps": new, "previous": current, **advice.to_json_dict()},
            now=snap.now,
        )
        work.enqueue_command(
            s, job.id, a.number, CommandType.SET_CHECKPOINT_EVERY, {"every_steps": new}, snap.now
        )
        return new

    def _advice_due(self, rows: Rows, snap: rc.JobSnapshot) -> bool:
        """The job adapts its interval and was last advised ``advise_every_s`` ago."""
        if not rows.spec.checkpoint.adaptive or rows.attempt is None or snap.attempt is None:
            return False
        last = self._last_advice.get(rows.job.id)
        return last is None or (snap.now - last).total_seconds() >= self.advise_every_s

    # --- apply: one executor per action -----------------------------------------------------

    def apply(self, s: Session, rows: Rows, snap: rc.JobSnapshot, action: rc.Action) -> None:
        now, job_id = snap.now, rows.job.id
        match action:
            case rc.SetStatus(status=st, reason=reason):
                self._set_status(s, job_id, st, reason, now)
            case rc.RecordAttempt():
                work.record_attempt(s, rows.job, rows.spec, action, self.launcher.name, now)
            case rc.StartNodes(number=n, verb=verb, launch_try=launch_try):
                self._start_nodes(s, rows, n, now, verb=verb, launch_try=launch_try)
            case rc.MarkProvisioned(number=n, hosts=hosts):
                work.attempt_up(s, rows.job, job_id, n, hosts, now)
            case rc.LaunchRequestFailed(number=n, detail=detail, capacity=capacity, verb=verb):
                self._launch_failed(s, rows, n, detail, capacity, now, verb)
            case rc.Replan(number=n, placement=p, reason=reason):
                work.replan_attempt(s, job_id, n, p, reason, now)
            case rc.RecordFailure():
                number = rows.attempt.number if rows.attempt else 0
                work.record_failure(s, job_id, number, action, now)
            case rc.RecordNote():
                work.record_note(s, job_id, action, now)
            case rc.OpenIncident():
                work.open_incident(s, job_id, action, now)
            case rc.StartStep(incident_id=i, step=step):
                work.start_step(s, job_id, i, step, now)
            case rc.FinishStep(incident_id=i, step=step, outcome=o, detail=d, result=r):
                work.finish_step(s, i, step, o, d, now, result=r)
            case rc.HoldWarm(attempt=number, node_ids=ids):
                agents.hold_nodes(s, job_id, number, ids)
            case rc.SendCommand(attempt=number, type=type_, args=args):
                work.enqueue_command(s, job_id, number, type_, dict(args), now)
            case rc.Release(attempt=number, reason=reason, keep_nodes=keep, release_nodes=gone):
                self._release(s, job_id, number, reason, now, keep_nodes=keep, release=gone)
            case rc.MarkValidated(attempt=number, step=step):
                work.mark_validated(s, job_id, number, step, now)
            case rc.ReleaseSpare(attempt=number, reason=reason):
                self._release_spare(s, job_id, number, reason, now)
            case rc.LaunchSpare():
                self._launch_spare(s, rows, action, now)

    def _set_status(
        self, s: Session, job_id: str, st: JobStatus, reason: str, now: datetime
    ) -> None:
        job = repo.get_job(s, job_id)
        if JobStatus(job.status) is st:
            return
        # Refused moves are logged by the store: e.g. cancelled by an operator meanwhile.
        with contextlib.suppress(IllegalTransition):
            repo.set_status(s, job_id, st, reason=reason, now=now)

    def _release(
        self, s: Session, job_id: str, number: int, reason: str, now: datetime, *,
        keep_nodes: bool, release: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        a = attempt_row(s, job_id, number)
        if a is None:
            return
        if a.state != AttemptState.ENDED:
            work.end_attempt(a, reason, now)
        if not keep_nodes:
            self._give_back(s, job_id, number, reason)
        elif release and self.launcher.abilities.releases_single_nodes:
            for part in parts_of(a):
                ids = [n for n in part.node_ids if n in release]
                hosts = [h for n, h in zip(part.node_ids, part.hosts, strict=False) if n in release]
                if ids:
                    self._down(job_id, replace(part, node_ids=tuple(ids), hosts=tuple(hosts)))

    def _release_spare(
        self, s: Session, job_id: str, number: int, reason: str, now: datetime
    ) -> None:
        """Give back a shrunk attempt's standby launch; the attempt trains on."""
        a = attempt_row(s, job_id, number)
        if a is None:
            return
        spare = records.launch_plan_of(a).spare_cluster
        for part in parts_of(a):
            if part.cluster_name == spare:
                self._down(job_id, part)
        work.spare_released(a, reason, now)

    def _give_back(self, s: Session, job_id: str, number: int, reason: str) -> None:
        """Tear down every launch of the attempt (kept nodes included: whoever asks
        knows they are not used any more). Asked once here; the attempt is recorded
        ``downed`` only when every launch is confirmed gone, now or by
        :meth:`finish_teardowns` on a later tick, which asks again after a failed
        down: a teardown recorded as done while the cluster bills on is a leak nobody
        looks for."""
        a = attempt_row(s, job_id, number)
        if a is None or not work.teardown_asked(a, reason):
            return
        self._teardown(a)

    def _teardown(self, a: Attempt) -> None:
        """One round of the attempt's teardown: each launch confirmed gone (a launcher
        that ``confirms_down``), or asked down (again: ``down`` is idempotent)."""
        left = []
        for part in parts_of(a):
            if self.launcher.abilities.confirms_down:
                # Declared (``confirms_down``); the launchers that declare it implement
                # ConfirmsDown (tests/reconciler/test_launch_verbs checks).
                found = cast(ConfirmsDown, self.launcher).confirm_down(part)
                if found.gone:
                    continue
                failed = self._down(a.job_id, part)
                left.append(f"{part.cluster_name}: {failed or found.detail or 'not gone yet'}")
            else:  # its down is finished when it returns
                failed = self._down(a.job_id, part)
                if failed is not None:
                    left.append(f"{part.cluster_name}: {failed}")
        work.teardown_round(a, left)

    def finish_teardowns(self, now: datetime | None = None) -> int:
        """Confirm (or ask again for) every teardown asked for and not yet confirmed;
        the number still pending. Fenced: only the leader calls the launcher."""
        now = now or repo.utcnow()
        with db.read_session(self.sessionmaker) as s:
            pending = work.teardowns_pending(s, now)
        for job_id, number in pending:
            try:
                with self.sessionmaker() as s, s.begin():
                    self._fence(s, now)
                    a = attempt_row(s, job_id, number)
                    if a is not None:
                        self._teardown(a)
            except work.NotLeader:
                self.epoch = None
                return len(pending)
        with db.read_session(self.sessionmaker) as s:
            return len(work.teardowns_pending(s, now))

    def _down(self, job_id: str, handle: LaunchHandle) -> str | None:
        """Ask for ``handle``'s teardown; why it could not be asked (None: asked)."""
        try:
            self.launcher.down(handle)
        except LaunchError as e:  # asked again on a later tick (finish_teardowns)
            log.warning("job %s: giving back %s failed: %s", job_id, handle.cluster_name, e)
            return str(e) or type(e).__name__
        return None

    def _launch_failed(
        self, s: Session, rows: Rows, number: int, detail: str, capacity: bool, now: datetime,
        verb: rc.LaunchVerb,
    ) -> None:  # fmt: skip
        """Record the failed request as a refused launch; give back whatever of it the
        provider did bring up (a half-provisioned cluster still bills)."""
        a = attempt_row(s, rows.job.id, number)
        if a is None:
            return
        for handle in work.launch_request_failed(
            s, rows.job.id, number, placement_of(a), detail, capacity=capacity, now=now, verb=verb
        ):
            self._down(rows.job.id, handle)

    def _start_nodes(
        self, s: Session, rows: Rows, number: int, now: datetime, *,
        verb: rc.LaunchVerb, launch_try: int = 0,
    ) -> None:  # fmt: skip
        """Ask the launcher for the recorded attempt exactly as it was recorded, by the
        verb ``decide`` chose (nothing here picks one). The launcher answers with a
        request at once (provisioning is polled on later ticks, never waited on
        here); a refusal is recorded (``launch_failed``, with its verb) for ``decide``
        to fall back, re-plan or stop.

        ``launch_try`` (the launch failures already recorded for the attempt) keys the
        request with the job and attempt: a leader that crashed, or lost its lease,
        between the launcher's answer and the commit left an attempt with no handle,
        and the next one to ask for the same key is answered with the same request
        (adopted, never launched twice); after a failed request the key moves on, so
        a re-plan is a new request and not the failed one again."""
        a = attempt_row(s, rows.job.id, number)
        if a is None or a.handle:
            return
        plan = records.launch_plan_of(a)
        request = self._request(rows, a, launch_try)
        previous = attempt_row(s, rows.job.id, number - 1)
        before = parts_of(previous) if previous is not None else []
        shrink: _Shrink | None = None
        try:
            if verb is rc.LaunchVerb.SHRINK:
                shrink = self._shrink(s, request, previous, plan)
                parts = [*shrink.group, *([shrink.spare] if shrink.spare else [])]
            else:
                parts = self._ask(verb, request, previous, before, plan, s)
        except SubmitUncertain as e:
            # The provider may hold the request: the next tick asks for the same key
            # (adopting what was accepted), never a new one, and no failure is counted.
            log.warning("job %s: attempt %s: %s; asking again", rows.job.id, number, e)
            return
        except LaunchError as e:
            work.record_launch_failure(
                s, rows.job.id, number, request.placement, str(e),
                capacity=isinstance(e, CapacityError), now=now,
                retryable=not isinstance(e, TaskRejected), verb=verb,
            )  # fmt: skip
            return
        crash_point("launch-accepted", number)
        work.attempt_started(s, a, parts, now, verb)
        if shrink is not None:
            work.spare_launched(s, a, shrink.spare, shrink.refused, now)
            if shrink.carry and previous is not None:
                rpn = rows.spec.ranks_per_node
                self._send_regroups(s, previous, a, plan, shrink.carry, rpn, now)

    def _request(self, rows: Rows, a: Attempt, launch_try: int) -> LaunchRequest:
        """The launch request of attempt ``a`` as it was recorded: its placement, and
        the environment every node of it is started with."""
        job, spec = rows.job, rows.spec
        number = a.number
        placement = placement_of(a)
        plan = records.launch_plan_of(a)
        env = {
            Env.SERVICE_URL: self.service_url,
            **({Env.CA_PEM: self.service_ca_pem} if self.service_ca_pem else {}),
            Env.JOB_ID: job.id,
            Env.ATTEMPT: str(number),
            Env.CHECKPOINT_URI: spec.checkpoint.uri,
            Env.CHECKPOINT_EVERY: str(spec.checkpoint.every_steps),
            Env.CHECKPOINT_KEEP: str(spec.checkpoint.keep),
            Env.RESUME_FROM: plan.resume_from,
        }
        if a.resume_step is not None:
            env[Env.EXPECTED_STEP] = str(a.resume_step)
        if plan.stage_from:
            env[Env.STAGE_FROM] = plan.stage_from
        if spec.checkpoint.own is not None:
            env[Env.OWN_CHECKPOINT] = spec.checkpoint.own.path
            env[Env.OWN_RESUME_ARG] = spec.checkpoint.own.resume_arg
        if plan.collective_timeout_s:
            env[Env.COLLECTIVE_TIMEOUT_S] = str(plan.collective_timeout_s)
        if plan.skip_steps:
            first, last = plan.skip_steps
            env[Env.SKIP_STEPS] = f"{first}-{last}"
        if spec.model is not None:
            env[Env.GLOBAL_BATCH] = str(spec.model.global_batch)
            env[Env.MICRO_BATCH] = str(spec.model.micro_batch)
        if spec.elastic_nodes:
            env[Env.FULL_WORLD_SIZE] = str(spec.num_nodes * spec.ranks_per_node)
            env[Env.ELASTIC_BATCH] = spec.elastic.batch
            env[Env.ELASTIC_LR] = spec.elastic.lr
        if placement.knobs is not None:
            env[Env.MICRO_BATCH] = str(placement.knobs.micro_batch)
            env[Env.GRAD_ACCUM] = str(placement.knobs.grad_accum)
            env[Env.ACTIVATION_CHECKPOINT_EVERY] = str(placement.knobs.activation_checkpoint_every)
        return LaunchRequest(
            job_id=job.id,
            attempt=number,
            placement=placement,
            command=spec.task.command or "",
            env=env,
            ranks_per_node=spec.ranks_per_node,
            grace_s=spec.restarts.grace_period_s,
            task=spec.task,
            exclude_hosts=plan.exclude_hosts,
            launch_try=launch_try,
        )

    def _ask(
        self, verb: rc.LaunchVerb, request: LaunchRequest, previous: Attempt | None,
        before: list[LaunchHandle], plan: records.LaunchPlan, s: Session,
    ) -> list[LaunchHandle]:  # fmt: skip
        """Carry out ``verb``. A verb the last attempt's launches cannot take (decide
        chose it from the same snapshot, so only a row changed since) is a refused
        launch, which ``decide`` answers with a fresh one."""
        if verb is rc.LaunchVerb.LAUNCH:
            return [self.launcher.launch(request)]
        if previous is None or not before:
            raise LaunchError(f"a {verb} needs the last attempt's nodes, and none are recorded")
        if verb is rc.LaunchVerb.RESTART_IN_PLACE:
            if len(before) != 1:
                raise LaunchError(f"a restart in place of {len(before)} launches is a join")
            return [self.launcher.restart(before[0], request)]
        if verb is rc.LaunchVerb.REFILL:
            if len(before) != 1:
                raise LaunchError(f"a refill of {len(before)} launches: refill one cluster")
            # The ability is declared (``refills_clusters``, which decide read); the
            # launchers that declare it are RefillingLaunchers (tests/launchers check).
            refiller = cast(RefillingLauncher, self.launcher)
            return [refiller.refill(before[0], request)]
        return self._join_survivors(s, request, previous, plan.keep, plan.keep_hosts)

    def _join_survivors(
        self, s: Session, request: LaunchRequest, previous: Attempt, keep: tuple[str, ...],
        keep_hosts: tuple[str, ...],
    ) -> list[LaunchHandle]:  # fmt: skip
        """The kept nodes restart in place as node ranks 0..k-1 (per launch they came
        from), then the replacements launch as ranks k..n-1; every node is told the
        group's size and the rendezvous address, a kept node's (the service assigns
        both: a launch only knows its own nodes)."""
        n = request.placement.num_nodes
        address = work.node_address(s, previous.job_id, previous.number, keep[0])
        if not address:
            raise LaunchError(f"no address known for kept node {keep[0]}: cannot rendezvous")
        group = {Env.NNODES: str(n), Env.MASTER_ADDR: address}
        parts: list[LaunchHandle] = []
        base = 0
        for part in parts_of(previous):
            ids = [x for x in part.node_ids if x in keep]
            if not ids:
                continue
            hosts = [h for x, h in zip(part.node_ids, part.hosts, strict=False) if x in keep]
            sub = replace(part, node_ids=tuple(ids), hosts=tuple(hosts))
            parts.append(
                self.launcher.restart(sub, self._part_request(request, base, len(ids), group))
            )
            base += len(ids)
        if base < n:
            extra = tuple(h for h in keep_hosts if h)
            fresh = self._part_request(request, base, n - base, group)
            parts.append(
                self.launcher.launch(replace(fresh, exclude_hosts=(*request.exclude_hosts, *extra)))
            )
        return parts

    def _shrink(
        self, s: Session, request: LaunchRequest, previous: Attempt | None,
        plan: records.LaunchPlan,
    ) -> _Shrink:  # fmt: skip
        """An elastic shrink: the kept nodes restart in place at once as a group of
        their own (``train_nodes``); the replacements launch beside them as standby
        (``Env.STANDBY``: their agents register and start no ranks) for the grow. A
        refused standby launch does not hold the group back: it trains on shrunk,
        and the refusal is recorded (``spare_launched``)."""
        if previous is None or not plan.keep:
            raise LaunchError("a shrink needs the last attempt's kept nodes, and none are recorded")
        n = request.placement.num_nodes
        k = plan.train_nodes or len(plan.keep)
        carry = ""
        if plan.warm:
            # Carried: the kept nodes' launches go on as they are (their agents and
            # ranks live); each is handed its membership once the attempt is recorded.
            carry = work.node_address(s, previous.job_id, previous.number, plan.keep[0]) or ""
            if not carry:
                raise LaunchError(f"no address known for kept node {plan.keep[0]}: cannot regroup")
            parts = _kept_parts(previous, plan.keep)
        else:
            group = replace(request, placement=replace(request.placement, num_nodes=k))
            parts = self._join_survivors(s, group, previous, plan.keep, plan.keep_hosts)
        if k >= n:
            return _Shrink(parts, carry=carry)
        # Told the group's rendezvous (a kept node's address): a launcher that places
        # nodes one by one puts the spare beside the group (SkyPilot's node grouping
        # pins it to the survivor's zone); the grow restarts it with the same address.
        address = work.node_address(s, previous.job_id, previous.number, plan.keep[0]) or ""
        standby = self._part_request(
            request, k, n - k, {Env.NNODES: str(n), Env.STANDBY: "1", Env.MASTER_ADDR: address}
        )
        extra = tuple(h for h in plan.keep_hosts if h)
        try:
            spare = self.launcher.launch(
                replace(standby, exclude_hosts=(*request.exclude_hosts, *extra))
            )
        except SubmitUncertain:
            raise  # asked again, with the same keys, on the next tick
        except LaunchError as e:
            return _Shrink(parts, refused=str(e) or type(e).__name__, carry=carry)
        return _Shrink(parts, spare, carry=carry)

    def _launch_spare(self, s: Session, rows: Rows, action: rc.LaunchSpare, now: datetime) -> None:
        """Ask again for the replacements of an attempt that trains on fewer nodes
        (``LaunchSpare``): ``count`` standby nodes beside the group, told its
        rendezvous (the address of its node rank 0), never on one of its hosts. A
        refusal is recorded for ``decide``, which asks again later."""
        a = attempt_row(s, rows.job.id, action.attempt)
        if a is None or a.state != AttemptState.RUNNING or not a.handle:
            return
        request = self._request(rows, a, 0)
        address = work.group_address(s, rows.job.id, a.number) or ""
        # A standby trains nothing: its size only bounds its node rank (the agent checks
        # it), which is past the group's; the grow tells every node the group's size.
        top = str(action.node_rank_base + action.count)
        standby = self._part_request(
            request, action.node_rank_base, action.count,
            {Env.NNODES: top, Env.STANDBY: "1", Env.MASTER_ADDR: address},
        )  # fmt: skip
        busy = tuple(h for part in parts_of(a) for h in part.hosts if h)
        try:
            spare = self.launcher.launch(
                replace(standby, exclude_hosts=(*request.exclude_hosts, *busy))
            )
        except SubmitUncertain as e:
            log.warning("job %s: attempt %s: standby: %s; asking again", a.job_id, a.number, e)
            return  # the same try, the same key, on the next tick
        except LaunchError as e:
            work.spare_asked_again(s, a, action, None, str(e) or type(e).__name__, now)
            return
        work.spare_asked_again(s, a, action, spare, "", now)

    @staticmethod
    def _send_regroups(
        s: Session, previous: Attempt, a: Attempt, plan: records.LaunchPlan, address: str,
        ranks_per_node: int, now: datetime,
    ) -> None:  # fmt: skip
        """A warm shrink: each kept node, held at ``previous``, gets a ``regroup``
        command there naming its place in attempt ``a``'s group (node ranks in keep
        order; global rank 0 on the first kept node, at ``address``, where the service
        saw its agent, on a port new to this generation)."""
        k = len(plan.keep)
        for rank, node_id in enumerate(plan.keep):
            m = Membership(
                generation=a.number,
                world_size=k * ranks_per_node,
                node_rank=rank,
                nnodes=k,
                nproc_per_node=ranks_per_node,
                master_addr=address,
                master_port=regroup_port(a.number),
                resume_step=a.resume_step,
            )
            args = {
                "attempt": a.number,
                "membership": m.to_doc(),
                "stage_from": plan.stage_from,
                "resume_from": plan.resume_from,
            }
            work.enqueue_command(
                s, a.job_id, previous.number, CommandType.REGROUP, args, now, node_id=node_id
            )

    @staticmethod
    def _part_request(
        request: LaunchRequest, base: int, count: int, group: dict[str, str]
    ) -> LaunchRequest:
        return replace(
            request,
            placement=replace(request.placement, num_nodes=count),
            env={**request.env, **group, Env.NODE_RANK_BASE: str(base)},
            node_rank_base=base,
        )


@dataclass(frozen=True)
class _Shrink:
    """What a shrink's launch started: the training group's restarts (or, carried
    warm, its launches as they were), and the standby launch (None when it was
    refused, and why)."""

    group: list[LaunchHandle]
    spare: LaunchHandle | None = None
    refused: str = ""
    carry: str = ""
    """Carried warm: the group's rendezvous address (the first kept node's)."""


#: A warm group's rendezvous port is this plus its generation modulo the span: new per
#: generation (the group left may still hold its own), clear of torchrun's 29500 and
#: the health check's 29501 that the first launch used.
REGROUP_PORT_BASE = 29600
REGROUP_PORT_SPAN = 400


def regroup_port(generation: int) -> int:
    return REGROUP_PORT_BASE + generation % REGROUP_PORT_SPAN


def _kept_parts(previous: Attempt, keep: tuple[str, ...]) -> list[LaunchHandle]:
    """The last attempt's launches cut to the kept nodes, in node-rank order: what a
    carried group runs on, nothing asked of the launcher."""
    parts = []
    for part in parts_of(previous):
        ids = [x for x in part.node_ids if x in keep]
        if ids:
            hosts = [h for x, h in zip(part.node_ids, part.hosts, strict=False) if x in keep]
            parts.append(replace(part, node_ids=tuple(ids), hosts=tuple(hosts)))
    if sorted(x for p in parts for x in p.node_ids) != sorted(keep):
        raise LaunchError(f"a carried shrink needs every kept node's launch; found {parts}")
    return parts


#: ``SKYRESUME_CRASH_AT``: the crash-safety harness (bench/crashsafe.py) sets it to
#: make the service SIGKILL itself at a point no outside observer can time, e.g.
#: ``launch-accepted`` (the launcher holds the request; the handle is not committed).
CRASH_AT_ENV = "SKYRESUME_CRASH_AT"


def crash_point(name: str, attempt: int | None = None) -> None:
    """SIGKILL this process here when ``SKYRESUME_CRASH_AT`` names this point
    (``name``, or ``name@N`` for attempt N only)."""
    want = os.environ.get(CRASH_AT_ENV)
    if want is not None and want in (name, f"{name}@{attempt}"):
        log.warning("crash point %s (attempt %s): SIGKILL", name, attempt)
        os.kill(os.getpid(), signal.SIGKILL)
