"""/v1/jobs/{id}/attempts, /incidents (the restart protocol's record) and /chaos."""

from __future__ import annotations

import signal
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import select

from orchestrator.api.deps import OperatorDep, SessionDep
from orchestrator.api.strict import StrictQueryRoute
from orchestrator.cloud.metadata import Provider
from orchestrator.contract import AttemptState, CommandType, FaultKind
from orchestrator.domain.spec import INT32_MAX, refuse_unstorable
from orchestrator.domain.status import JobStatus
from orchestrator.launchers.base import ChaosLauncher, LaunchError
from orchestrator.store import agents, records, repo
from orchestrator.store.incidents import incidents
from orchestrator.store.models import Attempt, Node, NodeCommand
from orchestrator.store.shape import AttemptShape, job_shapes

router = APIRouter(prefix="/v1", dependencies=[OperatorDep], route_class=StrictQueryRoute)


def _job(session: SessionDep, job_id: str):  # type: ignore[no-untyped-def]
    try:
        return repo.get_job(session, job_id)
    except repo.NotFound as e:
        raise HTTPException(404, str(e)) from None


@router.get("/jobs/{job_id}/attempts")
def list_attempts(job_id: str, session: SessionDep) -> dict[str, Any]:
    """Every launch of the job, newest last, with its nodes and their last heartbeat.

    ``num_nodes`` is the size the attempt was placed for; ``training_nodes`` the nodes
    whose ranks trained: fewer on a shrunk attempt (an elastic run), whose ``spare``
    is ``{count, released, node_ids}`` (its standby replacements; null otherwise).
    ``carried``: the node ids its SIGNAL held warm, which a warm shrink carried into
    the next attempt (each node is listed once, under the attempt it is in now)."""
    _job(session, job_id)
    out = []
    shapes = job_shapes(session, job_id)
    for a in session.scalars(
        select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number)
    ):
        nodes = session.scalars(
            select(Node)
            .where(Node.job_id == job_id, Node.attempt == a.number)
            .order_by(Node.node_rank)
        )
        shape = shapes[a.number]
        out.append(
            {
                "number": a.number,
                "state": a.state,
                "cloud": a.cloud,
                "region": a.region,
                "instance_type": a.instance_type,
                "num_nodes": a.num_nodes,
                "spot": a.spot,
                "resume_step": a.resume_step,
                "validated_step": a.validated_step,
                "incident_id": a.incident_id,
                "started_at": a.started_at,
                "ended_at": a.ended_at,
                "end_reason": a.end_reason,
                "hosts": list((a.handle or {}).get("hosts", [])),
                "knobs": {
                    k: (a.knobs or {}).get(k)
                    for k in ("micro_batch", "grad_accum", "activation_checkpoint_every")
                    if k in (a.knobs or {})
                },
                "in_place": records.restarted_in_place(a),
                "launch_verb": str(records.launched_verb(a)),
                # The nodes that trained: fewer than num_nodes (the size it was placed
                # for) on a shrunk attempt, whose other nodes are its standby spares.
                "training_nodes": shape.training_nodes,
                "spare": _spare(shape),
                "exclude_hosts": list((a.knobs or {}).get("exclude_hosts") or []),
                # Held warm at SIGNAL: the nodes a warm shrink carried on into a later
                # attempt (one row per node: listed under the attempt they are in now).
                "carried": sorted(agents.held_ids(a)),
                "nodes": [
                    {
                        "node_id": n.node_id,
                        "node_rank": n.node_rank,
                        "address": n.address,
                        "state": n.state,
                        "last_heartbeat_at": n.last_heartbeat_at,
                        "ranks": (n.progress or {}).get("ranks", []),
                    }
                    for n in nodes
                ],
            }
        )
    return {"items": out}


def _spare(shape: AttemptShape) -> dict[str, Any] | None:
    """A shrunk attempt's standby replacements: how many were asked for, why they were
    given back (null: they were not), and their node ids (launched or registered)."""
    sp = shape.spare
    if sp is None:
        return None
    return {"count": sp.count, "released": sp.released, "node_ids": list(sp.node_ids)}


@router.get("/jobs/{job_id}/incidents")
def list_incidents(job_id: str, session: SessionDep) -> dict[str, Any]:
    """Each failure the restart protocol handled: class, steps lost, MTTR and its
    breakdown by protocol step (started/finished/outcome/detail)."""
    _job(session, job_id)
    return {"items": incidents(session, job_id)}


class ChaosIn(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, doc: Any) -> Any:
        return refuse_unstorable(doc)

    action: Literal[
        "preempt",
        "kill-node",
        "kill-agent",
        "hang-rank",
        "slow-rank",
        "nan",
        "spike",
        "oom",
        "xid",
        "transport",
        "user-error",
        "partition",
        "slow-link",
        "heal",
    ]
    node: int = Field(ge=0, le=INT32_MAX, description="node rank within the current attempt")
    attempt: int | None = Field(default=None, ge=1, le=1_000_000)
    """heal: the attempt the node belongs to (default the current one): a partitioned
    node of an attempt the job moved on from can be healed, to see it refused."""
    rank: int | None = Field(
        default=None, ge=0, le=INT32_MAX, description="global rank (hang/slow)"
    )
    provider: Provider | None = None
    in_seconds: float = Field(default=30.0, ge=0, le=3600)
    """preempt: how far ahead the notice announces the termination."""
    duty: float = Field(default=0.5, gt=0, lt=1)
    """slow-rank: the fraction of time the rank is stopped."""
    seconds: float | None = Field(default=None, gt=0, le=3600)
    """slow-rank: for how long (default 60 s); partition, slow-link: heal by itself
    after this long (default: until ``heal``)."""
    rate: str | None = Field(default=None, max_length=32)
    """slow-link: the link's rate in tc syntax (``20mbit``); ``0`` lifts the limit."""


#: Chaos on a node's network link (the local launcher's namespaces, never loopback).
_LINK_ACTIONS = frozenset({"partition", "slow-link", "heal"})


#: Chaos the ranks inject into themselves (through the agent), by action name.
_FAULTS = {
    "nan": FaultKind.NAN,
    "spike": FaultKind.SPIKE,
    "oom": FaultKind.OOM,
    "xid": FaultKind.XID,
    "transport": FaultKind.TRANSPORT,
    "user-error": FaultKind.USER_ERROR,
}


@router.post("/jobs/{job_id}/chaos")
def chaos(job_id: str, body: ChaosIn, request: Request, session: SessionDep) -> dict[str, Any]:
    """Inject a failure into a running job on the local launcher (``nan`` goes through
    the agents, so it works on any launcher)."""
    job = _job(session, job_id)
    launcher: ChaosLauncher | None = request.app.state.launcher
    fault = _FAULTS.get(body.action)
    if fault is None and (launcher is None or not launcher.abilities.chaos):
        raise HTTPException(409, "chaos needs the local launcher (skyresume serve, launcher=local)")
    assert fault is not None or launcher is not None
    if JobStatus(job.status).is_terminal():
        raise HTTPException(409, f"job {job_id} is {job.status}")
    a = session.scalars(
        select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number.desc())
    ).first()
    if a is None or not a.handle or a.state == AttemptState.ENDED:
        raise HTTPException(409, f"job {job_id} has no running attempt")
    node_ids = list(a.handle.get("node_ids", []))
    if body.attempt is not None and body.attempt != a.number:
        if body.action != "heal":
            raise HTTPException(422, f"attempt is for heal; {body.action} acts on the current one")
        old = session.scalars(
            select(Attempt).where(Attempt.job_id == job_id, Attempt.number == body.attempt)
        ).first()
        if old is None or not old.handle:
            raise HTTPException(404, f"job {job_id} has no attempt {body.attempt} with nodes")
        a, node_ids = old, list(old.handle.get("node_ids", []))
    if body.action in _LINK_ACTIONS:
        assert launcher is not None
        return _link_chaos(job_id, body, launcher, node_ids, a.number)
    if body.node >= len(node_ids):
        raise HTTPException(
            422, f"node {body.node} does not exist: attempt {a.number} has {len(node_ids)} nodes"
        )
    node_id = node_ids[body.node]
    at = datetime.now().astimezone().isoformat()
    try:
        if body.action == "preempt":
            launcher.preempt(node_id, provider=body.provider, in_seconds=body.in_seconds)
            return {"action": body.action, "node_id": node_id, "at": at}
        if body.action == "kill-node":
            n = launcher.kill_node(job_id, node_id)
            return {"action": body.action, "node_id": node_id, "killed": n, "at": at}
        if fault is not None:
            # Through the agent's command channel and control file, so it works on any
            # launcher: the node's ranks fail this way at their next control poll.
            cmd = NodeCommand(
                job_id=job_id,
                attempt=a.number,
                node_id=node_id,
                type=CommandType.INJECT_FAULT,
                args={"kind": str(fault), "rank": body.rank},
                created_at=repo.utcnow(),
            )
            session.add(cmd)
            session.commit()
            return {"action": body.action, "node_id": node_id, "command": cmd.id, "at": at}
        if body.action == "kill-agent":
            launcher.kill_agent(job_id, node_id)
            return {"action": body.action, "node_id": node_id, "at": at}
        pid = _rank_pid(session, job_id, node_id, body.rank)
        if body.action == "hang-rank":
            launcher.signal_pid(job_id, node_id, pid, signal.SIGSTOP)
        else:
            seconds = body.seconds if body.seconds is not None else 60.0
            launcher.slow_pid(job_id, node_id, pid, duty=body.duty, seconds=seconds)
        return {"action": body.action, "node_id": node_id, "pid": pid, "at": at}
    except (LaunchError, ValueError) as e:
        raise HTTPException(409, str(e)) from None


def _link_chaos(
    job_id: str, body: ChaosIn, launcher: ChaosLauncher, node_ids: list[str], attempt: int
) -> dict[str, Any]:
    """partition / slow-link / heal: the kernel acts on the node's own link."""
    refusal = launcher.link_chaos_refusal()
    if refusal is not None:
        raise HTTPException(409, f"{body.action} refused: {refusal}")
    if body.node >= len(node_ids):
        raise HTTPException(
            404, f"no node {body.node} in job {job_id}: attempt {attempt} has {len(node_ids)} nodes"
        )
    node_id = node_ids[body.node]
    rate = (body.rate or "").strip()
    if body.action == "slow-link":
        if not rate:
            raise HTTPException(422, "slow-link needs a rate (tc syntax, e.g. 20mbit; 0 lifts it)")
        if rate != "0":
            from orchestrator.launchers.netns import parse_rate

            try:
                parse_rate(rate)
            except ValueError as e:
                raise HTTPException(422, str(e)) from None
    elif body.rate is not None:
        raise HTTPException(422, f"rate is for slow-link, not {body.action}")
    at = datetime.now().astimezone().isoformat()
    try:
        if body.action == "partition":
            done = launcher.partition_node(job_id, node_id, seconds=body.seconds)
        elif body.action == "slow-link":
            done = launcher.slow_link(job_id, node_id, rate, seconds=body.seconds)
        else:
            done = launcher.heal_node(job_id, node_id)
    except ValueError as e:  # a rate tc refused after all
        raise HTTPException(422, str(e)) from None
    except LaunchError as e:  # e.g. the node's host was released meanwhile
        raise HTTPException(409, str(e)) from None
    return {"action": body.action, **done, "at": at}


@router.get("/placement-history")
def placement_history(session: SessionDep) -> dict[str, Any]:
    """The placement failures the planner weighs (preemptions, lost nodes, stockouts
    of every job, last 7 days): what ``skyresume plan`` ranks with, as SELECT does."""
    from orchestrator.store.snapshot import placement_history as history

    items = [
        {
            "cloud": f.cloud,
            "region": f.region,
            "instance_type": f.instance_type,
            "at": f.at.isoformat(),
            "failure_class": f.failure_class,
        }
        for f in history(session, repo.utcnow())
    ]
    return {"items": items}


class StockoutIn(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, doc: Any) -> Any:
        return refuse_unstorable(doc)

    region: str = Field(min_length=1, max_length=64)
    seconds: float = Field(default=600.0, ge=0, le=86400)
    """How long the region refuses launches (0 lifts the stockout)."""


@router.post("/chaos/stockout")
def chaos_stockout(body: StockoutIn, request: Request) -> dict[str, Any]:
    """Make a local region refuse launches for lack of capacity, as a cloud does."""
    launcher: ChaosLauncher | None = request.app.state.launcher
    if launcher is None or not launcher.abilities.chaos:
        raise HTTPException(409, "chaos needs the local launcher (skyresume serve, launcher=local)")
    try:
        launcher.stockout(body.region, seconds=body.seconds)
    except LaunchError as e:
        raise HTTPException(422, str(e)) from None
    return {"action": "stockout", "region": body.region, "seconds": body.seconds}


def _rank_pid(session: SessionDep, job_id: str, node_id: str, rank: int | None) -> int:
    node = session.scalars(
        select(Node).where(Node.job_id == job_id, Node.node_id == node_id)
    ).first()
    listed = ((node.progress or {}).get("ranks") or []) if node is not None else []
    ranks = [r for r in listed if isinstance(r, dict)]
    if not ranks:
        raise HTTPException(409, f"node {node_id} has not reported its ranks yet")
    if rank is None:
        chosen = ranks[0]
    else:
        chosen = next((r for r in ranks if r.get("rank") == rank), None)
        if chosen is None:
            have = ", ".join(str(r.get("rank")) for r in ranks)
            raise HTTPException(422, f"rank {rank} is not on {node_id} (it has ranks {have})")
    pid = chosen.get("pid")
    if not isinstance(pid, int):
        raise HTTPException(409, f"the agent of {node_id} has not reported rank pids yet")
    return pid
