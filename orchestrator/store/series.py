"""The run's time series: one ``progress_samples`` row per rank when its step moved.

Heartbeats keep only a node's newest progress (``nodes.progress``); the dashboard's
charts need its history. :class:`ProgressSampler` reads the nodes of live attempts
and appends a sample per rank whose step changed since its last sample, at most one
per ``every_s`` per rank, so a 2,048-node job at 1 Hz beats writes a bounded number
of rows. Reads (:func:`job_series`) return the samples and the marks that share the
time axis: incidents (detect to validate) and complete checkpoints.

Does I/O: SQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.contract import AttemptState, NodeState
from orchestrator.store.models import Attempt, Checkpoint, Node, ProgressSample, ProtocolStep


def _utc(d: datetime) -> datetime:
    return d if d.tzinfo else d.replace(tzinfo=UTC)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


class ProgressSampler:
    """Keeps each rank's last sampled (step, time) in memory; a restarted service
    samples each rank once more, which a chart shows as one more point, no more."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._last: dict[tuple[str, int, str, int], tuple[int, datetime]] = {}

    def sample(self, s: Session, *, now: datetime) -> int:
        rows = s.execute(
            select(Node)
            .join(Attempt, (Attempt.job_id == Node.job_id) & (Attempt.number == Node.attempt))
            .where(Attempt.state != AttemptState.ENDED.value, Node.state != NodeState.EXITED.value)
        ).scalars()
        added = 0
        seen: set[tuple[str, int, str, int]] = set()
        for n in rows:
            at = _utc(n.last_heartbeat_at) if n.last_heartbeat_at else now
            for r in (n.progress or {}).get("ranks") or []:
                step, rank = r.get("step"), r.get("rank")
                if not isinstance(step, int) or not isinstance(rank, int):
                    continue
                key = (n.job_id, n.attempt, n.node_id, rank)
                seen.add(key)
                last = self._last.get(key)
                if last is not None and (
                    last[0] == step or (at - last[1]).total_seconds() < self.every_s
                ):
                    continue
                s.add(
                    ProgressSample(
                        job_id=n.job_id,
                        attempt=n.attempt,
                        node_id=n.node_id,
                        rank=rank,
                        at=at,
                        step=step,
                        step_time=_num(r.get("step_time")),
                        loss=_num(r.get("loss")),
                        grad_norm=_num(r.get("grad_norm")),
                    )
                )
                self._last[key] = (step, at)
                added += 1
        for key in set(self._last) - seen:  # attempts that ended: forget them
            del self._last[key]
        s.commit()
        return added


@dataclass(frozen=True)
class Point:
    at: datetime
    rank: int
    attempt: int
    step: int
    step_time: float | None
    loss: float | None
    grad_norm: float | None


@dataclass(frozen=True)
class Mark:
    at: datetime
    end: datetime | None
    kind: str
    """``incident`` (a band from detect to the last finished step) or ``checkpoint``."""
    label: str


@dataclass(frozen=True)
class JobSeries:
    points: Sequence[Point]
    marks: Sequence[Mark]


def job_series(
    s: Session, job_id: str, *, since: datetime | None = None, limit: int = 20000
) -> JobSeries:
    q = select(ProgressSample).where(ProgressSample.job_id == job_id)
    if since is not None:
        q = q.where(ProgressSample.at >= since)
    points = [
        Point(_utc(p.at), p.rank, p.attempt, p.step, p.step_time, p.loss, p.grad_norm)
        for p in s.scalars(q.order_by(ProgressSample.at, ProgressSample.id).limit(limit))
    ]
    marks: list[Mark] = []
    spans: dict[int, list[ProtocolStep]] = {}
    for r in s.scalars(select(ProtocolStep).where(ProtocolStep.job_id == job_id)):
        spans.setdefault(r.incident_id, []).append(r)
    for inc, steps in sorted(spans.items()):
        start = min(_utc(r.started_at) for r in steps)
        ends = [_utc(r.finished_at) for r in steps if r.finished_at]
        marks.append(Mark(start, max(ends) if ends else None, "incident", f"incident #{inc}"))
    for c in s.scalars(
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.status == "complete")
        .order_by(Checkpoint.step)
    ):
        marks.append(Mark(_utc(c.created_at), None, "checkpoint", f"checkpoint step {c.step}"))
    return JobSeries(points, marks)
