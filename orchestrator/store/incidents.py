"""The read model of incidents: one row per failed attempt with its protocol steps.

One read of incidents (:func:`incident_records` for a job, :func:`fleet_incident_records`
across jobs, both through one query function) decides, once, which events are
incidents, the order of their protocol steps, the attempt that failed, the ones that
recover and the last step the failed one trained. Every view is built from it: the
API (``/v1/jobs/{id}/incidents``), the CLI and the dashboard's job page read
:func:`incidents`; the dashboard's jobs list counts the records and its fleet page
places them (:func:`fleet_incidents`); the interval advisor counts each failure
against the placement of the attempt blamed, and takes the restart time from
:func:`incident_mttr`; goodput (:mod:`orchestrator.store.goodput`) accounts them.
Two readers that each decided "the failed attempt" for themselves could blame a
different attempt for the same incident: the incident table and the goodput page
would disagree about its lost steps, the fleet page and the advisor about where it
happened.

MTTR, by step: :func:`incident_mttr` here (None until all seven steps finished);
goodput's ``mttr_seconds`` is the pure accounting's over the same step rows, where a
live incident's open step runs until ``now``.

Elastic runs: an ``elastic_grow`` incident is a planned reshape, not a failure
(``planned``: counts of failures and MTBF leave it out), and every incident says how
many nodes trained before and after it (``nodes_before``: the attempt it ended,
``nodes_after``: the one it started, as ``store.shape`` counts them) and whether it
reshaped the group (``reshape``: ``shrink`` when SELECT chose one, ``grow``).

Read-only: nothing here writes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from orchestrator.contract import EventKind
from orchestrator.domain.failures import PLANNED, FailureClass
from orchestrator.domain.protocol import ProtocolStep
from orchestrator.domain.reconcile import LaunchVerb
from orchestrator.store.models import Attempt, FailureEvent, Node
from orchestrator.store.models import ProtocolStep as StepRow
from orchestrator.store.records import selection_from_json
from orchestrator.store.shape import AttemptShape, job_shapes
from orchestrator.store.snapshot import utc

#: The kinds an incident's consequences, evidence and cause are read from.
_REPORTED = (
    EventKind.RANK_EXIT, EventKind.NODE_LOST, EventKind.RANK_HANG, EventKind.ANOMALY,
    EventKind.EVIDENCE, EventKind.HEALTH_CHECK, EventKind.PREEMPTION_NOTICE, EventKind.STUCK,
)  # fmt: skip


def as_int(x: object) -> int | None:
    """An int from JSON (agents write it): a bool is an int in Python and never a step."""
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
    seen = [as_int(details.get("last_step"))]
    if rank_steps:
        seen.append(int(max(rank_steps)))
    return max((x for x in seen if x is not None), default=None)


def is_planned(failure_class: str | None) -> bool:
    """A planned reshape (an elastic grow), which no count of failures includes."""
    return failure_class in {str(c) for c in PLANNED}


def failed_and_recovering(
    attempts: Sequence[Attempt], event: FailureEvent
) -> tuple[Attempt | None, list[Attempt]]:
    """(the attempt that failed, the attempts that recover from ``event``).

    The reconciler names the failed attempt in ``details.attempt``; without it, the
    failed one is the last started before the event and before any attempt that
    recovers from it."""
    recovering = [a for a in attempts if a.incident_id == event.id]
    named = as_int((event.details or {}).get("attempt"))
    failed = next((a for a in attempts if a.number == named), None)
    if failed is None:
        occurred = utc(event.occurred_at)
        before = [
            a
            for a in attempts
            if utc(a.started_at) <= occurred  # type: ignore[operator]
            and (not recovering or a.number < recovering[0].number)
        ]
        failed = before[-1] if before else None
    return failed, recovering


@dataclass(frozen=True)
class IncidentRecord:
    """One incident as the store holds it: what every view of it is built from."""

    event: FailureEvent
    """The reconciler's ``incident`` event: class, node, message, ``details``."""
    steps: tuple[StepRow, ...]
    """Its protocol step rows, in the order they were recorded (a step run twice is
    two rows)."""
    cause: FailureEvent | None
    """The event it names as its cause (``details.cause_event_id``), of any kind."""
    failed: Attempt | None
    """The attempt that failed (:func:`failed_and_recovering`)."""
    recovering: tuple[Attempt, ...]
    """The attempts whose ``incident_id`` names it, by number."""
    last_step: int | None
    """The last step the failed attempt trained (:func:`failed_attempt_last_step`)."""

    @property
    def has_protocol_steps(self) -> bool:
        """The reconciler recorded a protocol step for it (DETECT comes first). Only
        these are counted: by goodput, the fleet page and the jobs list; the incident
        list (:func:`incidents`) shows the others too."""
        return bool(self.steps)


#: Ids per ``IN (...)``: each is a bind parameter, and the backends cap how many one
#: statement may carry (SQLite 32,766, PostgreSQL 65,535); the fleet's causes can be more.
_IN_CHUNK = 1000


def incident_records(s: Session, job_id: str) -> list[IncidentRecord]:
    """Every incident of a job, oldest (lowest id) first, in five queries."""
    return _read_records(s, FailureEvent.job_id == job_id)


def fleet_incident_records(
    s: Session, *, since: datetime | None = None, job_ids: Sequence[str] | None = None
) -> list[IncidentRecord]:
    """Every incident of every job (or of ``job_ids``) that occurred at ``since`` or
    later, oldest (lowest id) first, in five queries whatever the number of jobs."""
    where: list[ColumnElement[bool]] = []
    if since is not None:
        where.append(FailureEvent.occurred_at >= since)
    if job_ids is not None:
        where.append(FailureEvent.job_id.in_(list(job_ids)))
    return _read_records(s, *where)


def _read_records(s: Session, *where: ColumnElement[bool]) -> list[IncidentRecord]:
    """The one read of incidents: the ``incident`` events that match ``where``, with
    their steps, causes and attempts. Every reader of incidents comes through here."""
    is_incident = [FailureEvent.kind == EventKind.INCIDENT, *where]
    events = list(s.scalars(select(FailureEvent).where(*is_incident).order_by(FailureEvent.id)))
    if not events:
        return []
    jobs = sorted({e.job_id for e in events})
    attempts: dict[str, list[Attempt]] = defaultdict(list)
    for a in s.scalars(
        select(Attempt).where(Attempt.job_id.in_(jobs)).order_by(Attempt.job_id, Attempt.number)
    ):
        attempts[a.job_id].append(a)
    rank_steps: dict[tuple[str, int], list[float]] = defaultdict(list)
    for n in s.scalars(select(Node).where(Node.job_id.in_(jobs))):
        rank_steps[(n.job_id, n.attempt)] += rank_values(n.progress, "step")
    steps: dict[int, list[StepRow]] = defaultdict(list)
    for r in s.scalars(
        select(StepRow)
        .join(FailureEvent, FailureEvent.id == StepRow.incident_id)
        .where(*is_incident)
        .order_by(StepRow.id)
    ):
        steps[r.incident_id].append(r)
    cause_of = {e.id: as_int((e.details or {}).get("cause_event_id")) for e in events}
    wanted = sorted({c for c in cause_of.values() if c is not None})
    causes: dict[int, FailureEvent] = {}
    for i in range(0, len(wanted), _IN_CHUNK):
        chunk = wanted[i : i + _IN_CHUNK]
        causes.update(
            (e.id, e) for e in s.scalars(select(FailureEvent).where(FailureEvent.id.in_(chunk)))
        )
    out = []
    for e in events:
        failed, recovering = failed_and_recovering(attempts[e.job_id], e)
        cause = cause_of[e.id]
        out.append(
            IncidentRecord(
                event=e,
                steps=tuple(steps[e.id]),
                cause=causes.get(cause) if cause is not None else None,
                failed=failed,
                recovering=tuple(recovering),
                last_step=failed_attempt_last_step(
                    e.details,
                    rank_steps[(e.job_id, failed.number)] if failed is not None else [],
                ),
            )
        )
    return out


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
    s: Session, *, since: datetime | None = None, job_ids: Sequence[str] | None = None
) -> list[FleetIncident]:
    """Every incident of every job (or of ``job_ids``) with protocol steps, in the order
    they occurred (then by id)."""
    records = [
        r for r in fleet_incident_records(s, since=since, job_ids=job_ids) if r.has_protocol_steps
    ]
    records.sort(key=lambda r: (_aware(r.event.occurred_at), r.event.id))
    return [
        FleetIncident(
            r.event.job_id,
            r.event.id,
            _aware(r.event.occurred_at),
            r.event.failure_class or FailureClass.UNKNOWN.value,
            r.failed.cloud if r.failed else None,
            r.failed.region if r.failed else None,
            r.failed.instance_type if r.failed else None,
        )
        for r in records
    ]


def _aware(d: datetime) -> datetime:
    return d if d.tzinfo else d.replace(tzinfo=UTC)  # SQLite hands back naive UTC


def incident_mttr(occurred_at: datetime, steps: list[StepRow]) -> float | None:
    """Seconds from the failure to the end of its last protocol step, once all seven
    have finished; None while the recovery is under way (or it never completed)."""
    done = [r for r in steps if r.finished_at is not None]
    if not done or len(done) < len(ProtocolStep):
        return None
    end = max(utc(r.finished_at) for r in done)  # type: ignore[type-var]
    return (end - utc(occurred_at)).total_seconds()  # type: ignore[operator]


def incidents(s: Session, job_id: str) -> list[dict[str, Any]]:
    """Every incident of a job with its protocol steps, oldest first."""
    shapes = job_shapes(s, job_id)
    reported = {
        e.id: e
        for e in s.scalars(
            select(FailureEvent).where(
                FailureEvent.job_id == job_id, FailureEvent.kind.in_(_REPORTED)
            )
        )
    }
    # Every launch a recovery asked for and was refused (or whose request then failed):
    # a refused refill's reason, a stockout's region, before the one that came up.
    refused = s.scalars(
        select(FailureEvent)
        .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.LAUNCH_FAILED)
        .order_by(FailureEvent.id)
    ).all()
    return [_incident_view(r, shapes, reported, refused) for r in incident_records(s, job_id)]


def _incident_view(
    record: IncidentRecord,
    shapes: dict[int, AttemptShape],
    reported: dict[int, FailureEvent],
    refused: Sequence[FailureEvent],
) -> dict[str, Any]:
    """One incident as ``GET /v1/jobs/{id}/incidents`` answers it."""
    inc, rows = record.event, record.steps
    d = inc.details or {}
    number = d.get("attempt")
    select_row = next((r for r in rows if r.step == str(ProtocolStep.SELECT_REPLACEMENT)), None)
    chosen = selection_from_json(select_row.result) if select_row and select_row.result else None
    nxt = record.recovering[0] if record.recovering else None
    last = record.last_step
    resumed = nxt.validated_step if nxt is not None else None
    before = shapes.get(number) if isinstance(number, int) else None
    after = shapes.get(nxt.number) if nxt is not None else None
    reshape = None
    if inc.failure_class == FailureClass.ELASTIC_GROW:
        reshape = "grow"
    elif (chosen is not None and chosen.verb is LaunchVerb.SHRINK) or (
        after is not None and after.shrunk
    ):
        reshape = "shrink"
    # The classifier's verdict on the cause: its confidence and the line that decided
    # it (always there above 0.9; docs/failures.md).
    cause_id = d.get("cause_event_id")
    cause = reported.get(cause_id) if isinstance(cause_id, int) else None
    verdict = ((cause.details or {}).get("classification") if cause else None) or {}
    return {
        "id": inc.id,
        "failure_class": inc.failure_class,
        "reshape": reshape,
        "nodes_before": before.training_nodes if before is not None else None,
        "nodes_after": after.training_nodes if after is not None else None,
        "confidence": verdict.get("confidence"),
        "decided_by": verdict.get("decided_by"),
        "node_id": inc.node_id,
        "message": inc.message,
        "attempt": number,
        "occurred_at": utc(inc.occurred_at),
        "remedy": str(chosen.remedy) if chosen is not None else None,
        "launch_verb": str(chosen.verb) if chosen is not None else None,
        # A planned reshape (an elastic run's grow back), not a failure.
        "planned": is_planned(inc.failure_class),
        "train_nodes": chosen.train_nodes if chosen is not None else None,
        "last_step": last,
        "resumed_step": resumed,
        "steps_lost": (
            last - resumed if isinstance(last, int) and isinstance(resumed, int) else None
        ),
        "mttr_s": incident_mttr(inc.occurred_at, list(rows)),
        "consequences": [
            {
                "event_id": e.id,
                "kind": e.kind,
                "failure_class": e.failure_class,
                "node_id": e.node_id,
                "message": e.message,
            }
            for i in d.get("consequences", []) or []
            if (e := reported.get(i)) is not None
        ],
        "evidence": [
            {"event_id": e.id, "node_id": e.node_id, "message": e.message}
            for e in reported.values()
            if e.kind == EventKind.EVIDENCE and (e.details or {}).get("attempt") == number
        ],
        # The refused launches' attempt is the new one's.
        "launch_failures": [
            {
                "event_id": e.id,
                "verb": (e.details or {}).get("verb"),
                "region": (e.details or {}).get("region"),
                "instance_type": (e.details or {}).get("instance_type"),
                "capacity": (e.details or {}).get("capacity"),
                "message": e.message,
            }
            for e in refused
            if nxt is not None and (e.details or {}).get("attempt") == nxt.number
        ],
        "steps": [
            {
                "step": r.step,
                "started_at": utc(r.started_at),
                "finished_at": utc(r.finished_at),
                "seconds": (
                    (r.finished_at - r.started_at).total_seconds() if r.finished_at else None
                ),
                "outcome": r.outcome,
                "detail": r.detail,
            }
            for r in rows
        ],
    }
