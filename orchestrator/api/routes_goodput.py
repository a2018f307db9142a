"""/v1/jobs/{id}/goodput: where a job's wall time and money went, incident by incident.

The figures and their sources are described in :mod:`orchestrator.store.goodput`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer

from orchestrator.api.deps import OperatorDep, SessionDep
from orchestrator.api.strict import StrictQueryRoute
from orchestrator.store import repo
from orchestrator.store.goodput import InconsistentHistory, job_goodput

router = APIRouter(
    prefix="/v1", dependencies=[OperatorDep], tags=["goodput"], route_class=StrictQueryRoute
)

# Rounded on the wire: milliseconds, cents; "119.69999999999999 s" helps nobody.
Seconds = Annotated[float, PlainSerializer(lambda x: round(x, 3), return_type=float)]
OptSeconds = Annotated[float | None, PlainSerializer(lambda x: None if x is None else round(x, 3))]
Usd = Annotated[float | None, PlainSerializer(lambda x: None if x is None else round(x, 2))]
Fraction = Annotated[float, PlainSerializer(lambda x: round(x, 5), return_type=float)]
Hours = Annotated[float, PlainSerializer(lambda x: round(x, 4), return_type=float)]
Rate = Annotated[float | None, PlainSerializer(lambda x: None if x is None else round(x, 6))]


class _FromStore(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ProtocolStepOut(_FromStore):
    step: str
    started_at: datetime
    finished_at: datetime | None = Field(description="null while the step runs")
    seconds: Seconds
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
    step_seconds: OptSeconds = Field(description="slowest rank's step time, last heartbeat")
    usd: Usd = Field(description="(node-hours + spare node-hours) x price; null if unpriced")
    training_nodes: int = Field(description="nodes whose ranks trained (num_nodes unless shrunk)")
    shrunk: bool = Field(description="placed for num_nodes, trained on training_nodes")
    spare_nodes: int = Field(description="standby spares beside a shrunk group (else 0)")
    spare_released: str | None = Field(description="why the spares were given back, if they were")
    wall_seconds: Seconds = Field(description="started to ended (or now): what is billed")
    training_seconds: Seconds = Field(description="nodes up to its end or the next incident")
    node_hours: Hours = Field(description="training nodes x wall time")
    spare_node_hours: Hours = Field(description="spares x the time they were held")
    steps_per_second: Rate = Field(description="the phase's throughput; null if unknown")
    throughput_source: str | None = Field(
        description="progress_samples (the run's series) or step_time (1 / step_seconds)"
    )


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
    mttr_seconds: Seconds = Field(description="detection to validated relaunch (or now)")
    step_seconds: dict[str, Seconds] = Field(description="seconds per protocol step, in order")
    steps: list[ProtocolStepOut]
    lost_work_seconds: Seconds
    usd: Usd = Field(description="(MTTR + lost work) at the failed attempt's price")
    planned: bool = Field(description="a planned reshape (elastic_grow), not a failure")


class GoodputOut(_FromStore):
    job_id: str
    name: str
    status: str
    restart_count: int
    started_at: datetime = Field(description="submission")
    ended_at: datetime = Field(description="the terminal transition, or now for a live job")
    live: bool
    effective_training_fraction: Fraction = Field(description="productive / wall (Meta's term)")
    wall_seconds: Seconds
    productive_seconds: Seconds
    idle_seconds: Seconds
    failure_seconds: Seconds
    lost_work_seconds: Seconds
    checkpoint_seconds: Seconds
    step_seconds: OptSeconds
    total_usd: Usd
    lost_usd: Usd
    shrunk_seconds: Seconds = Field(description="training time on fewer than the spec's nodes")
    reshape_seconds: Seconds = Field(description="of failure_seconds, planned reshapes (grows)")
    node_hours: Hours = Field(description="every attempt's training node-hours")
    spare_node_hours: Hours = Field(description="shrunk attempts' standby spares' node-hours")
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
