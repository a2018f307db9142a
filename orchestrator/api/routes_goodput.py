"""/v1/jobs/{id}/goodput: where a job's wall time and money went, incident by incident.

The figures and their sources are described in :mod:`orchestrator.store.goodput`.
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.api.deps import OperatorDep, SessionDep
from orchestrator.store import repo
from orchestrator.store.goodput import InconsistentHistory, job_goodput

router = APIRouter(prefix="/v1", dependencies=[OperatorDep], tags=["goodput"])


class _FromStore(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ProtocolStepOut(_FromStore):
    step: str
    started_at: datetime
    finished_at: datetime | None = Field(description="null while the step runs")
    seconds: float
    outcome: str | None = Field(description="ok | failed | skipped; null while running")
    detail: str | None


class AttemptOut(_FromStore):
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
    step_seconds: float | None = Field(description="slowest rank's step time, last heartbeat")
    usd: float | None = Field(description="up time x nodes x price; null if unpriced")


class IncidentOut(_FromStore):
    id: int = Field(description="the failure event the incident started with")
    failure_class: str
    kind: str
    occurred_at: datetime
    node_id: str | None
    message: str | None
    failed_attempt: int | None
    recovered_by: int | None
    cloud: str | None
    region: str | None
    instance_type: str | None
    last_step: int | None = Field(description="highest step any rank had reported")
    resume_step: int | None
    steps_lost: int | None = Field(description="last_step - resume_step; null until resumed")
    ongoing: bool
    started_at: datetime
    mttr_seconds: float = Field(description="detection to validated relaunch (or now)")
    step_seconds: dict[str, float] = Field(description="seconds per protocol step, in order")
    steps: list[ProtocolStepOut]
    lost_work_seconds: float
    usd: float | None = Field(description="(MTTR + lost work) at the failed attempt's price")


class GoodputOut(_FromStore):
    job_id: str
    name: str
    status: str
    restart_count: int
    started_at: datetime = Field(description="submission")
    ended_at: datetime = Field(description="the terminal transition, or now for a live job")
    live: bool
    effective_training_fraction: float = Field(description="productive / wall (Meta's term)")
    wall_seconds: float
    productive_seconds: float
    idle_seconds: float
    failure_seconds: float
    lost_work_seconds: float
    checkpoint_seconds: float
    step_seconds: float | None
    total_usd: float | None
    lost_usd: float | None
    attempts: list[AttemptOut]
    incidents: list[IncidentOut]


@router.get("/jobs/{job_id}/goodput", response_model=GoodputOut)
def get_goodput(job_id: str, session: SessionDep) -> GoodputOut:
    """Productive, idle, failure and lost-work time; each incident's MTTR by protocol
    step, steps lost and dollars."""
    try:
        report = job_goodput(session, job_id)
    except repo.NotFound as e:
        raise HTTPException(404, str(e)) from None
    except InconsistentHistory as e:
        raise HTTPException(500, f"cannot account goodput: {e}") from None
    return GoodputOut.model_validate(report)
