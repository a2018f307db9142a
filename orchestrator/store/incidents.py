"""The read model of incidents: one row per failed attempt with its protocol steps.

The API (``/v1/jobs/{id}/incidents``), the CLI, the dashboard and the reconciler's
interval advisor all read incidents from here, so MTTR is computed in one place
(:func:`incident_mttr`). Goodput uses the same function for its per-incident MTTR.

Elastic runs: an ``elastic_grow`` incident is a planned reshape, not a failure
(``planned``: counts of failures and MTBF leave it out), and every incident says how
many nodes trained before and after it (``nodes_before``: the attempt it ended,
``nodes_after``: the one it started, as ``store.shape`` counts them) and whether it
reshaped the group (``reshape``: ``shrink`` when SELECT chose one, ``grow``).

Read-only: nothing here writes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.contract import EventKind
from orchestrator.domain.failures import FailureClass
from orchestrator.domain.protocol import ProtocolStep
from orchestrator.domain.reconcile import LaunchVerb
from orchestrator.store.goodput import failed_attempt_last_step, is_planned, rank_values
from orchestrator.store.models import Attempt, FailureEvent, Node
from orchestrator.store.models import ProtocolStep as StepRow
from orchestrator.store.records import selection_from_json
from orchestrator.store.shape import job_shapes
from orchestrator.store.snapshot import utc


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
    out = []
    shapes = job_shapes(s, job_id)
    events = {
        e.id: e
        for e in s.scalars(
            select(FailureEvent).where(
                FailureEvent.job_id == job_id,
                FailureEvent.kind.in_(
                    [EventKind.RANK_EXIT, EventKind.NODE_LOST, EventKind.RANK_HANG,
                     EventKind.ANOMALY, EventKind.EVIDENCE, EventKind.HEALTH_CHECK,
                     EventKind.PREEMPTION_NOTICE, EventKind.STUCK]
                ),
            )
        )
    }  # fmt: skip
    for inc in s.scalars(
        select(FailureEvent)
        .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.INCIDENT)
        .order_by(FailureEvent.id)
    ):
        rows = list(
            s.scalars(select(StepRow).where(StepRow.incident_id == inc.id).order_by(StepRow.id))
        )
        d = inc.details or {}
        number = d.get("attempt")
        steps = [
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
        ]
        select_row = next((r for r in rows if r.step == str(ProtocolStep.SELECT_REPLACEMENT)), None)
        chosen = (
            selection_from_json(select_row.result) if select_row and select_row.result else None
        )
        nxt = s.scalars(select(Attempt).where(Attempt.incident_id == inc.id)).first()
        nodes = s.scalars(select(Node).where(Node.job_id == job_id, Node.attempt == number))
        last = failed_attempt_last_step(
            d, [v for n in nodes for v in rank_values(n.progress, "step")]
        )
        resumed = nxt.validated_step if nxt is not None else None
        consequences = [
            {
                "event_id": e.id,
                "kind": e.kind,
                "failure_class": e.failure_class,
                "node_id": e.node_id,
                "message": e.message,
            }
            for i in d.get("consequences", []) or []
            if (e := events.get(i)) is not None
        ]
        # The classifier's verdict on the cause: its confidence and the line that
        # decided it (always there above 0.9; docs/failures.md).
        cause_id = d.get("cause_event_id")
        cause = events.get(cause_id) if isinstance(cause_id, int) else None
        verdict = ((cause.details or {}).get("classification") if cause else None) or {}
        evidence = [
            {"event_id": e.id, "node_id": e.node_id, "message": e.message}
            for e in events.values()
            if e.kind == EventKind.EVIDENCE and (e.details or {}).get("attempt") == number
        ]
        # Every launch the recovery asked for and was refused (or whose request then
        # failed): a refused refill's reason, a stockout's region, before the one that
        # came up. Their attempt is the new one's.
        refused = (
            s.scalars(
                select(FailureEvent)
                .where(
                    FailureEvent.job_id == job_id,
                    FailureEvent.kind == EventKind.LAUNCH_FAILED,
                )
                .order_by(FailureEvent.id)
            ).all()
            if nxt is not None
            else []
        )
        launch_failures = [
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
        ]
        before = shapes.get(number) if isinstance(number, int) else None
        after = shapes.get(nxt.number) if nxt is not None else None
        reshape = None
        if inc.failure_class == FailureClass.ELASTIC_GROW:
            reshape = "grow"
        elif (chosen is not None and chosen.verb is LaunchVerb.SHRINK) or (
            after is not None and after.shrunk
        ):
            reshape = "shrink"
        out.append(
            {
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
                "mttr_s": incident_mttr(inc.occurred_at, rows),
                "consequences": consequences,
                "evidence": evidence,
                "launch_failures": launch_failures,
                "steps": steps,
            }
        )
    return out
