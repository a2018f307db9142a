"""Node log tails as the agents last uploaded them (``node_logs``): one row per
(job, attempt, node, source); an upload replaces the lines it names and keeps the
others, so a node's rank logs survive an upload that had only the agent's.

Does I/O: SQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.store.models import NodeLog

#: What one upload may carry (the route refuses more, the store cuts nothing).
MAX_SOURCES = 256
MAX_LINES = 500
MAX_LINE_CHARS = 4000


def save_logs(
    s: Session,
    job_id: str,
    attempt: int,
    node_id: str,
    logs: Sequence[dict[str, Any]],
    *,
    reason: str,
    now: datetime,
) -> int:
    existing = {
        r.source: r
        for r in s.scalars(
            select(NodeLog).where(
                NodeLog.job_id == job_id, NodeLog.attempt == attempt, NodeLog.node_id == node_id
            )
        )
    }
    for entry in logs:
        text = "\n".join(entry["lines"])
        row = existing.get(entry["source"])
        if row is None:
            row = NodeLog(job_id=job_id, attempt=attempt, node_id=node_id, source=entry["source"])
            s.add(row)
            existing[entry["source"]] = row
        row.rank = entry.get("rank")
        row.lines = text
        row.reason = reason
        row.uploaded_at = now
    s.flush()
    return len(logs)


def list_logs(
    s: Session,
    job_id: str,
    *,
    attempt: int | None = None,
    node_id: str | None = None,
    rank: int | None = None,
) -> list[NodeLog]:
    q = select(NodeLog).where(NodeLog.job_id == job_id)
    if attempt is not None:
        q = q.where(NodeLog.attempt == attempt)
    if node_id is not None:
        q = q.where(NodeLog.node_id == node_id)
    if rank is not None:
        q = q.where(NodeLog.rank == rank)
    return list(s.scalars(q.order_by(NodeLog.attempt, NodeLog.node_id, NodeLog.source)))
