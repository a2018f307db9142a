"""A running job as the operator watches it: status and step, each node of the
current attempt (address, heartbeat age, health checks, ranks), and the newest
incident's protocol steps as they start and end. Read by ``GET /v1/jobs/{id}/live``,
``skyresume watch`` and the dashboard's live section.

Read-only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.contract import ReportKind
from orchestrator.domain.protocol import ORDER
from orchestrator.store import repo
from orchestrator.store.models import Attempt, FailureEvent, Node, ProtocolStep


def _utc(d: datetime | None) -> datetime | None:
    return None if d is None else (d if d.tzinfo else d.replace(tzinfo=UTC))


def job_live(s: Session, job_id: str, *, now: datetime | None = None) -> dict[str, Any]:
    """Raises ``repo.NotFound`` for an unknown job."""
    now = now or datetime.now(UTC)
    job = repo.get_job(s, job_id)
    attempt = s.scalar(
        select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number.desc()).limit(1)
    )
    nodes_out: list[dict[str, Any]] = []
    step: int | None = None
    if attempt is not None:
        health: dict[str, FailureEvent] = {}
        for e in s.scalars(
            select(FailureEvent)
            .where(
                FailureEvent.job_id == job_id, FailureEvent.kind == ReportKind.HEALTH_CHECK.value
            )
            .order_by(FailureEvent.occurred_at, FailureEvent.id)
        ):
            if (
                e.node_id is not None
                and (e.details or {}).get("attempt", attempt.number) == attempt.number
            ):
                health[e.node_id] = e
        for n in s.scalars(
            select(Node)
            .where(Node.job_id == job_id, Node.attempt == attempt.number)
            .order_by(Node.node_rank, Node.node_id)
        ):
            beat = _utc(n.last_heartbeat_at)
            ranks = []
            for r in (n.progress or {}).get("ranks") or []:
                if isinstance(r.get("step"), int):
                    step = r["step"] if step is None else max(step, r["step"])
                ranks.append(
                    {
                        k: r.get(k)
                        for k in (
                            "rank",
                            "local_rank",
                            "alive",
                            "step",
                            "loss",
                            "grad_norm",
                            "step_time",
                        )
                    }
                )
            h = health.get(n.node_id)
            nodes_out.append(
                {
                    "node_id": n.node_id,
                    "node_rank": n.node_rank,
                    "address": n.address,
                    "state": n.state,
                    "heartbeat_age_s": None
                    if beat is None
                    else max((now - beat).total_seconds(), 0.0),
                    "health": None
                    if h is None
                    else {"ok": h.failure_class is None, "message": h.message or ""},
                    "ranks": sorted(ranks, key=lambda r: (r["rank"] is None, r["rank"])),
                }
            )
    incident: dict[str, Any] | None = None
    newest = s.scalar(
        select(ProtocolStep.incident_id)
        .where(ProtocolStep.job_id == job_id)
        .order_by(ProtocolStep.incident_id.desc())
        .limit(1)
    )
    if newest is not None:
        ev = s.get(FailureEvent, newest)
        rows = {
            r.step: r
            for r in s.scalars(select(ProtocolStep).where(ProtocolStep.incident_id == newest))
        }
        steps = []
        for name in ORDER:
            r = rows.get(name.value)
            steps.append(
                {
                    "step": name.value,
                    "started_at": None if r is None else _utc(r.started_at),
                    "finished_at": None if r is None else _utc(r.finished_at),
                    "outcome": None if r is None else r.outcome,
                    "detail": None if r is None else r.detail,
                }
            )
        incident = {
            "id": newest,
            "failure_class": (ev.failure_class if ev else None) or "unknown",
            "kind": ev.kind if ev else None,
            "node_id": ev.node_id if ev else None,
            "occurred_at": _utc(ev.occurred_at) if ev else None,
            "ongoing": any(st["finished_at"] is None for st in steps),
            "steps": steps,
        }
    return {
        "job": {"id": job.id, "name": job.name, "status": job.status, "reason": job.status_reason},
        "step": step,
        "attempt": None
        if attempt is None
        else {
            "number": attempt.number,
            "state": attempt.state,
            "cloud": attempt.cloud,
            "region": attempt.region,
            "instance_type": attempt.instance_type,
        },
        "nodes": nodes_out,
        "incident": incident,
        "as_of": now,
    }
