"""Goodput from the store: one job's rows, turned into the pure accounting's input.

``job_goodput(session, job_id)`` reads what the reconciler wrote (its incidents
through the one read model of incidents, ``store.incidents.incident_records``, that
the API's incident list and the dashboard are built from too) and asks
:func:`orchestrator.domain.goodput.account_goodput` for the split. The split is
Meta's *effective training time* (Llama 3 report): the share of elapsed time spent
on useful training. Every second of the job's wall time is exactly one of

* **productive**: training whose result was kept;
* **failure**: an incident's restart protocol, detect to validated relaunch (the
  union of incident spans, so overlapping incidents count once);
* **lost work**: steps that had trained and were redone after the resume
  (``steps_lost x step time``);
* **checkpoint**: what saves blocked training (0 until ranks report blocking time);
* **idle**: no attempt was up and no incident was running: queued before the first
  launch, or waiting between attempts outside any protocol step.

Where each figure comes from:

* wall time: the job's submission to its terminal transition, or ``now``;
* an **incident** is a record of the read model that has ``protocol_steps`` rows (the
  reconciler records DETECT first); its steps give the MTTR breakdown. An unfinished
  step of a live job runs until ``now``;
* the attempt that **failed** is the read model's: ``details.attempt`` (else the one
  started last before the event); the attempt that **recovers** is the one whose
  ``incident_id`` names the incident (the first with a resume step);
* **steps lost** = the highest step any rank of the failed attempt reported (at
  detection, ``details.last_step``, or later, in its last heartbeats in
  ``nodes.progress``) minus the recovering attempt's ``resume_step``. Never below 0:
  an emergency save can land after the last heartbeat. Unknown (``None``) until the
  recovering attempt has a resume step;
* a script that sends **no progress reports** (no rank of the failed attempt reported
  a step) has no steps to count: when the recovering attempt starts from scratch (no
  confirmed checkpoint and no ``checkpoint.own`` in the spec), the work thrown away is
  the failed attempt's training time, from its nodes being up (or the end of the
  incident it recovered from, whichever is later) to the detection. With
  ``checkpoint.own`` the script resumes from its own snapshot, which the service
  cannot see: lost work is unknown (``steps_lost`` None), never 0 said as a fact;
* **step time**: per attempt, the slowest rank's ``step_time`` in its nodes' last
  heartbeat (synchronous training goes at the slowest rank's pace); the job's is the
  mean over attempts weighted by how long each ran;
* **dollars**: an attempt costs its node-hours x ``price_per_node_hour`` from its
  start to its end (a shrunk attempt's spares only while held, below); an incident
  costs (MTTR + lost work) at the price of the attempt that failed, as
  all of its nodes are paid for while nothing useful happens. ``JobRun`` holds one
  price, but a replacement may run on another plan, so dollars are priced here per
  attempt and the pure accounting only splits time.

Elastic runs (a shrunk attempt, ``store.shape``): each attempt is a **phase** with
the nodes that trained in it (``training_nodes``; a shrunk one is placed for the full
size, ``num_nodes``), so

* **node-hours** of an attempt count its training nodes over its wall time (started
  to ended, as dollars do); a shrunk
  attempt's standby spares bill separately (``spare_node_hours``): from the launch
  request (they bill while they boot) until they were given back or the attempt ended
  (the grow ends it: from then on they are training nodes of the next); a standby
  launch the launcher refused bills nothing. Dollars are both at the node price; an
  incident of a shrunk attempt is priced at the nodes held while it ran;
* a phase's **training time** runs from its nodes being up (not before the incident
  it recovers from ended) to its end or the detection of the incident that ended it;
  the job's **time spent shrunk** is the union of the training time of its phases
  that trained on fewer nodes than the spec's ``num_nodes``;
* **throughput** (steps per second) of a phase is the median over ranks of each
  rank's steps over time in the run's series (``progress_samples``: first to last
  sample of the attempt); without samples, one over the phase's step time (the
  slowest rank's ``step_time`` in its last heartbeats); else unknown. A phase says
  which (``throughput_source``);
* an ``elastic_grow`` incident is a **planned reshape**, not a failure: its pause is
  still restart-protocol time (``failure_seconds``: the ranks save and restart),
  and ``reshape_seconds`` says how much of it was planned.

Read-only: nothing here writes.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from orchestrator.domain.failures import FailureClass
from orchestrator.domain.goodput import (
    GoodputReport,
    Incident,
    IncidentCost,
    JobRun,
    StepTiming,
    account_goodput,
)
from orchestrator.domain.protocol import ORDER, ProtocolStep, StepOutcome
from orchestrator.domain.spec import JobSpec
from orchestrator.domain.status import JobStatus
from orchestrator.store import repo
from orchestrator.store.incidents import IncidentRecord, incident_records, is_planned, rank_values
from orchestrator.store.models import Attempt, FailureEvent, Node, ProgressSample
from orchestrator.store.models import ProtocolStep as ProtocolStepRow
from orchestrator.store.shape import AttemptShape, attempt_shape, spare_releases

log = logging.getLogger(__name__)


class InconsistentHistory(ValueError):
    """The stored history cannot be accounted (e.g. lost work longer than the job)."""


def _utc(d: datetime) -> datetime:
    # SQLite hands back naive datetimes; everything stored is UTC.
    return d if d.tzinfo else d.replace(tzinfo=UTC)


@dataclass(frozen=True)
class StepReport:
    step: str
    started_at: datetime
    finished_at: datetime | None
    """None while the step runs."""
    seconds: float
    outcome: str | None
    detail: str | None


@dataclass(frozen=True)
class AttemptReport:
    number: int
    cloud: str
    region: str
    instance_type: str
    accelerator: str | None
    num_nodes: int
    spot: bool
    price_per_node_hour: float | None
    started_at: datetime
    ended_at: datetime | None
    end_reason: str | None
    state: str
    resume_step: int | None
    validated_step: int | None
    incident_id: int | None
    step_seconds: float | None
    """Slowest rank's step time in the last heartbeat of this attempt's nodes."""
    usd: float | None
    """(Node-hours + spare node-hours) x price; None when the price is unknown."""
    training_nodes: int = 0
    """The nodes whose ranks trained (a shrunk attempt's group; else ``num_nodes``)."""
    shrunk: bool = False
    """Placed for ``num_nodes`` but trained on ``training_nodes`` beside its spares."""
    spare_nodes: int = 0
    """Standby spares asked for beside the group (0 unless shrunk)."""
    spare_released: str | None = None
    """Why the spares were given back (None: they were not, or the group grew)."""
    wall_seconds: float = 0.0
    """Started to ended (or the report's end): what its nodes are billed for."""
    training_seconds: float = 0.0
    """Nodes up (after the incident it recovers from) to its end or next incident."""
    node_hours: float = 0.0
    """Training nodes x wall time."""
    spare_node_hours: float = 0.0
    """Spares x the time they were held (launch request to release or attempt end)."""
    steps_per_second: float | None = None
    """Throughput of the phase (``throughput_source`` says from what); None: unknown."""
    throughput_source: str | None = None
    """``progress_samples`` (the run's series) or ``step_time`` (1 / step_seconds)."""


@dataclass(frozen=True)
class IncidentReport:
    id: int
    failure_class: str
    kind: str
    """The cause's kind (preemption_notice, rank_exit, node_lost, ...)."""
    occurred_at: datetime
    node_id: str | None
    message: str | None
    failed_attempt: int | None
    recovered_by: int | None
    cloud: str | None
    region: str | None
    instance_type: str | None
    last_step: int | None
    resume_step: int | None
    steps_lost: int | None
    ongoing: bool
    """The job is live and the protocol has not validated a relaunch yet."""
    started_at: datetime
    mttr_seconds: float
    steps: tuple[StepReport, ...]
    step_seconds: dict[str, float]
    """Seconds per protocol step, in protocol order (a step run twice is summed)."""
    lost_work_seconds: float
    usd: float | None
    planned: bool = False
    """A planned reshape (``elastic_grow``), not a failure."""


@dataclass(frozen=True)
class JobGoodput:
    job_id: str
    name: str
    status: str
    restart_count: int
    started_at: datetime
    ended_at: datetime
    """The terminal transition, or the ``now`` the report was made at."""
    live: bool
    wall_seconds: float
    productive_seconds: float
    idle_seconds: float
    failure_seconds: float
    lost_work_seconds: float
    checkpoint_seconds: float
    step_seconds: float | None
    total_usd: float | None
    lost_usd: float | None
    attempts: tuple[AttemptReport, ...] = ()
    incidents: tuple[IncidentReport, ...] = field(default=())
    shrunk_seconds: float = 0.0
    """Training time of phases on fewer nodes than the spec's ``num_nodes``."""
    reshape_seconds: float = 0.0
    """The part of ``failure_seconds`` spent in planned reshapes (grows)."""
    node_hours: float = 0.0
    """Every phase's training node-hours."""
    spare_node_hours: float = 0.0
    """Every shrunk phase's standby spares' node-hours."""

    @property
    def effective_training_fraction(self) -> float:
        """Meta's effective training time: productive / wall."""
        return self.productive_seconds / self.wall_seconds if self.wall_seconds else 1.0


@dataclass(frozen=True)
class _Clock:
    """The report's time axis: seconds since submission, clamped into the wall span."""

    start: datetime
    end: datetime
    """The terminal transition, or the ``now`` the report is made at."""
    live: bool

    @property
    def wall(self) -> float:
        return (self.end - self.start).total_seconds()

    def t(self, d: datetime | None) -> float:
        """Seconds since submission, clamped into the wall span (None = the span's end)."""
        if d is None:
            return self.wall
        return min(max((_utc(d) - self.start).total_seconds(), 0.0), self.wall)


@dataclass(frozen=True)
class _Attempts:
    """A job's attempts in number order, with what their nodes say of each."""

    rows: list[Attempt]
    shapes: dict[int, AttemptShape]
    step_seconds: dict[int, float | None]
    """Slowest rank's ``step_time`` in the last heartbeats of each attempt's nodes."""

    @property
    def latest(self) -> Attempt | None:
        return self.rows[-1] if self.rows else None


@dataclass(frozen=True)
class _Accounted:
    """One incident as this report counts it: the pure accounting's ``Incident`` and
    what the read model (:class:`IncidentRecord`) adds to it."""

    record: IncidentRecord
    incident: Incident
    recovering: Attempt | None
    """The attempt that resumed from it (else the first that recovers from it)."""
    resume_step: int | None
    steps_lost: int | None
    ongoing: bool
    steps: tuple[StepReport, ...]


def _sum_or_none(xs: Sequence[float | None]) -> float | None:
    total = 0.0
    for x in xs:
        if x is None:
            return None
        total += x
    return total


def _union_seconds(spans: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _held_nodes(shape: AttemptShape, at: datetime) -> int:
    """The nodes of an attempt paid for at ``at``: its training group, and a shrunk
    one's spares while they were held (launched, not given back yet)."""
    sp = shape.spare
    if sp is None:
        return shape.training_nodes
    held = sp.launched and (sp.released is None or sp.released_at is None or sp.released_at > at)
    held = held and (sp.asked_at is None or sp.asked_at <= at)
    return shape.training_nodes + (sp.count if held else 0)


def _spare_span(
    a: Attempt,
    shape: AttemptShape,
    span: tuple[float, float],
    t: Callable[[datetime | None], float],
) -> float:
    """Seconds a shrunk attempt's spares were held: from the launch request (a VM bills
    while it boots) to their release, else the attempt's end (a grow ends it: the spares
    train in the next attempt). A refused standby launch held nothing."""
    sp = shape.spare
    if sp is None:
        return 0.0
    if not sp.launched:
        return sp.held_before_s
    asked = _as_str((a.handle or {}).get("requested_at"))
    if sp.asked_at is not None:  # a later try's launch
        start = t(sp.asked_at)
    else:
        start = t(datetime.fromisoformat(asked)) if asked else span[0]
    end = span[1] if sp.released is None or sp.released_at is None else t(sp.released_at)
    return sp.held_before_s + max(0.0, min(end, span[1]) - start)


def sampled_steps_per_second(session: Session, job_id: str) -> dict[int, float]:
    """attempt -> steps per second in the run's series: each rank's steps from its
    first to its last sample of the attempt over the time between, the median over
    ranks (synchronous ranks step together; the median drops a rank sampled late).
    One row per (attempt, rank) comes back, whatever the number of samples."""
    rows = session.execute(
        select(
            ProgressSample.attempt,
            func.min(ProgressSample.at),
            func.max(ProgressSample.at),
            func.min(ProgressSample.step),
            func.max(ProgressSample.step),
        )
        .where(ProgressSample.job_id == job_id)
        .group_by(ProgressSample.attempt, ProgressSample.rank)
    )
    per_rank: dict[int, list[float]] = defaultdict(list)
    for attempt, first, last, low, high in rows:
        if first is None or last is None:
            continue
        dt = (_utc(last) - _utc(first)).total_seconds()
        if dt > 0 and high >= low:
            per_rank[attempt].append((high - low) / dt)
    return {k: statistics.median(v) for k, v in per_rank.items() if v}


def _training_start(
    a: Attempt, incident_end: dict[int, float], t: Callable[[datetime | None], float]
) -> float:
    """When attempt ``a`` could start training, in the report's seconds: its nodes up
    (the launcher's ``up_at``), and not before the incident it recovers from ended."""
    up = _as_str((a.handle or {}).get("up_at"))
    start = t(datetime.fromisoformat(up)) if up else t(a.started_at)
    if a.incident_id is not None and a.incident_id in incident_end:
        start = max(start, incident_end[a.incident_id])
    return start


def _as_str(x: object) -> str | None:
    return x if isinstance(x, str) and x else None


def job_wall_span(session: Session, job_id: str, now: datetime) -> tuple[datetime, datetime, bool]:
    """(submitted, ended or now, live) for one job."""
    job = repo.get_job(session, job_id)
    live = not JobStatus(job.status).is_terminal()
    start = _utc(job.created_at)
    end = now if live else _utc(job.updated_at)
    return start, max(start, end), live


def _read_attempts(session: Session, job_id: str) -> _Attempts:
    attempts = list(
        session.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number))
    )
    nodes = list(session.scalars(select(Node).where(Node.job_id == job_id)))
    released = spare_releases(session, job_id)
    shapes = {
        a.number: attempt_shape(
            a, [n for n in nodes if n.attempt == a.number], released.get(a.number)
        )
        for a in attempts
    }
    step_times: dict[int, list[float]] = defaultdict(list)
    for n in nodes:
        step_times[n.attempt] += rank_values(n.progress, "step_time")
    slowest = {a.number: max(step_times[a.number], default=None) for a in attempts}
    return _Attempts(attempts, shapes, slowest)


def _job_step_seconds(attempts: _Attempts, clock: _Clock) -> float | None:
    """The mean of the attempts' step times, weighted by how long each ran."""
    weighted = [
        (step_s, clock.t(a.ended_at) - clock.t(a.started_at))
        for a in attempts.rows
        if (step_s := attempts.step_seconds[a.number]) is not None
    ]
    if not weighted:
        return None
    up = sum(w for _, w in weighted)
    if up > 0:
        return sum(s * w for s, w in weighted) / up
    return sum(s for s, _ in weighted) / len(weighted)


def _step_timings(
    job_id: str, record: IncidentRecord, rows: Sequence[ProtocolStepRow], clock: _Clock
) -> tuple[list[StepTiming], list[StepReport]]:
    """An incident's known protocol steps on the report's axis; an open step of a live
    job runs until ``now``."""
    timings, reports = [], []
    for r in rows:
        try:
            step = ProtocolStep(r.step)
        except ValueError:
            log.warning(
                "job %s incident %s: unknown protocol step %r", job_id, record.event.id, r.step
            )
            continue
        start, end = clock.t(r.started_at), clock.t(r.finished_at)
        timings.append(StepTiming(step, start, max(start, end)))
        reports.append(
            StepReport(
                r.step,
                _utc(r.started_at),
                _utc(r.finished_at) if r.finished_at else None,
                max(start, end) - start,
                r.outcome,
                r.detail,
            )
        )
    return timings, reports


def _failure_class(event: FailureEvent) -> FailureClass:
    try:
        return FailureClass(event.failure_class or "unknown")
    except ValueError:
        return FailureClass.UNKNOWN


def _account_incident(
    record: IncidentRecord,
    rows: Sequence[ProtocolStepRow],
    timings: list[StepTiming],
    reports: list[StepReport],
    clock: _Clock,
    *,
    own_checkpoint: bool,
    incident_end: dict[int, float],
) -> _Accounted:
    """Steps lost and lost work of one incident (module docstring: steps lost, a script
    that sends no progress reports)."""
    failed, recovering = record.failed, record.recovering
    resumer = next((a for a in recovering if a.resume_step is not None), None)
    last_step = record.last_step
    resume_step = resumer.resume_step if resumer else None
    steps_lost = (
        max(0, last_step - resume_step)
        if last_step is not None and resume_step is not None
        else None
    )
    validated = any(
        r.step == ProtocolStep.VALIDATE
        and r.finished_at is not None
        and r.outcome == StepOutcome.OK
        for r in rows
    )
    unfinished = any(r.finished_at is None for r in rows)
    lost_s = None
    if last_step is None and failed is not None and resumer is not None:
        if resume_step == 0 and not own_checkpoint:
            # No step reports, restarted from scratch: all it trained is gone.
            detected = min(x.started for x in timings)
            lost_s = max(0.0, detected - _training_start(failed, incident_end, clock.t))
        else:
            resume_step = steps_lost = None  # resumed from what it saved: unknown
    return _Accounted(
        record,
        Incident(_failure_class(record.event), tuple(timings), steps_lost or 0, lost_s),
        resumer or (recovering[0] if recovering else None),
        resume_step,
        steps_lost,
        clock.live and (unfinished or not validated),
        tuple(reports),
    )


def _account_incidents(
    job_id: str, records: Sequence[IncidentRecord], clock: _Clock, *, own_checkpoint: bool
) -> tuple[list[_Accounted], dict[int, float]]:
    """The incidents that have known protocol steps, in the order they started, and
    when each ended (incident id -> the report's seconds)."""
    in_order = [
        (r, sorted(r.steps, key=lambda row: (row.started_at, row.id)))
        for r in records
        if r.has_protocol_steps
    ]
    in_order.sort(key=lambda pair: (pair[1][0].started_at, pair[0].event.id))
    incident_end: dict[int, float] = {}
    accounted = []
    for record, rows in in_order:
        timings, reports = _step_timings(job_id, record, rows, clock)
        if not timings:
            continue
        # Before the lost work: a failed attempt trains only after the incident it
        # recovered from, which started earlier and so is in here already.
        incident_end[record.event.id] = max(x.ended for x in timings)
        accounted.append(
            _account_incident(
                record,
                rows,
                timings,
                reports,
                clock,
                own_checkpoint=own_checkpoint,
                incident_end=incident_end,
            )
        )
    return accounted, incident_end


def _split_time(
    job_id: str,
    clock: _Clock,
    attempts: _Attempts,
    job_step_s: float | None,
    accounted: Sequence[_Accounted],
) -> tuple[GoodputReport, float, float]:
    """(the pure accounting's split, idle seconds, productive seconds)."""
    incidents = tuple(a.incident for a in accounted)
    latest = attempts.latest
    try:
        report = account_goodput(
            JobRun(
                started=0.0,
                ended=clock.wall,
                gpus=max(1, latest.num_nodes) if latest else 1,
                step_seconds=job_step_s or 0.0,
                # Dollars are priced per attempt below (module docstring): one price
                # here would misprice a replacement on another plan.
                price_per_gpu_hour=0.0,
                incidents=incidents,
            )
        )
    except ValueError as e:
        raise InconsistentHistory(f"job {job_id}: {e}") from None
    attempt_spans = [(clock.t(a.started_at), clock.t(a.ended_at)) for a in attempts.rows]
    incident_spans = [(i.started, i.ended) for i in incidents]
    idle = clock.wall - _union_seconds([*attempt_spans, *incident_spans])
    productive = report.productive_seconds - idle
    if productive < 0:
        # Lost work priced at a mean step time can exceed the up time it was
        # measured in; never report negative training.
        log.warning("job %s: lost work exceeds up time by %.0f s", job_id, -productive)
        productive = 0.0
    return report, idle, productive


def _stopped_training(accounted: Sequence[_Accounted], wall: float) -> dict[int, float]:
    """attempt -> when it stopped training: the detection of the incident that ended it."""
    stopped: dict[int, float] = {}
    for acc in accounted:
        if acc.record.failed is not None:
            ended = acc.record.failed.number
            stopped[ended] = min(stopped.get(ended, wall), acc.incident.started)
    return stopped


def _attempt_report(
    a: Attempt,
    attempts: _Attempts,
    clock: _Clock,
    training: tuple[float, float],
    sampled: float | None,
) -> AttemptReport:
    """One attempt as a phase: its nodes, node-hours, dollars and throughput;
    ``training``: when it trained, on the report's axis."""
    shape = attempts.shapes[a.number]
    a0, a1 = clock.t(a.started_at), clock.t(a.ended_at)
    node_h = shape.training_nodes * (a1 - a0) / 3600.0
    spares = shape.spare.count if shape.spare else 0
    spare_h = spares * _spare_span(a, shape, (a0, a1), clock.t) / 3600.0
    step_s = attempts.step_seconds[a.number]
    steps_s, source = sampled, "progress_samples" if sampled is not None else None
    if steps_s is None and step_s:
        steps_s, source = 1.0 / step_s, "step_time"
    price = a.price_per_node_hour
    return AttemptReport(
        a.number,
        a.cloud,
        a.region,
        a.instance_type,
        a.accelerator,
        a.num_nodes,
        a.spot,
        a.price_per_node_hour,
        _utc(a.started_at),
        _utc(a.ended_at) if a.ended_at else None,
        a.end_reason,
        a.state,
        a.resume_step,
        a.validated_step,
        a.incident_id,
        step_s,
        (node_h + spare_h) * price if price is not None else None,
        training_nodes=shape.training_nodes,
        shrunk=shape.shrunk,
        spare_nodes=spares,
        spare_released=shape.spare.released if shape.spare else None,
        wall_seconds=a1 - a0,
        training_seconds=max(0.0, training[1] - training[0]),
        node_hours=node_h,
        spare_node_hours=spare_h,
        steps_per_second=steps_s,
        throughput_source=source,
    )


def _phases(
    session: Session,
    job_id: str,
    attempts: _Attempts,
    clock: _Clock,
    accounted: Sequence[_Accounted],
    incident_end: dict[int, float],
    full_size: int,
) -> tuple[list[AttemptReport], float]:
    """Every attempt's report, and the job's time spent shrunk (the union of the
    training time of phases on fewer than ``full_size`` nodes)."""
    stopped = _stopped_training(accounted, clock.wall)
    sampled = sampled_steps_per_second(session, job_id)
    reports, shrunk_spans = [], []
    for a in attempts.rows:
        t0 = _training_start(a, incident_end, clock.t)
        a1 = clock.t(a.ended_at)
        t1 = min(a1, stopped.get(a.number, a1))
        if attempts.shapes[a.number].training_nodes < full_size and t1 > t0:
            shrunk_spans.append((t0, t1))
        reports.append(_attempt_report(a, attempts, clock, (t0, t1), sampled.get(a.number)))
    return reports, _union_seconds(shrunk_spans)


def _incident_report(
    acc: _Accounted, cost: IncidentCost, attempts: _Attempts, clock: _Clock
) -> IncidentReport:
    """One incident with its MTTR by step and its price: (MTTR + lost work) at the
    nodes the failed attempt held while it ran."""
    ev, failed, cause = acc.record.event, acc.record.failed, acc.record.cause
    rate = (
        _held_nodes(attempts.shapes[failed.number], _utc(ev.occurred_at))
        * failed.price_per_node_hour
        / 3600.0
        if failed is not None and failed.price_per_node_hour is not None
        else None
    )
    return IncidentReport(
        id=ev.id,
        failure_class=ev.failure_class or FailureClass.UNKNOWN.value,
        kind=cause.kind if cause is not None else ev.kind,
        occurred_at=_utc(ev.occurred_at),
        node_id=ev.node_id,
        message=ev.message,
        failed_attempt=failed.number if failed else None,
        recovered_by=acc.recovering.number if acc.recovering else None,
        cloud=failed.cloud if failed else None,
        region=failed.region if failed else None,
        instance_type=failed.instance_type if failed else None,
        last_step=acc.record.last_step,
        resume_step=acc.resume_step,
        steps_lost=acc.steps_lost,
        ongoing=acc.ongoing,
        started_at=clock.start + timedelta(seconds=acc.incident.started),
        mttr_seconds=cost.mttr_seconds,
        step_seconds={str(s): cost.step_seconds[s] for s in ORDER if s in cost.step_seconds},
        steps=acc.steps,
        lost_work_seconds=cost.lost_work_seconds,
        usd=(cost.mttr_seconds + cost.lost_work_seconds) * rate if rate is not None else None,
        planned=is_planned(ev.failure_class),
    )


def job_goodput(session: Session, job_id: str, *, now: datetime | None = None) -> JobGoodput:
    """The goodput report of one job; raises ``repo.NotFound`` for an unknown id."""
    now = _utc(now or repo.utcnow())
    job = repo.get_job(session, job_id)
    clock = _Clock(*job_wall_span(session, job_id, now))
    attempts = _read_attempts(session, job_id)
    job_step_s = _job_step_seconds(attempts, clock)
    # A plain script resumes from its own snapshot only when the spec says where it is.
    spec = JobSpec.model_validate(job.spec)
    accounted, incident_end = _account_incidents(
        job_id,
        incident_records(session, job_id),
        clock,
        own_checkpoint=spec.checkpoint.own is not None,
    )
    report, idle, productive = _split_time(job_id, clock, attempts, job_step_s, accounted)
    attempt_reports, shrunk_s = _phases(
        session, job_id, attempts, clock, accounted, incident_end, spec.num_nodes
    )
    incident_reports = [
        _incident_report(acc, cost, attempts, clock)
        for acc, cost in zip(accounted, report.incidents, strict=True)
    ]
    reshape_s = _union_seconds(
        (acc.incident.started, acc.incident.ended)
        for acc in accounted
        if is_planned(acc.record.event.failure_class)
    )
    return JobGoodput(
        job_id=job.id,
        name=job.name,
        status=job.status,
        restart_count=job.restart_count,
        started_at=clock.start,
        ended_at=clock.end,
        live=clock.live,
        wall_seconds=clock.wall,
        productive_seconds=productive,
        idle_seconds=idle,
        failure_seconds=report.failure_seconds,
        lost_work_seconds=report.lost_work_seconds,
        checkpoint_seconds=report.checkpoint_seconds,
        step_seconds=job_step_s,
        # A sum with an unpriced part would understate: say "unknown" instead.
        total_usd=_sum_or_none([a.usd for a in attempt_reports]),
        lost_usd=_sum_or_none([i.usd for i in incident_reports]),
        attempts=tuple(attempt_reports),
        incidents=tuple(incident_reports),
        shrunk_seconds=shrunk_s,
        reshape_seconds=reshape_s,
        node_hours=sum(a.node_hours for a in attempt_reports),
        spare_node_hours=sum(a.spare_node_hours for a in attempt_reports),
    )
