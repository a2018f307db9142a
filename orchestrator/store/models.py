"""SQLAlchemy 2 models. Alembic (``migrations/``) owns the schema; a test proves the
migrated schema and these models agree.

History is append-only: ``job_transitions``, ``failure_events`` and
``protocol_steps`` rows are inserted, and a protocol step's ``finished_at`` and
``outcome`` are filled once, when it ends. The ``jobs`` row holds only the current
status.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Explicit constraint names so that SQLite and PostgreSQL migrations agree.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments INTEGER PRIMARY KEY; BigInteger elsewhere.
IdType = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(63), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict] = mapped_column(JSON)
    task_yaml: Mapped[str | None] = mapped_column(Text)
    """The SkyPilot task YAML (``task.skypilot_yaml``) as read at submit: what every
    launch runs, whatever becomes of the file (launchers/user_task.py). None for a
    template job, and for a job stored before revision 0009 (it reads its path)."""
    status_reason: Mapped[str | None] = mapped_column(Text)
    restart_count: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class JobTransition(Base):
    __tablename__ = "job_transitions"

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class JobSubmission(Base):
    """An ``Idempotency-Key`` a ``POST /v1/jobs`` came with, and the job it made: the
    same key again (a client's retry after a lost answer) returns that job instead of
    making a second one; with another spec it is refused."""

    __tablename__ = "job_submissions"

    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    spec_sha256: Mapped[str] = mapped_column(String(64))
    """Of the spec as stored (canonical JSON): what "the same submission" means."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class FailureEvent(Base):
    """One observed failure (or notice). Posting the same idempotency key twice
    returns the first row and stores nothing new."""

    __tablename__ = "failure_events"
    __table_args__ = (UniqueConstraint("job_id", "idempotency_key"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    idempotency_key: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(64))
    failure_class: Mapped[str | None] = mapped_column(String(64))
    node_id: Mapped[str | None] = mapped_column(String(64))
    rank: Mapped[int | None] = mapped_column(Integer)
    message: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Attempt(Base):
    """One launch or relaunch, with the plan it ran on."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    cloud: Mapped[str] = mapped_column(String(32))
    region: Mapped[str] = mapped_column(String(64))
    zone: Mapped[str | None] = mapped_column(String(64))
    instance_type: Mapped[str] = mapped_column(String(64))
    accelerator: Mapped[str | None] = mapped_column(String(64))
    num_nodes: Mapped[int] = mapped_column(Integer)
    spot: Mapped[bool] = mapped_column(Boolean)
    price_per_node_hour: Mapped[float | None] = mapped_column(Float)
    knobs: Mapped[dict] = mapped_column(JSON, default=dict)
    resume_step: Mapped[int | None] = mapped_column(Integer)
    cluster_name: Mapped[str | None] = mapped_column(String(128))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    end_reason: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="launching")
    """launching | running | stopping | ended"""
    launcher: Mapped[str | None] = mapped_column(String(32))
    handle: Mapped[dict | None] = mapped_column(JSON)
    """What the launcher needs to query or tear the attempt down (LaunchHandle)."""
    validated_step: Mapped[int | None] = mapped_column(Integer)
    """The step every rank reported resuming at, once all agreed."""
    incident_id: Mapped[int | None] = mapped_column(Integer)
    """The failure event this attempt recovers from (None for the first launch)."""


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (UniqueConstraint("job_id", "node_id"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(String(64))
    node_rank: Mapped[int] = mapped_column(Integer)
    address: Mapped[str | None] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    progress: Mapped[dict] = mapped_column(JSON, default=dict)
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class NodeCommand(Base):
    """A command for the agents of one attempt (``node_id`` None = every node).

    ``id`` is the cursor agents long-poll with; commands are kept, so an agent that
    reconnects gets what it missed."""

    __tablename__ = "node_commands"
    __table_args__ = (Index("ix_node_commands_job_attempt", "job_id", "attempt"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str | None] = mapped_column(String(64))
    type: Mapped[str] = mapped_column(String(32))
    args: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Lease(Base):
    """Leader election for the reconciler: one holder per name until ``expires_at``."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Grows by one each time the lease changes holder: the fencing token."""


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # partial | complete | invalid | deleted
    manifest_digest: Mapped[str | None] = mapped_column(String(64))
    world_size: Mapped[int | None] = mapped_column(Integer)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ProtocolStep(Base):
    """One step of the restart protocol for one incident, with its timing."""

    __tablename__ = "protocol_steps"
    __table_args__ = (
        UniqueConstraint("incident_id", "step"),
        Index("ix_protocol_steps_job", "job_id"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    incident_id: Mapped[int] = mapped_column(ForeignKey("failure_events.id", ondelete="CASCADE"))
    step: Mapped[str] = mapped_column(String(32))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    outcome: Mapped[str | None] = mapped_column(String(16))  # ok | failed | skipped
    detail: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict | None] = mapped_column(JSON)
    """What the step decided, for the steps after it (confirmed checkpoint, placement)."""


class ApiToken(Base):
    """An operator token, stored as the sha256 of the token (never the token: it is
    printed once, at creation). A revoked token keeps its row, with ``revoked_at``,
    so ``token list`` shows what existed; its name may be used again."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16))
    """viewer | operator | admin (``orchestrator.store.tokens.Role``)"""
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


# One live token per name, so "revoke NAME" means one token (a partial index: a
# revoked token's name may be used again).
Index(
    "ix_api_tokens_live_name",
    ApiToken.name,
    unique=True,
    sqlite_where=ApiToken.revoked_at.is_(None),
    postgresql_where=ApiToken.revoked_at.is_(None),
)


class DashboardSession(Base):
    """A dashboard login: the sha256 of the session id the cookie holds, the role it
    was opened with, and when it ends. ``token_id`` None: opened with the bootstrap
    token. Revoking the token revokes its sessions (and the lookup checks it too)."""

    __tablename__ = "dashboard_sessions"

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    session_hash: Mapped[str] = mapped_column(String(64), unique=True)
    token_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True
    )
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class AgentEnrolment(Base):
    """One node's enrolment: the node exchanged the enrolment token its launch's task
    carried (``sre_...``, stored as its sha256) for the attempt's agent token, at its
    first register. A second register with the same token and node is a replay and is
    refused (``orchestrator/store/tokens.py: use_enrolment``)."""

    __tablename__ = "agent_enrolments"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    used_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    instance_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """sha256 of the agent process's own random id (``RegisterIn.instance``): the same
    agent registering again after its answer was lost is answered again."""


class NodeLog(Base):
    """The last lines of one node's agent log or one rank's log, as the agent last
    uploaded them (on request and at exit, so a dead node's last lines are kept).
    One row per (job, attempt, node, source); an upload replaces the lines."""

    __tablename__ = "node_logs"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "node_id", "source"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(32))
    """``agent`` or ``rank<N>`` (the rank's global number)."""
    rank: Mapped[int | None] = mapped_column(Integer)
    lines: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(String(16))
    """request | exit | periodic: why the agent sent it."""
    uploaded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ProgressSample(Base):
    """One rank's progress at one moment: the run's time series (steps/s, loss, grad
    norm per rank). Appended by the operator loop when a rank's step moved."""

    __tablename__ = "progress_samples"
    __table_args__ = (Index("ix_progress_samples_job_at", "job_id", "at"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    step: Mapped[int] = mapped_column(Integer)
    step_time: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)


class AlertWebhook(Base):
    """Where alerts go: ``job_id`` None = every job. The secret signs each body
    (HMAC-SHA256); it is kept because signing needs it."""

    __tablename__ = "alert_webhooks"

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), index=True
    )
    url: Mapped[str] = mapped_column(Text)
    secret: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class AlertOutbox(Base):
    """One alert for one webhook, written before it is sent: a restart loses none,
    and the unique (event, target) key means an event is queued once."""

    __tablename__ = "alert_outbox"
    __table_args__ = (
        UniqueConstraint("event_key", "target"),
        Index("ix_alert_outbox_due", "delivered_at", "next_try_at"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    event_key: Mapped[str] = mapped_column(String(128))
    """``incident_opened:<id>``, ``job_failed:<job>``, ...: the event, once."""
    kind: Mapped[str] = mapped_column(String(32))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    target: Mapped[str] = mapped_column(String(128))
    """``webhook:<id>`` or ``global:<sha256 of the URL>[:16]``."""
    url: Mapped[str] = mapped_column(Text)
    body: Mapped[dict] = mapped_column(JSON)
    tries: Mapped[int] = mapped_column(Integer, default=0)
    next_try_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
