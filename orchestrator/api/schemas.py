"""Request and response bodies of API v1, and the bounds every input has.

A body is checked whole before its fields (``refuse_unstorable``: no NUL, no unpaired
surrogate, no NaN/Infinity, no integer beyond 64 bits, free-form JSON at most
``MAX_JSON_DEPTH`` deep), and every integer that reaches SQL has an upper bound that
fits its column: without one, PostgreSQL answered a list offset of 2**63 with a
server error, and SQLite could not bind a rank beyond 64 bits.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    field_validator,
    model_validator,
)

from orchestrator.domain.spec import INT32_MAX, INT64_MAX, refuse_unstorable

#: Query bounds: ``offset`` counts rows (a 32-bit count is more than any table here),
#: ``after`` is a cursor over 64-bit ids.
MAX_OFFSET = INT32_MAX
MAX_CURSOR = INT64_MAX
#: Node ids (path and bodies): one path segment, never ``..`` (``no_parent_segment``).
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
#: The years a timestamp may name: both databases and Python read them back in UTC
#: (9999-12-31T23:00-05:00 is year 10000 in UTC, which Python cannot hold).
_YEARS = (1970, 9000)


def _utc(d: datetime) -> datetime:
    d = d if d.tzinfo else d.replace(tzinfo=UTC)
    if not _YEARS[0] <= d.year <= _YEARS[1]:  # far from 1 and 9999: no offset overflows
        raise ValueError(f"{d.isoformat()} is outside the years {_YEARS[0]}-{_YEARS[1]}")
    return d


def no_parent_segment(v: str) -> str:
    if ".." in v:
        raise ValueError(f"{v[:80]!r}: a node id may not contain '..' (no path traversal)")
    return v


#: A node id in a body or a path.
NodeId = Annotated[
    str,
    Field(min_length=1, max_length=64, pattern=NODE_ID_PATTERN),
    AfterValidator(no_parent_segment),
]


def _not_a_number(v: Any) -> Any:
    # pydantic reads 0 (and true) as 1970-01-01: a client's bug, not a time it meant.
    if isinstance(v, bool | int | float):
        raise ValueError("a timestamp is an ISO 8601 string, not a number")
    return v


#: A timestamp a client sends: an ISO 8601 string, naive means UTC, and its year is
#: in ``_YEARS``.
InDatetime = Annotated[datetime, BeforeValidator(_not_a_number), AfterValidator(_utc)]
#: An integer that is one in the JSON: ``false`` and ``1.0`` are refused, not coerced.
StrictInt = Annotated[int, Strict()]

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

    @field_validator("spec")
    @classmethod
    def _no_secret_values(cls, v: dict[str, Any]) -> dict[str, Any]:
        """A job's ``task.secrets`` never leave the service: names only."""
        task = v.get("task")
        if isinstance(task, dict) and task.get("secrets"):
            v = {**v, "task": {**task, "secrets": {k: "<redacted>" for k in task["secrets"]}}}
        return v


class JobDetail(JobOut):
    transitions: list[TransitionOut]


class JobPage(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    idempotency_key: str = Field(min_length=1, max_length=128)
    """Same key twice = one event. Agents use e.g. ``<node>:<notice-id>``."""
    kind: str = Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_.\-]*$")
    failure_class: str | None = Field(default=None, max_length=64)
    node_id: NodeId | None = None
    rank: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)
    message: str | None = Field(default=None, max_length=65536)
    details: dict[str, Any] = Field(default_factory=dict)
    """Free-form JSON: at most ``MAX_JSON_DEPTH`` deep and ``MAX_JSON_CHARS`` large."""
    occurred_at: InDatetime | None = None

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, doc: Any) -> Any:
        return refuse_unstorable(doc)


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
