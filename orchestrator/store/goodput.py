"""Goodput from the store: one job's rows, turned into the pure accounting's input.

``job_goodput(session, job_id)`` reads what the reconciler wrote and asks
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
* an **incident** is a failure event that has ``protocol_steps`` rows (the reconciler
  records DETECT first); its steps give the MTTR breakdown. An unfinished step of a
  live job runs until ``now``;
* the attempt that **failed** is ``details.attempt`` (else the one started last
  before the event); the attempt that **recovers** is the one whose ``incident_id``
  names the incident;
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

from orchestrator.domain.failures import PLANNED, FailureClass
from orchestrator.domain.goodput import Incident, JobRun, StepTiming, account_goodput
from orchestrator.domain.protocol import ORDER, ProtocolStep, StepOutcome
from orchestrator.domain.spec import JobSpec
from orchestrator.domain.status import JobStatus
from orchestrator.store import repo
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
class _Gathered:
    """What the store knows of one incident beyond the pure ``Incident``."""

    event: FailureEvent
    failed: Attempt | None
    recovering: Attempt | None
    last_step: int | None
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


def _as_int(x: object) -> int | None:
    # JSON from agents: a bool is an int in Python and never a step.
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def rank_values(progress: object, key: str) -> list[float]:
    """One number per rank from a node's last heartbeat (``nodes.progress``): its
    ``key`` (``step``, ``step_time``...), skipping ranks that have not reported it."""
    if not isinstance(progress, dict):
        return []
    ranks = progress.get("ranks")
    if not isinstance(ranks, list):
        return []
    out = []
    for r in ranks:
        v = r.get(key) if isinstance(r, dict) else None
        if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0:
            out.append(float(v))
    return out


def failed_attempt_last_step(incident_details: object, rank_steps: list[float]) -> int | None:
    """The last step the failed attempt trained: the highest any rank reported, at
    detection (the incident's ``last_step``) or later in its nodes' last heartbeats
    (``rank_steps``): ranks may finish a step or two after detection, since a stop
    takes effect at the next step boundary."""
    details = incident_details if isinstance(incident_details, dict) else {}
    seen = [_as_int(details.get("last_step"))]
    if rank_steps:
        seen.append(int(max(rank_steps)))
    return max((x for x in seen if x is not None), default=None)


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
    if sp is None or not sp.launched:
        return 0.0
    asked = _as_str((a.handle or {}).get("requested_at"))
    start = t(datetime.fromisoformat(asked)) if asked else span[0]
    end = span[1] if sp.released is None or sp.released_at is None else t(sp.released_at)
    return max(0.0, min(end, span[1]) - start)


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


def is_planned(failure_class: str | None) -> bool:
    """A planned reshape (an elastic grow), which no count of failures includes."""
    return failure_class in {str(c) for c in PLANNED}


def _cause_id(event: FailureEvent) -> int | None:
    return _as_int((event.details or {}).get("cause_event_id"))


def _placement(
    attempts: Sequence[Attempt], event: FailureEvent
) -> tuple[Attempt | None, list[Attempt]]:
    """(the attempt that failed, the attempts that recover from ``event``).

    The reconciler names the failed attempt in ``details.attempt``; without it, the
    failed one is the last started before the event and before any attempt that
    recovers from it."""
    recovering = [a for a in attempts if a.incident_id == event.id]
    named = _as_int((event.details or {}).get("attempt"))
    failed = next((a for a in attempts if a.number == named), None)
    if failed is None:
        occurred = _utc(event.occurred_at)
        before = [
            a
            for a in attempts
            if _utc(a.started_at) <= occurred
            and (not recovering or a.number < recovering[0].number)
        ]
        failed = before[-1] if before else None
    return failed, recovering


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


def job_goodput(session: Session, job_id: str, *, now: datetime | None = None) -> JobGoodput:
    """The goodput report of one job; raises ``repo.NotFound`` for an unknown id."""
    now = _utc(now or repo.utcnow())
    job = repo.get_job(session, job_id)
    wall_start, wall_end, live = job_wall_span(session, job_id, now)
    wall = (wall_end - wall_start).total_seconds()

    def t(d: datetime | None) -> float:
        """Seconds since submission, clamped into the wall span (None = the span's end)."""
        if d is None:
            return wall
        return min(max((_utc(d) - wall_start).total_seconds(), 0.0), wall)

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
    step_rows = list(
        session.scalars(
            select(ProtocolStepRow)
            .where(ProtocolStepRow.job_id == job_id)
            .order_by(ProtocolStepRow.started_at, ProtocolStepRow.id)
        )
    )

    # Per attempt: measured step time (slowest rank) and last reported step.
    step_times: dict[int, list[float]] = defaultdict(list)
    last_steps: dict[int, list[float]] = defaultdict(list)
    for n in nodes:
        step_times[n.attempt] += rank_values(n.progress, "step_time")
        last_steps[n.attempt] += rank_values(n.progress, "step")
    attempt_step_s = {a.number: max(step_times[a.number], default=None) for a in attempts}
    weighted = [
        (step_s, t(a.ended_at) - t(a.started_at))
        for a in attempts
        if (step_s := attempt_step_s[a.number]) is not None
    ]
    up = sum(w for _, w in weighted)
    job_step_s: float | None = None
    if weighted:
        job_step_s = (
            sum(s * w for s, w in weighted) / up
            if up > 0
            else sum(s for s, _ in weighted) / len(weighted)
        )

    by_incident: dict[int, list[ProtocolStepRow]] = defaultdict(list)
    for r in step_rows:
        by_incident[r.incident_id].append(r)
    events = {
        e.id: e
        for e in session.scalars(
            select(FailureEvent).where(FailureEvent.id.in_(list(by_incident) or [-1]))
        )
    }
    # The reconciler's incident event names its cause (a notice, a rank exit, ...).
    cause_ids = [c for e in events.values() if (c := _cause_id(e)) is not None]
    causes = {
        e.id: e
        for e in session.scalars(select(FailureEvent).where(FailureEvent.id.in_(cause_ids or [-1])))
    }

    # A plain script resumes from its own snapshot only when the spec says where it is.
    spec = JobSpec.model_validate(job.spec)
    own_checkpoint = spec.checkpoint.own is not None
    incident_end: dict[int, float] = {}
    incidents: list[Incident] = []
    gathered: list[_Gathered] = []
    for incident_id in sorted(by_incident, key=lambda i: (by_incident[i][0].started_at, i)):
        ev = events[incident_id]
        rows = by_incident[incident_id]
        timings = []
        reports = []
        for r in rows:
            try:
                step = ProtocolStep(r.step)
            except ValueError:
                log.warning("job %s incident %s: unknown protocol step %r", job_id, ev.id, r.step)
                continue
            start, end = t(r.started_at), t(r.finished_at)
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
        if not timings:
            continue
        failed, recovering = _placement(attempts, ev)
        resumer = next((a for a in recovering if a.resume_step is not None), None)
        last_step = failed_attempt_last_step(
            ev.details, last_steps[failed.number] if failed is not None else []
        )
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
        try:
            cls = FailureClass(ev.failure_class or "unknown")
        except ValueError:
            cls = FailureClass.UNKNOWN
        detected = min(x.started for x in timings)
        incident_end[ev.id] = max(x.ended for x in timings)
        lost_s = None
        if last_step is None and failed is not None and resumer is not None:
            if resume_step == 0 and not own_checkpoint:
                # No step reports, restarted from scratch: all it trained is gone.
                lost_s = max(0.0, detected - _training_start(failed, incident_end, t))
            else:
                resume_step = steps_lost = None  # resumed from what it saved: unknown
        incidents.append(Incident(cls, tuple(timings), steps_lost or 0, lost_s))
        gathered.append(
            _Gathered(
                ev,
                failed,
                resumer or (recovering[0] if recovering else None),
                last_step,
                resume_step,
                steps_lost,
                live and (unfinished or not validated),
                tuple(reports),
            )
        )

    latest = attempts[-1] if attempts else None
    try:
        report = account_goodput(
            JobRun(
                started=0.0,
                ended=wall,
                gpus=max(1, latest.num_nodes) if latest else 1,
                step_seconds=job_step_s or 0.0,
                # Dollars are priced per attempt below (module docstring): one price
                # here would misprice a replacement on another plan.
                price_per_gpu_hour=0.0,
                incidents=tuple(incidents),
            )
        )
    except ValueError as e:
        raise InconsistentHistory(f"job {job_id}: {e}") from None

    attempt_spans = [(t(a.started_at), t(a.ended_at)) for a in attempts]
    incident_spans = [(i.started, i.ended) for i in incidents]
    idle = wall - _union_seconds([*attempt_spans, *incident_spans])
    productive = report.productive_seconds - idle
    if productive < 0:
        # Lost work priced at a mean step time can exceed the up time it was
        # measured in; never report negative training.
        log.warning("job %s: lost work exceeds up time by %.0f s", job_id, -productive)
        productive = 0.0

    # When each attempt stopped training: the detection of the incident that ended it.
    stopped: dict[int, float] = {}
    for inc, g in zip(incidents, gathered, strict=True):
        if g.failed is not None:
            ended = g.failed.number
            stopped[ended] = min(stopped.get(ended, wall), inc.started)
    sampled = sampled_steps_per_second(session, job_id)
    attempt_reports = []
    shrunk_spans = []
    for a, (a0, a1) in zip(attempts, attempt_spans, strict=True):
        shape = shapes[a.number]
        t0 = _training_start(a, incident_end, t)
        t1 = min(a1, stopped.get(a.number, a1))
        training_s = max(0.0, t1 - t0)
        if shape.training_nodes < spec.num_nodes and t1 > t0:
            shrunk_spans.append((t0, t1))
        node_h = shape.training_nodes * (a1 - a0) / 3600.0
        spare_h = (
            (shape.spare.count if shape.spare else 0) * _spare_span(a, shape, (a0, a1), t) / 3600.0
        )
        steps_s = sampled.get(a.number)
        source: str | None = "progress_samples" if steps_s is not None else None
        if steps_s is None and (step_s := attempt_step_s[a.number]):
            steps_s, source = 1.0 / step_s, "step_time"
        price = a.price_per_node_hour
        attempt_reports.append(
            AttemptReport(
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
                attempt_step_s[a.number],
                (node_h + spare_h) * price if price is not None else None,
                training_nodes=shape.training_nodes,
                shrunk=shape.shrunk,
                spare_nodes=shape.spare.count if shape.spare else 0,
                spare_released=shape.spare.released if shape.spare else None,
                wall_seconds=a1 - a0,
                training_seconds=training_s,
                node_hours=node_h,
                spare_node_hours=spare_h,
                steps_per_second=steps_s,
                throughput_source=source,
            )
        )

    incident_reports = []
    for inc, cost, g in zip(incidents, report.incidents, gathered, strict=True):
        ev, failed = g.event, g.failed
        rate = (
            _held_nodes(shapes[failed.number], _utc(ev.occurred_at))
            * failed.price_per_node_hour
            / 3600.0
            if failed is not None and failed.price_per_node_hour is not None
            else None
        )
        incident_reports.append(
            IncidentReport(
                id=ev.id,
                failure_class=ev.failure_class or FailureClass.UNKNOWN.value,
                kind=causes[c].kind if (c := _cause_id(ev)) in causes else ev.kind,
                occurred_at=_utc(ev.occurred_at),
                node_id=ev.node_id,
                message=ev.message,
                failed_attempt=failed.number if failed else None,
                recovered_by=g.recovering.number if g.recovering else None,
                cloud=failed.cloud if failed else None,
                region=failed.region if failed else None,
                instance_type=failed.instance_type if failed else None,
                last_step=g.last_step,
                resume_step=g.resume_step,
                steps_lost=g.steps_lost,
                ongoing=g.ongoing,
                started_at=wall_start + timedelta(seconds=inc.started),
                mttr_seconds=cost.mttr_seconds,
                step_seconds={
                    str(s): cost.step_seconds[s] for s in ORDER if s in cost.step_seconds
                },
                steps=g.steps,
                lost_work_seconds=cost.lost_work_seconds,
                usd=(cost.mttr_seconds + cost.lost_work_seconds) * rate
                if rate is not None
                else None,
                planned=is_planned(ev.failure_class),
            )
        )
    reshape_s = _union_seconds(
        (inc.started, inc.ended)
        for inc, g in zip(incidents, gathered, strict=True)
        if is_planned(g.event.failure_class)
    )

    # A sum with an unpriced part would understate: say "unknown" instead.
    total_usd = _sum_or_none([a.usd for a in attempt_reports])
    lost_usd = _sum_or_none([i.usd for i in incident_reports])
    return JobGoodput(
        job_id=job.id,
        name=job.name,
        status=job.status,
        restart_count=job.restart_count,
        started_at=wall_start,
        ended_at=wall_end,
        live=live,
        wall_seconds=wall,
        productive_seconds=productive,
        idle_seconds=idle,
        failure_seconds=report.failure_seconds,
        lost_work_seconds=report.lost_work_seconds,
        checkpoint_seconds=report.checkpoint_seconds,
        step_seconds=job_step_s,
        total_usd=total_usd,
        lost_usd=lost_usd,
        attempts=tuple(attempt_reports),
        incidents=tuple(incident_reports),
        shrunk_seconds=_union_seconds(shrunk_spans),
        reshape_seconds=reshape_s,
        node_hours=sum(a.node_hours for a in attempt_reports),
        spare_node_hours=sum(a.spare_node_hours for a in attempt_reports),
    )


@dataclass(frozen=True)
class FleetIncident:
    """One incident, placed where it happened (the attempt that failed)."""

    job_id: str
    incident_id: int
    occurred_at: datetime
    failure_class: str
    cloud: str | None
    region: str | None
    instance_type: str | None


def fleet_incidents(
    session: Session, *, since: datetime | None = None, job_ids: Sequence[str] | None = None
) -> list[FleetIncident]:
    """Every incident of every job (or of ``job_ids``), oldest first."""
    ids = select(ProtocolStepRow.incident_id).distinct()
    q = select(FailureEvent).where(FailureEvent.id.in_(ids))
    if since is not None:
        q = q.where(FailureEvent.occurred_at >= since)
    if job_ids is not None:
        q = q.where(FailureEvent.job_id.in_(list(job_ids)))
    events = list(session.scalars(q.order_by(FailureEvent.occurred_at, FailureEvent.id)))
    jobs = {e.job_id for e in events}
    attempts: dict[str, list[Attempt]] = defaultdict(list)
    if jobs:
        for a in session.scalars(
            select(Attempt).where(Attempt.job_id.in_(jobs)).order_by(Attempt.number)
        ):
            attempts[a.job_id].append(a)
    out = []
    for e in events:
        failed, _ = _placement(attempts[e.job_id], e)
        out.append(
            FleetIncident(
                e.job_id,
                e.id,
                _utc(e.occurred_at),
                e.failure_class or FailureClass.UNKNOWN.value,
                failed.cloud if failed else None,
                failed.region if failed else None,
                failed.instance_type if failed else None,
            )
        )
    return out
