"""The reconciler's writes and the few reads it needs besides the snapshot.

Each function takes a Session and commits nothing (the reconciler's tick owns the
transaction), and each is idempotent: a step row is inserted once and finished once,
an attempt is recorded once per number, an incident once per attempt. A service
killed between two of them finds, on the next tick, exactly what was committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, or_, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrator.contract import AttemptState, CommandType, EventKind
from orchestrator.domain import reconcile as rc
from orchestrator.domain.plan import Placement
from orchestrator.domain.protocol import ProtocolStep, StepOutcome
from orchestrator.domain.spec import JobSpec
from orchestrator.domain.status import TERMINAL
from orchestrator.launchers.base import LaunchHandle
from orchestrator.store import records, repo
from orchestrator.store.incidents import (
    fleet_incident_records,
    incident_mttr,
    is_planned,
    rank_values,
)
from orchestrator.store.models import Attempt, FailureEvent, Job, Lease, Node, NodeCommand
from orchestrator.store.models import ProtocolStep as StepRow
from orchestrator.store.shape import attempt_shape
from orchestrator.store.snapshot import attempt_row, handle_time, parts_of, utc

LEASE_NAME = "reconciler"


class NotLeader(RuntimeError):
    """The fence refused the write: another replica holds the lease now (or this one's
    ran out). The transaction must be rolled back and the snapshot read again."""


def acquire_lease(s: Session, holder: str, lease_s: float, now: datetime) -> int | None:
    """Take or renew the reconciler lease; its epoch (the fencing token), or None while
    another holder's lease is valid. The epoch grows by one each time the lease changes
    holder, never on a renewal (nobody else acted in between)."""
    until = now + timedelta(seconds=lease_s)
    try:
        with s.begin():
            got = s.execute(
                update(Lease)
                .where(Lease.name == LEASE_NAME)
                .where(or_(Lease.holder == holder, Lease.expires_at < now))
                .values(
                    holder=holder,
                    expires_at=until,
                    epoch=case((Lease.holder == holder, Lease.epoch), else_=Lease.epoch + 1),
                )
                .returning(Lease.epoch)
            ).scalar_one_or_none()
            if got is not None:
                return int(got)
            if s.get(Lease, LEASE_NAME) is None:
                s.add(Lease(name=LEASE_NAME, holder=holder, expires_at=until, epoch=1))
                s.flush()
                return 1
            return None
    except IntegrityError:  # another replica inserted first
        return None


def fence(s: Session, holder: str, epoch: int, lease_s: float, now: datetime) -> None:
    """Check, inside the caller's transaction, that ``holder`` still holds the lease at
    ``epoch``, and renew it; NotLeader when not.

    A lease that ran out but that nobody took (the same holder and epoch: a takeover
    always moves the epoch, :func:`acquire_lease`) is renewed too. Nobody else acted
    in between, so the holder's snapshot is as good as a slow tick's. Refusing it made
    a round whose reads outlast the lease (SkyPilot's status of two clusters, each up
    to 5 s, in one gather) refuse its own fence every time: seen through SkyPilot's
    provisioner as 230 s of rounds rolled back while the nodes were up (issue 19).

    Every transaction of the reconciler that writes (launch intent, attempt, release,
    node command, step transition) calls this before its first write or launcher
    call. It is a conditional UPDATE of the lease row, so the row stays locked until
    the caller commits: on PostgreSQL a replica taking the lease over waits for that
    commit, then finds the lease renewed (and takes nothing), or it went first and
    this UPDATE matches no row. Either way the writes of two epochs never interleave.
    On PostgreSQL the transaction also gets ``idle_in_transaction_session_timeout``
    = the lease's length: a holder stopped (SIGSTOP, a partition) while it holds the
    row lock is cut off by the server, so its commit fails and the next replica waits
    no longer than a lease. ``now`` must be read when the write happens, never the
    snapshot's time: a leader paused between the two would fence with a stale clock.
    """
    if s.get_bind().dialect.name == "postgresql":
        ms = max(1000, int(lease_s * 1000))
        s.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {ms}"))
    got = s.execute(
        update(Lease)
        .where(Lease.name == LEASE_NAME)
        .where(Lease.holder == holder, Lease.epoch == epoch)
        .values(expires_at=now + timedelta(seconds=lease_s))
        .returning(Lease.epoch)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    if got is None:
        raise NotLeader(f"{holder} no longer holds the reconciler lease at epoch {epoch}")


def lease_holder(s: Session) -> tuple[str, int, datetime] | None:
    """(holder, epoch, expires_at) of the reconciler lease, for the harnesses and tests."""
    row = s.get(Lease, LEASE_NAME)
    if row is None:
        return None
    return row.holder, row.epoch, utc(row.expires_at) or row.expires_at


def jobs_to_reconcile(s: Session) -> list[str]:
    """Jobs not terminal, and terminal ones whose nodes are not released yet."""
    return list(
        s.scalars(
            select(Job.id).where(
                or_(
                    Job.status.not_in([str(t) for t in TERMINAL]),
                    Job.id.in_(select(Attempt.job_id).where(Attempt.state != AttemptState.ENDED)),
                )
            )
        )
    )


# --- protocol steps ------------------------------------------------------------------------


def _step_row(s: Session, inc: int, step: ProtocolStep) -> StepRow | None:
    return s.scalars(
        select(StepRow).where(StepRow.incident_id == inc, StepRow.step == str(step))
    ).first()


def start_step(s: Session, job_id: str, inc: int, step: ProtocolStep, at: datetime) -> None:
    if _step_row(s, inc, step) is None:
        s.add(StepRow(job_id=job_id, incident_id=inc, step=str(step), started_at=at))
        s.flush()


def finish_step(
    s: Session,
    inc: int,
    step: ProtocolStep,
    outcome: StepOutcome,
    detail: str,
    now: datetime,
    *,
    result: rc.StepResult | None = None,
) -> None:
    row = _step_row(s, inc, step)
    if row is None:
        job_id = s.get(FailureEvent, inc).job_id  # type: ignore[union-attr]
        start_step(s, job_id, inc, step, now)
        row = _step_row(s, inc, step)
    assert row is not None
    if row.finished_at is not None:
        return
    row.finished_at = now
    row.outcome = str(outcome)
    row.detail = detail[:2000]
    row.result = records.result_json(result) if result is not None else None
    s.flush()


def record_failure(
    s: Session, job_id: str, attempt: int, action: rc.RecordFailure, now: datetime
) -> None:
    """A failure the reconciler detected itself, once per (kind, attempt, node, rank)."""
    where = action.node_id or "all"
    repo.record_event(
        s,
        job_id,
        idempotency_key=f"{action.kind}-a{attempt}-{where}-{action.rank}",
        kind=action.kind,
        failure_class=str(action.failure_class),
        node_id=action.node_id,
        rank=action.rank,
        message=action.message,
        details={"attempt": attempt, "detected_by": "reconciler"},
        now=now,
    )


def record_note(s: Session, job_id: str, action: rc.RecordNote, now: datetime) -> None:
    """A fact the reconciler noticed that is no failure, once per (kind, attempt,
    key)."""
    key = f"{action.kind}-a{action.attempt}" + (f"-{action.key}" if action.key else "")
    repo.record_event(
        s,
        job_id,
        idempotency_key=key,
        kind=action.kind,
        message=action.message,
        details={"attempt": action.attempt, "detected_by": "reconciler"},
        now=now,
    )


def open_incident(s: Session, job_id: str, action: rc.OpenIncident, now: datetime) -> int:
    cause = action.cause
    inc, _ = repo.record_event(
        s,
        job_id,
        idempotency_key=f"incident-a{action.attempt}",
        kind=EventKind.INCIDENT,
        failure_class=str(cause.failure_class),
        node_id=cause.node_id,
        rank=cause.rank,
        message=cause.message,
        details={
            "attempt": action.attempt,
            "cause_event_id": cause.event_id,
            "last_step": action.last_step,
            "consequences": list(action.consequences),
            "host": action.host,
            "signature": cause.signature,
            "onset_step": action.onset_step,
        },
        occurred_at=cause.occurred_at,
        now=now,
    )
    start_step(s, job_id, inc.id, ProtocolStep.DETECT, cause.occurred_at)
    finish_step(
        s,
        inc.id,
        ProtocolStep.DETECT,
        StepOutcome.OK,
        f"{cause.failure_class} ({cause.kind}) on {cause.node_id or 'the attempt'}: "
        f"{cause.message}"[:1000]
        + (f" (+{len(action.consequences)} consequences)" if action.consequences else ""),
        now,
    )
    a = attempt_row(s, job_id, action.attempt)
    if a is not None and a.state != AttemptState.ENDED:
        a.state = AttemptState.STOPPING
    return inc.id


def enqueue_command(
    s: Session,
    job_id: str,
    attempt: int,
    type_: CommandType,
    args: dict[str, Any],
    now: datetime,
    node_id: str | None = None,
) -> NodeCommand:
    cmd = NodeCommand(
        job_id=job_id, attempt=attempt, node_id=node_id, type=str(type_), args=args, created_at=now
    )
    s.add(cmd)
    return cmd


# --- attempts --------------------------------------------------------------------------------


def record_attempt(
    s: Session, job: Job, spec: JobSpec, action: rc.RecordAttempt, launcher: str, now: datetime
) -> None:
    if attempt_row(s, job.id, action.number) is not None:
        return
    p = action.placement
    s.add(
        Attempt(
            job_id=job.id,
            number=action.number,
            cloud=p.cloud,
            region=p.region,
            zone=p.zone,
            instance_type=p.instance_type,
            accelerator=p.accelerator,
            num_nodes=p.num_nodes,
            spot=p.spot,
            price_per_node_hour=p.price_per_node_hour,
            knobs={
                "ranks_per_node": spec.ranks_per_node,
                "gpu_memory_gib": p.gpu_memory_gib,
                "accelerator_count": p.accelerator_count,
                **records.plan_json(action),
                **(p.knobs.to_dict() if p.knobs else {}),
            },
            resume_step=action.resume_step,
            started_at=now,
            state=AttemptState.LAUNCHING,
            launcher=launcher,
            incident_id=action.incident_id,
        )
    )
    s.flush()


def replan_attempt(
    s: Session, job_id: str, number: int, p: Placement, reason: str, now: datetime
) -> None:
    """A launch refused for capacity: the attempt (not yet started) moves to ``p``. The
    survivors it kept cannot follow (``decide`` gives them back with the re-plan)."""
    a = attempt_row(s, job_id, number)
    if a is None or a.handle:
        return
    a.cloud, a.region, a.zone, a.instance_type = p.cloud, p.region, p.zone, p.instance_type
    a.accelerator, a.num_nodes, a.spot = p.accelerator, p.num_nodes, p.spot
    a.price_per_node_hour = p.price_per_node_hour
    # Survivors cannot join a replacement in another region: the whole group moves.
    a.knobs = {**(a.knobs or {}), "gpu_memory_gib": p.gpu_memory_gib, "keep": [],
               "keep_hosts": []}  # fmt: skip
    a.started_at = now
    repo.record_event(
        s,
        job_id,
        idempotency_key=f"replan-a{number}-{p.cloud}-{p.region}-{p.instance_type}",
        kind=EventKind.REPLANNED,
        message=f"attempt {number} re-planned: {reason}",
        details={"attempt": number, "cloud": p.cloud, "region": p.region,
                 "instance_type": p.instance_type},
        now=now,
    )  # fmt: skip
    s.flush()


def record_launch_failure(
    s: Session,
    job_id: str,
    number: int,
    p: Placement,
    message: str,
    *,
    capacity: bool,
    now: datetime,
    retryable: bool = True,
    verb: rc.LaunchVerb = rc.LaunchVerb.LAUNCH,
) -> None:
    tries = s.scalars(
        select(FailureEvent).where(
            FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.LAUNCH_FAILED
        )
    ).all()
    repo.record_event(
        s,
        job_id,
        idempotency_key=f"launch-failed-a{number}-{len(tries)}",
        kind=EventKind.LAUNCH_FAILED,
        failure_class="capacity_unavailable" if capacity else "unknown",
        message=message[:2000],
        details={
            "attempt": number,
            "cloud": p.cloud,
            "region": p.region,
            "instance_type": p.instance_type,
            "num_nodes": p.num_nodes,
            "capacity": capacity,
            "retryable": retryable,
            "verb": str(verb),
        },
        now=now,
    )


def _part(h: LaunchHandle) -> dict[str, Any]:
    return {
        "cluster_name": h.cluster_name,
        "node_ids": list(h.node_ids),
        "hosts": list(h.hosts),
        "request_id": h.request_id,
    }


def attempt_started(
    s: Session,
    a: Attempt,
    parts: list[LaunchHandle],
    now: datetime,
    verb: rc.LaunchVerb = rc.LaunchVerb.LAUNCH,
) -> None:
    """The launcher accepted the request(s): the attempt is provisioning (LAUNCHING)
    until :func:`attempt_up`. Several parts: the kept nodes' restart and the
    replacements' launch, node ranks in that order. ``verb``: how they were asked for
    (what the attempts API shows)."""
    last = parts[-1]
    a.handle = {
        "verb": str(verb),
        **_part(parts[0]),
        "launcher": last.launcher,
        "node_ids": [n for h in parts for n in h.node_ids],
        "hosts": [x for h in parts for x in h.hosts],
        "request_id": last.request_id,
        "requested_at": now.isoformat(),
        **({"parts": [_part(h) for h in parts]} if len(parts) > 1 else {}),
    }
    a.cluster_name = parts[0].cluster_name
    s.flush()


def spare_launched(
    s: Session, a: Attempt, spare: LaunchHandle | None, refused: str, now: datetime
) -> None:
    """A shrink's standby launch (``LaunchVerb.SHRINK``): which launch holds the spares,
    or, when the launcher refused it, why (the group trains on shrunk, and says so)."""
    if spare is not None:
        a.knobs = {**(a.knobs or {}), "spare_cluster": spare.cluster_name}
    else:
        reason = f"the standby launch was refused: {refused or 'no reason given'}"
        a.knobs = {**(a.knobs or {}), "spare_released": reason,
                   "spare_released_at": now.isoformat()}  # fmt: skip
        repo.record_event(
            s,
            a.job_id,
            idempotency_key=f"{EventKind.ELASTIC}-spare-a{a.number}",
            kind=EventKind.ELASTIC,
            message=f"replacement lost: {reason}; training goes on shrunk",
            details={"attempt": a.number, "detected_by": "reconciler"},
            now=now,
        )
    s.flush()


def spare_released(a: Attempt, reason: str, now: datetime) -> None:
    """The shrunk attempt's spares were given back (``ReleaseSpare``)."""
    a.knobs = {**(a.knobs or {}), "spare_released": reason or "released",
               "spare_released_at": now.isoformat()}  # fmt: skip


def spare_asked_again(
    s: Session, a: Attempt, action: rc.LaunchSpare, spare: LaunchHandle | None, refused: str,
    now: datetime,
) -> None:  # fmt: skip
    """A later try at an attempt's replacements (``LaunchSpare``): the try before it
    (given back, or refused) moves to ``spare_past`` with the seconds it was held, and
    ``spare`` (None: refused, and why) is the current one. An attempt placed on fewer
    nodes becomes one that trains on ``train_nodes`` with spares beside it."""
    plan = records.launch_plan_of(a)
    held = plan.spare_held_s
    past = list(plan.spare_past)
    if plan.spare_cluster is not None:
        past.append(plan.spare_cluster)
        asked = plan.spare_asked_at or handle_time(a.handle, "requested_at")
        if asked is not None and plan.spare_released_at is not None:
            held += max(0.0, (plan.spare_released_at - asked).total_seconds())
    k = {
        **(a.knobs or {}),
        "train_nodes": plan.train_nodes if plan.train_nodes is not None else a.num_nodes,
        "spare_try": action.tries,
        "spare_base": action.node_rank_base,
        "spare_asked_at": now.isoformat(),
        "spare_past": past,
        "spare_held_s": held,
        "spare_cluster": spare.cluster_name if spare is not None else None,
        "spare_released": None,
        "spare_released_at": None,
    }
    if plan.verb is not rc.LaunchVerb.SHRINK:
        k["spare_count"] = action.count
    try_ = f"try {action.tries}"
    if spare is None:
        reason = f"the standby launch ({try_}) was refused: {refused or 'no reason given'}"
        k.update(spare_released=reason, spare_released_at=now.isoformat())
        message = f"replacement lost: {reason}; training goes on at {k['train_nodes']} nodes"
    else:
        message = f"{action.reason}: {spare.cluster_name} launching as standby"
        parts = [_part(h) for h in parts_of(a)] + [_part(spare)]
        a.handle = {
            **(a.handle or {}),
            "node_ids": [n for h in parts for n in h["node_ids"]],
            "hosts": [x for h in parts for x in h["hosts"]],
            "parts": parts,
        }
    a.knobs = k
    repo.record_event(
        s,
        a.job_id,
        idempotency_key=f"{EventKind.ELASTIC}-spare-a{a.number}-t{action.tries}",
        kind=EventKind.ELASTIC,
        message=message,
        details={"attempt": a.number, "detected_by": "reconciler", "try": action.tries},
        now=now,
    )
    s.flush()


def group_address(s: Session, job_id: str, number: int) -> str | None:
    """Where the nodes of attempt ``number`` rendezvous: the address the service saw
    the agent of its node rank 0 register from."""
    row = s.scalars(
        select(Node).where(Node.job_id == job_id, Node.attempt == number).order_by(Node.node_rank)
    ).first()
    ip = (row.progress or {}).get("client_ip") if row is not None else None
    return str(ip) if ip else None


def node_address(s: Session, job_id: str, number: int, node_id: str) -> str | None:
    """Where the other nodes reach ``node_id`` of attempt ``number``: the address the
    service saw its agent register from."""
    row = s.scalars(
        select(Node).where(Node.job_id == job_id, Node.node_id == node_id, Node.attempt == number)
    ).first()
    if row is None:
        return None
    ip = (row.progress or {}).get("client_ip")
    return str(ip) if ip else None


def attempt_up(
    s: Session, job: Job, job_id: str, number: int, hosts: tuple[str, ...], now: datetime
) -> None:
    """Every node of the attempt is up: it runs, and a relaunch counts as a restart;
    a planned reshape's (an elastic grow) does not: it repairs no failure, and the
    restart limit is a budget for failures."""
    a = attempt_row(s, job_id, number)
    if a is None or not a.handle or a.handle.get("up_at"):
        return
    a.handle = {
        **a.handle,
        "up_at": now.isoformat(),
        **({"hosts": list(hosts)} if hosts else {}),
    }
    if a.state == AttemptState.LAUNCHING:
        a.state = AttemptState.RUNNING
    if a.incident_id is not None:
        incident = s.get(FailureEvent, a.incident_id)
        if incident is None or not is_planned(incident.failure_class):
            job.restart_count += 1
    s.flush()


def launch_request_failed(
    s: Session,
    job_id: str,
    number: int,
    p: Placement,
    detail: str,
    *,
    capacity: bool,
    now: datetime,
    verb: rc.LaunchVerb = rc.LaunchVerb.LAUNCH,
) -> list[LaunchHandle]:
    """An accepted launch request failed (or timed out): recorded like a refused
    launch, and the attempt is back to not launched; returns the launches to give back."""
    a = attempt_row(s, job_id, number)
    if a is None or not a.handle or a.handle.get("up_at"):
        return []
    handles = parts_of(a)
    record_launch_failure(s, job_id, number, p, detail, capacity=capacity, now=now, verb=verb)
    a.handle = None
    a.cluster_name = None
    a.started_at = now  # the backoff before the next try counts from here
    s.flush()
    return handles


def teardown_asked(a: Attempt, reason: str) -> bool:
    """Record that the attempt's launches are to be given back; False when they are
    already (asked, or confirmed gone) or there is nothing to give back."""
    h = a.handle
    if not h or h.get("downed") or h.get("down_asked"):
        return False
    a.handle = {**h, "down_asked": reason[:200]}
    return True


def teardown_round(a: Attempt, left: list[str]) -> None:
    """After one round of the teardown: ``downed`` once nothing is ``left`` (every
    launch confirmed gone); else what is left, for the next round and the operator."""
    h = dict(a.handle or {})
    if not left:
        h.pop("down_pending", None)
        h["downed"] = str(h.get("down_asked") or "given back")
        # No cluster of its own any more: teardowns_pending stops looking at it.
        a.cluster_name = None
    else:
        h["down_pending"] = "; ".join(left)[:1000]
    a.handle = h


#: How long a teardown that was never confirmed is still polled (and asked again).
TEARDOWN_WINDOW = timedelta(days=7)


def teardowns_pending(s: Session, now: datetime) -> list[tuple[str, int]]:
    """(job, attempt) of every teardown asked for and not confirmed, oldest first."""
    rows = s.scalars(
        select(Attempt)
        .where(
            Attempt.state == AttemptState.ENDED,
            Attempt.cluster_name.is_not(None),
            Attempt.ended_at >= now - TEARDOWN_WINDOW,
        )
        .order_by(Attempt.ended_at)
    )
    return [
        (a.job_id, a.number)
        for a in rows
        if a.handle and a.handle.get("down_asked") and not a.handle.get("downed")
    ]


def end_attempt(a: Attempt, reason: str, now: datetime) -> None:
    a.state = AttemptState.ENDED
    a.ended_at = now
    a.end_reason = reason[:2000]


def mark_validated(
    s: Session, job_id: str, number: int, step: int, now: datetime | None = None
) -> None:
    a = attempt_row(s, job_id, number)
    if a is not None:
        a.validated_step = step
        if now is not None and a.handle and "validated_at" not in a.handle:
            # With the handle's up_at, a measured start-up (the validate timeout's).
            a.handle = {**a.handle, "validated_at": now.isoformat()}
        if a.state in (AttemptState.LAUNCHING, AttemptState.RUNNING):
            a.state = AttemptState.RUNNING


# --- the interval advisor's inputs -----------------------------------------------------------


@dataclass(frozen=True)
class IntervalFacts:
    step_times: list[float]
    saves: list[float]
    current_every: int
    exposures: list[Any]
    restart_seconds: float


def interval_facts(
    s: Session, job_id: str, number: int, default_every: int, now: datetime
) -> IntervalFacts:
    from orchestrator.domain.advisor import Exposure, PlacementKey

    step_times = [
        v
        for n in s.scalars(select(Node).where(Node.job_id == job_id, Node.attempt == number))
        for v in rank_values(n.progress, "step_time")
    ]
    saves = [
        e.details["blocking_s"]
        for e in s.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.CHECKPOINT)
            .order_by(FailureEvent.id.desc())
            .limit(5)
        )
        if isinstance((e.details or {}).get("blocking_s"), int | float)
    ]
    latest = s.scalars(
        select(FailureEvent)
        .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.CHECKPOINT_INTERVAL)
        .order_by(FailureEvent.id.desc())
    ).first()
    current = int(latest.details["every_steps"]) if latest is not None else default_every
    # An elastic grow is a planned reshape: neither a failure nor a failure's restart.
    failures = [r for r in fleet_incident_records(s) if not is_planned(r.event.failure_class)]
    mttrs = [
        mttr
        for r in failures
        if r.event.job_id == job_id and (mttr := incident_mttr(r.event.occurred_at, list(r.steps)))
    ]
    hours: dict[Any, float] = {}
    fails: dict[Any, int] = {}
    keys: dict[tuple[str, int], Any] = {}
    for a in s.scalars(select(Attempt)):
        k = PlacementKey(a.cloud, a.region, a.instance_type)
        keys[(a.job_id, a.number)] = k
        end = utc(a.ended_at) or now
        per_node = int((a.knobs or {}).get("ranks_per_node", 1))
        span = max(0.0, (end - (utc(a.started_at) or now)).total_seconds())
        # The nodes whose failure would be the job's: a shrunk attempt's training group
        # (a standby spare that fails is given back, no incident). Any job's attempt is
        # read here: one whose plan does not parse counts the size it was placed for,
        # rather than stopping this job's round.
        try:
            nodes = attempt_shape(a).training_nodes
        except records.StoredRecordError:
            nodes = a.num_nodes
        hours[k] = hours.get(k, 0.0) + span / 3600 * nodes * per_node
    # Each failure counts against the placement of the attempt the read model blames,
    # the one the fleet page places it on.
    for r in failures:
        k = keys.get((r.event.job_id, r.failed.number)) if r.failed is not None else None
        if k is not None:
            fails[k] = fails.get(k, 0) + 1
    import statistics

    return IntervalFacts(
        step_times=step_times,
        saves=saves,
        current_every=current,
        exposures=[Exposure(k, h, fails.get(k, 0)) for k, h in hours.items()],
        restart_seconds=statistics.median(mttrs) if mttrs else 600.0,
    )
