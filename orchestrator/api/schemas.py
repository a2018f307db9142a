"""Request and response bodies of API v1."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# SQLite hands back naive datetimes; everything stored is UTC, so say so on the wire.
UtcDatetime = Annotated[
    datetime, AfterValidator(lambda d: d if d.tzinfo else d.replace(tzinfo=UTC))
]


class TransitionOut(BaseModel):
    from_status: str | None
    to_status: str
    reason: str | None
    at: UtcDatetime


class JobOut(BaseModel):
    id: str
    name: str
    status: str
    status_reason: str | None
    restart_count: int
    created_at: UtcDatetime
    updated_at: UtcDatetime
    spec: dict[str, Any]


class JobDetail(JobOut):
    transitions: list[TransitionOut]


class JobPage(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    idempotency_key: str = Field(min_length=1, max_length=128)
    """Same key twice = one event. Agents use e.g. ``<node>:<notice-id>``."""
    kind: str = Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_.\-]*$")
    failure_class: str | None = Field(default=None, max_length=64)
    node_id: str | None = Field(default=None, max_length=64)
    rank: int | None = Field(default=None, ge=0)
    message: str | None = Field(default=None, max_length=65536)
    details: dict[str, Any] = Field(default_factory=dict)
    occurred_at: datetime | None = None


class EventOut(BaseModel):
    id: int
    job_id: str
    idempotency_key: str
    kind: str
    failure_class: str | None
    node_id: str | None
    rank: int | None
    message: str | None
    details: dict[str, Any]
    occurred_at: UtcDatetime
    recorded_at: UtcDatetime


class EventPage(BaseModel):
    items: list[EventOut]
    next_cursor: int
    """Pass as ``after`` to get only newer events."""
