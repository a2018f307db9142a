"""What an operator watches: node log tails, the live view, the run's time series,
and the alert webhooks.

* agents ``PUT .../attempts/{n}/nodes/{node}/logs`` (their attempt's agent token);
* ``GET /v1/jobs/{id}/logs`` (``?attempt=&node=&rank=``) the stored tails, and
  ``POST /v1/jobs/{id}/logs/request`` asks the current attempt's agents to upload now;
* ``GET /v1/jobs/{id}/live`` and ``GET /v1/jobs/{id}/series``;
* ``GET|POST /v1/alerts/webhooks`` and ``DELETE /v1/alerts/webhooks/{id}``.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select

from orchestrator.api.deps import OperatorDep, SessionDep
from orchestrator.api.routes_agents import AttemptPath, NodePath, require_job_access
from orchestrator.api.strict import StrictQueryRoute
from orchestrator.contract import CommandType
from orchestrator.store import agents, node_logs, repo
from orchestrator.store.live_view import job_live
from orchestrator.store.models import AlertWebhook, Node
from orchestrator.store.series import job_series

agent_router = APIRouter(
    prefix="/v1/jobs/{job_id}/attempts/{attempt}/nodes/{node_id}",
    tags=["agents"],
    dependencies=[Depends(require_job_access)],
)
router = APIRouter(
    prefix="/v1", tags=["operator"], dependencies=[OperatorDep], route_class=StrictQueryRoute
)


class LogTail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(pattern=r"^(agent|torchrun|rank\d{1,9})$")
    rank: int | None = Field(default=None, ge=0, le=2**31 - 1)
    lines: list[Annotated[str, Field(max_length=node_logs.MAX_LINE_CHARS)]] = Field(
        max_length=node_logs.MAX_LINES
    )

    @field_validator("lines")
    @classmethod
    def _no_nul(cls, v: list[str]) -> list[str]:
        return [x.replace("\x00", "\ufffd") for x in v]  # PostgreSQL's TEXT refuses NUL


class LogsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Literal["request", "exit", "periodic"]
    logs: list[LogTail] = Field(max_length=node_logs.MAX_SOURCES)


@agent_router.put("/logs")
def upload_logs(
    request: Request, job_id: str, attempt: AttemptPath, node_id: NodePath, body: LogsIn
) -> dict[str, int]:
    """Stored for any attempt the node belongs to, current or not: the last lines of
    a superseded attempt's dying node are exactly what the operator wants."""
    with request.app.state.sessionmaker.begin() as s:
        # The node's row moves to its newest attempt; an older attempt's last lines
        # (a superseded node dying) are still that node's, so any attempt is taken.
        known = s.scalar(select(Node.id).where(Node.job_id == job_id, Node.node_id == node_id))
        if known is None:
            raise HTTPException(404, f"node {node_id} never registered for job {job_id}")
        n = node_logs.save_logs(
            s,
            job_id,
            attempt,
            node_id,
            [t.model_dump() for t in body.logs],
            reason=body.reason,
            now=datetime.now(UTC),
        )
    return {"stored": n}


def _job(s: Any, job_id: str) -> None:
    try:
        repo.get_job(s, job_id)
    except repo.NotFound as e:
        raise HTTPException(404, str(e)) from None


@router.get("/jobs/{job_id}/logs")
def get_logs(
    job_id: str,
    session: SessionDep,
    attempt: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    node: Annotated[str | None, Query(max_length=64)] = None,
    rank: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
) -> dict[str, Any]:
    """Each stored tail, oldest attempt first. No ``attempt``: every attempt."""
    _job(session, job_id)
    rows = node_logs.list_logs(session, job_id, attempt=attempt, node_id=node, rank=rank)
    return {
        "items": [
            {
                "attempt": r.attempt,
                "node_id": r.node_id,
                "source": r.source,
                "rank": r.rank,
                "reason": r.reason,
                "uploaded_at": r.uploaded_at,
                "lines": r.lines.split("\n") if r.lines else [],
            }
            for r in rows
        ]
    }


@router.post("/jobs/{job_id}/logs/request")
def request_logs(
    job_id: str, session: SessionDep, node: Annotated[str | None, Query(max_length=64)] = None
) -> dict[str, Any]:
    """Ask the current attempt's agents (or one node) to upload their tails now."""
    _job(session, job_id)
    current = agents.current_attempt(session, job_id)
    if current is None:
        raise HTTPException(409, f"job {job_id} has no attempt running")
    cmd = agents.enqueue_command(
        session, job_id, current.number, CommandType.UPLOAD_LOGS.value, {}, node
    )
    session.commit()
    return {"command": cmd.id, "attempt": current.number}


@router.get("/jobs/{job_id}/live")
def live(job_id: str, session: SessionDep) -> dict[str, Any]:
    try:
        return job_live(session, job_id)
    except repo.NotFound as e:
        raise HTTPException(404, str(e)) from None


@router.get("/jobs/{job_id}/series")
def series(job_id: str, session: SessionDep) -> dict[str, Any]:
    """Each rank's samples (step, step time, loss, grad norm) and the marks on the same
    time axis: incidents (start, end) and complete checkpoints."""
    _job(session, job_id)
    data = job_series(session, job_id)
    return {
        "points": [p.__dict__ for p in data.points],
        "marks": [m.__dict__ for m in data.marks],
    }


class WebhookIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=8, max_length=2000, pattern=r"^https?://[^\x00-\x20\x7f]+$")
    """No spaces or control characters (a NUL cannot be stored in PostgreSQL's text)."""
    job_id: str | None = Field(default=None, max_length=32, pattern=r"^[A-Za-z0-9_-]+$")
    """None: every job's alerts."""
    secret: str | None = Field(
        default=None, min_length=16, max_length=256, pattern=r"^[\x21-\x7e]+$"
    )
    """The HMAC key, printable ASCII without spaces; None: the service makes one and
    returns it, once."""


@router.post("/alerts/webhooks", status_code=201)
def add_webhook(body: WebhookIn, session: SessionDep) -> dict[str, Any]:
    if body.job_id is not None:
        _job(session, body.job_id)
    secret = body.secret or secrets.token_urlsafe(32)
    w = AlertWebhook(job_id=body.job_id, url=body.url, secret=secret, created_at=datetime.now(UTC))
    session.add(w)
    session.commit()
    return {"id": w.id, "url": w.url, "job_id": w.job_id, "secret": secret}


@router.get("/alerts/webhooks")
def list_webhooks(session: SessionDep) -> dict[str, Any]:
    """Secrets are never shown again."""
    rows = session.scalars(select(AlertWebhook).order_by(AlertWebhook.id))
    return {
        "items": [
            {"id": w.id, "url": w.url, "job_id": w.job_id, "created_at": w.created_at} for w in rows
        ]
    }


@router.delete("/alerts/webhooks/{ref}")
def delete_webhook(
    ref: Annotated[int, PathParam(ge=1, le=2**63 - 1)], session: SessionDep
) -> dict[str, Any]:
    """``ref``: the webhook's id (the path segment is named as the tokens routes name
    theirs)."""
    w = session.get(AlertWebhook, ref)
    if w is None:
        raise HTTPException(404, f"no webhook {ref}")
    session.delete(w)
    session.commit()
    return {"deleted": ref}
