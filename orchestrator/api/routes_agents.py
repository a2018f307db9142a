"""Agent -> service routes: register, heartbeat, commands (long-poll), reports, and
the agent package nodes install (``/v1/agent/package``, ``/v1/agent/dist/<wheel>``).

The protocol is written down in docs/agent.md. Auth is the agent token of this
attempt (``auth.job_token``), which opens only this attempt's routes, or an
operator token of role operator or above (:func:`require_job_access`).

Register checks the agent: one whose protocol (``contract.AGENT_PROTOCOL``) or
skyresume version differs from the service's gets 409 with both named, and the
``X-Skyresume-Refused: agent-version`` header that tells it apart from a superseded
attempt; the agent then exits instead of running half-working.

The package routes need no token, on purpose: pip on a fresh node fetches the wheel
with a plain URL, and a token in that URL would sit in SkyPilot's task envs and logs.
They serve the service's own source code (no secret: the same code as the
repository, and nothing from ``home`` but the built file), only the one file whose
name matches the current build (the request's name is compared, never joined to a
path), and a build happens at most once per source digest, so an anonymous caller
can neither read other files nor make the service build again and again. Integrity
comes from the hash: nodes get the URL with ``#sha256=``, which pip checks.

The command long-poll is async. One shared watch reads the newest command every
~100 ms for all waiting requests; a waiter queries its own commands only when that
changes (and once a second regardless). Each read is in a worker thread with its own
short session, so no connection or transaction is held across the waits and a
waiting agent never blocks other requests (64 nodes waiting at once is the normal
state of a running job).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from orchestrator import __version__
from orchestrator import package as agent_package
from orchestrator.api.auth import (
    AGENT_TOKEN_PREFIX,
    bearer_token,
    job_token,
    node_token,
    operator_principal,
    token_matches,
)
from orchestrator.api.backpressure import heartbeat_limiter
from orchestrator.api.deps import forbid_unless, unauthorized
from orchestrator.api.limits import validation_error_response
from orchestrator.api.schemas import (
    MAX_CURSOR,
    NODE_ID_PATTERN,
    NodeId,
    StrictInt,
    no_parent_segment,
)
from orchestrator.contract import AGENT_PROTOCOL, CommandType
from orchestrator.domain.roles import Role
from orchestrator.domain.spec import INT32_MAX, INT64_MAX, MAX_DETAIL_CHARS, refuse_unstorable
from orchestrator.store import agents, tokens
from orchestrator.store.db import read_session
from orchestrator.store.liveness import LiveHeartbeats, Verdict
from orchestrator.store.models import Attempt, NodeCommand
from orchestrator.store.repo import NotFound

log = logging.getLogger(__name__)

#: The longest a command long-poll may wait; agents ask for less.
MAX_WAIT_S = 30.0
#: How often the command watch reads the newest command (for all waiters at once).
POLL_INTERVAL_S = 0.1
#: How often a waiting long-poll re-checks its own commands and that its attempt is
#: still current, whatever the watch says.
RECHECK_S = 2.0
#: Worker threads shared by all waiting long-polls (fewer than the pool's connections).
LONG_POLL_THREADS = 4
#: The heartbeat period the service expects (an agent may be told to use it).
HEARTBEAT_S = 1.0


async def require_job_access(
    request: Request,
    job_id: str,
    attempt: Annotated[int, Path(ge=0, le=INT32_MAX, description="attempt number")],
    node_id: str,
) -> None:
    """This attempt's agent token, or an operator token of role operator or above.

    The agent token is checked first, on the event loop, and costs no query
    (``auth.job_token``): it is what every heartbeat carries. One for another attempt
    (a node of an older one) is 401; its own attempt, once superseded or finished, is
    the handlers' 409, on which the agent stops its ranks and exits. Only an operator
    token reads SQL, in a worker thread."""
    token = bearer_token(request)
    if token is None:
        raise unauthorized("missing bearer token (Authorization: Bearer <token>)")
    if token.startswith(tokens.ENROLMENT_PREFIX):
        # What a launched task carries: it opens register alone, which spends it for
        # that node and hands back the attempt's agent token (``register``).
        if request.method == "POST" and request.url.path.endswith("/register"):
            request.state.enrolment = token
            return
        raise unauthorized(
            "an enrolment token opens only register (once per node); every other request "
            "carries the agent token that register returned"
        )
    if token.startswith(AGENT_TOKEN_PREFIX):
        secret = request.app.state.token
        if token_matches(token, node_token(secret, job_id, attempt, node_id)):
            return  # what register hands a node: its own routes only
        if token_matches(token, job_token(secret, job_id, attempt)):
            return  # the attempt's token: the service's own, never handed to a node
        raise unauthorized(
            f"this agent token is not for attempt {attempt} of job {job_id}, node {node_id}"
        )
    principal = await anyio.to_thread.run_sync(operator_principal, request, token)
    if principal is None:
        raise unauthorized("invalid token for this job (unknown or revoked)")
    forbid_unless(request, principal, Role.operator)


class _AgentRoute(APIRoute):
    """422s whose echoed input holds NaN would crash the default handler (JSON has no
    NaN); this route class answers them with the value spelled as a string, and cut
    (``limits.validation_detail``: a 50 MB bad body must not come back as 150 MB)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return validation_error_response(e)

        return route


_node_router = APIRouter(
    prefix="/v1/jobs/{job_id}/attempts/{attempt}/nodes/{node_id}",
    tags=["agents"],
    dependencies=[Depends(require_job_access)],
    route_class=_AgentRoute,
)
#: No token (see the module docstring): what pip on a new node fetches.
_package_router = APIRouter(prefix="/v1/agent", tags=["agents"])
#: The agents' side of the API: the node routes and the package routes.
router = APIRouter()

AttemptPath = Annotated[int, Path(ge=0, le=INT32_MAX, description="attempt number")]
NodePath = Annotated[
    str,
    Path(min_length=1, max_length=64, pattern=NODE_ID_PATTERN),
    AfterValidator(no_parent_segment),
]
#: Integers that reach 32-bit columns or sit beside them (steps, ranks, pids, codes).
_I32 = INT32_MAX
#: A free-form value inside a report (a notice's raw answer, an anomaly's numbers).
_Detail = Annotated[Any, AfterValidator(lambda v: refuse_unstorable(v, max_chars=MAX_DETAIL_CHARS))]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Checked(_Body):
    """A whole request body, walked once before its fields (``refuse_unstorable``):
    no NUL, unpaired surrogate, NaN, integer beyond 64 bits or JSON nested deeper
    than ``MAX_JSON_DEPTH`` anywhere in it, free-form ``detail`` and ``data`` included."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, doc: Any) -> Any:
        return refuse_unstorable(doc)


class RankInfo(_Body):
    rank: StrictInt = Field(ge=0, le=_I32)
    local_rank: StrictInt = Field(ge=0, le=_I32)
    pid: StrictInt | None = Field(default=None, ge=1, le=_I32)


class RegisterIn(_Checked):
    node_rank: StrictInt = Field(ge=0, le=_I32)
    hostname: str | None = Field(default=None, max_length=255)
    agent_pid: StrictInt | None = Field(default=None, ge=1, le=_I32)
    provider: str | None = Field(default=None, max_length=16)
    ranks: list[RankInfo] = Field(default_factory=list, max_length=4096)
    agent_version: str | None = Field(default=None, max_length=64)
    """The agent's ``orchestrator.__version__``; None (an agent older than the check)
    is refused like any other mismatch."""
    agent_build: str | None = Field(default=None, max_length=128)
    """The wheel's source digest, or ``source`` from a checkout (logged, not compared:
    two builds of one version speak the same protocol)."""
    protocol: StrictInt | None = Field(default=None, ge=0, le=_I32)
    """``contract.AGENT_PROTOCOL`` as the agent knows it."""
    instance: str | None = Field(default=None, min_length=16, max_length=64)
    """A random id the agent process drew at start. A register with the same enrolment
    token and the same instance is that agent asking again after its first answer was
    lost, and is answered again; without it, or with another, a spent enrolment token
    is a replay (401)."""


class RegisterOut(BaseModel):
    heartbeat_s: float
    command_cursor: int
    """Long-poll commands after this id (what this node already acknowledged)."""
    agent_token: str | None = None
    """This attempt's agent token, when the register came with an enrolment token (a
    launched task's, spent by this register): every later request carries it."""
    service_version: str = __version__
    protocol: int = AGENT_PROTOCOL


#: Set on a 409 that refuses the agent itself (not a superseded attempt).
REFUSED_HEADER = "X-Skyresume-Refused"
AGENT_VERSION_REFUSED = "agent-version"


def agent_mismatch(agent_version: str | None, protocol: int | None) -> str | None:
    """Why the service refuses this agent (None: it does not).

    What matters: the protocol number (the bodies and their meaning) and the
    skyresume version (the agent and the training library on the node come from the
    same package, and a version is the unit anyone can name and install). The build
    id is not compared: rebuilding the same version changes it without changing the
    protocol, and a checkout's agent (``source``) is fine against its own service."""
    if agent_version == __version__ and protocol == AGENT_PROTOCOL:
        return None
    theirs = (
        f"skyresume {agent_version} (agent protocol {protocol})"
        if agent_version is not None or protocol is not None
        else "an unversioned skyresume (older than the agent protocol check)"
    )
    return (
        f"agent version mismatch: this node runs {theirs}, the service runs skyresume "
        f"{__version__} (agent protocol {AGENT_PROTOCOL}); install the service's own agent "
        "package on the node (GET /v1/agent/package says where)"
    )


# Non-finite floats are refused: PostgreSQL's JSON type cannot store NaN, and an
# agent sends null for a NaN loss (the anomaly report says what happened).
_Float = Annotated[float, Field(allow_inf_nan=False)]


class ResumedInfo(_Body):
    step: int | None = Field(default=None, ge=-_I32 - 1, le=_I32)
    manifest_digest: str | None = Field(default=None, max_length=128)


class RankProgress(_Body):
    rank: int = Field(ge=0, le=_I32)
    local_rank: int = Field(ge=0, le=_I32)
    pid: int | None = Field(default=None, ge=1, le=_I32)
    alive: bool
    step: int | None = Field(default=None, ge=-_I32 - 1, le=_I32)
    step_time: _Float | None = None
    loss: _Float | None = None
    grad_norm: _Float | None = None
    max_steps: int | None = Field(default=None, ge=0, le=_I32)
    """Where the run ends, when the rank says (the work left: elastic choices)."""
    report_age_s: _Float | None = None
    """Seconds since this rank's last datagram (None: it never sent one)."""
    resumed: ResumedInfo | None = None
    """What the rank loaded, from its ``resumed`` datagram (validation, protocol step 7)."""
    exit_code: int | None = Field(default=None, ge=-_I32 - 1, le=_I32)
    signal: str | None = Field(default=None, max_length=16)
    cpu_idle_s: _Float | None = Field(default=None, ge=0)
    """Seconds since the rank's process last used CPU (None: not measured): the work a
    script that sends no reports shows."""
    regrouping: int | None = Field(default=None, ge=0, le=_I32)
    """Elastic warm regroup: the generation the rank left and is waiting to re-form
    from (its ``regroup`` datagram); None when it is in a group."""


class OwnCheckpointSeen(_Body):
    """What the agent found of ``checkpoint.own`` before its ranks started."""

    path: str = Field(max_length=4096)
    found: bool
    """The path existed on this node, and ``<resume_arg> <path>`` was appended."""


class LastCheckpoint(_Body):
    step: int = Field(ge=0, le=_I32)
    path: str | None = Field(default=None, max_length=4096)
    uploaded_uri: str | None = Field(default=None, max_length=4096)


class HeartbeatIn(_Checked):
    state: Literal["starting", "running", "stopping", "exited"]
    ranks: list[RankProgress] = Field(default_factory=list, max_length=4096)
    last_checkpoint: LastCheckpoint | None = None
    acked_command: int | None = Field(default=None, ge=0, le=INT64_MAX)
    own_checkpoint: OwnCheckpointSeen | None = None


class CommandOut(BaseModel):
    seq: int
    type: str
    args: dict[str, Any]


class CommandsOut(BaseModel):
    commands: list[CommandOut]


class _Report(_Checked):
    key: str = Field(min_length=1, max_length=64)


class PreemptionNoticeReport(_Report):
    kind: Literal["preemption_notice"]
    provider: str = Field(max_length=16)
    notice_kind: str = Field(max_length=32)
    deadline: str | None = Field(default=None, max_length=64)
    detail: _Detail = None


class RankExitReport(_Report):
    kind: Literal["rank_exit"]
    rank: int = Field(ge=0, le=_I32)
    local_rank: int = Field(ge=0, le=_I32)
    exit_code: int | None = Field(ge=-_I32 - 1, le=_I32)
    signal: str | None = Field(default=None, max_length=16)
    log_tail: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=200
    )
    killed_by_agent: bool = False
    """The agent SIGKILLed it when the grace period after SIGTERM ran out."""


class AnomalyReport(_Report):
    kind: Literal["anomaly"]
    rank: int = Field(ge=0, le=_I32)
    finding: Literal["nan_divergence", "loss_spike", "slow_peer", "silent_corruption"]
    step: int | None = Field(default=None, ge=-_I32 - 1, le=_I32)
    detail: _Detail = None


class CheckpointReport(_Report):
    kind: Literal["checkpoint"]
    step: int = Field(ge=0, le=_I32)
    path: str | None = Field(default=None, max_length=4096)
    uploaded_uri: str | None = Field(default=None, max_length=4096)
    world_size: int | None = Field(default=None, ge=1, le=_I32)
    blocking_s: _Float | None = Field(default=None, ge=0, le=_I32)
    """How long the save blocked training (the interval advisor reads it)."""


class NodeExitReport(_Report):
    kind: Literal["node_exit"]
    exit_code: int = Field(ge=-_I32 - 1, le=_I32)
    reason: str = Field(max_length=1024)
    saved_step: int | None = Field(default=None, ge=-_I32 - 1, le=_I32)


class RankEvidence(_Body):
    """One rank's stack and state, taken before the kill (orchestrator/agent/evidence.py)."""

    rank: int = Field(ge=0, le=_I32)
    local_rank: int | None = Field(default=None, ge=0, le=_I32)
    pid: int | None = Field(default=None, ge=1, le=_I32)
    state: str | None = Field(default=None, max_length=4)
    """``/proc`` state letter (``T``: stopped); None: the rank had exited."""
    wchan: str | None = Field(default=None, max_length=128)
    tool: str | None = Field(default=None, max_length=32)
    stack: str = Field(default="", max_length=agents.EVIDENCE_STACK_CAP)
    truncated: bool = False
    error: str | None = Field(default=None, max_length=1024)
    op: str | None = Field(default=None, max_length=128)
    """The collective the main thread waits in (``all_reduce``...), or ``backward``."""
    where: str | None = Field(default=None, max_length=1024)
    called_from: str | None = Field(default=None, max_length=1024)
    """The user's frame that led to ``op``."""
    took_s: _Float | None = None


class EvidenceReport(_Report):
    kind: Literal["evidence"]
    trigger: str = Field(max_length=256)
    ranks: list[RankEvidence] = Field(default_factory=list, max_length=agents.EVIDENCE_MAX_RANKS)
    flight_recorder: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    findings: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=512
    )
    took_s: _Float | None = None


class HealthCheckResult(_Body):
    name: str = Field(min_length=1, max_length=64)
    status: Literal["pass", "fail", "skip", "unknown"]
    detail: str = Field(default="", max_length=1024)
    took_s: _Float | None = None
    data: dict[str, _Detail] = Field(default_factory=dict)


class HealthCheckReport(_Report):
    kind: Literal["health_check"]
    checks: list[HealthCheckResult] = Field(min_length=1, max_length=64)


class StagedReport(_Report):
    """The agent staged ``SKYRESUME_RUN_STAGE_FROM`` onto its disk before torchrun (or
    could not: then torchrun never started and the node exits 78)."""

    kind: Literal["staged"]
    node_id: NodeId
    step: int | None = Field(ge=0, le=_I32)
    ok: bool
    detail: str = Field(max_length=1024)
    bytes: int = Field(ge=0, le=INT64_MAX)
    """Bytes downloaded (0: every file was already on the node's disk, verified)."""
    seconds: _Float = Field(ge=0, le=_I32)
    uri: str = Field(max_length=4096)


Report = Annotated[
    PreemptionNoticeReport
    | RankExitReport
    | AnomalyReport
    | CheckpointReport
    | NodeExitReport
    | EvidenceReport
    | HealthCheckReport
    | StagedReport,
    Field(discriminator="kind"),
]


class ReportOut(BaseModel):
    event_id: int
    created: bool


@contextlib.contextmanager
def _transaction(request: Request) -> Iterator[Session]:
    """One transaction, committed and its connection returned *inside* the handler.

    Not ``SessionDep``: a yield dependency keeps the connection until after FastAPI
    has serialized the response, which needs a worker thread of its own. With 64
    agents, threads waiting for a pooled connection held every worker while the
    connections' owners waited for a worker to finish: a deadlock that the pool's
    30 s timeout broke (found by bench/fanout.py at 64 nodes)."""
    with request.app.state.sessionmaker.begin() as session:
        yield session


def _translate(e: Exception) -> HTTPException:
    if isinstance(e, NotFound):
        return HTTPException(404, str(e))
    if isinstance(e, agents.NotCurrent):
        return HTTPException(409, str(e))
    return HTTPException(422, str(e))


class NotLaunched(ValueError):
    """A register for a node id its attempt's launch does not have."""


def _require_launched_node(session: Session, job_id: str, attempt: int, node_id: str) -> None:
    """:class:`NotLaunched` unless ``node_id`` is one of the node ids the attempt's
    launch named (its handle). A made-up id registered once, and the reconciler then
    counted it as the attempt's node and declared the real, still-provisioning one
    lost. An attempt whose launch is not recorded yet (a node that came up before the
    launcher's answer was stored) is checked by its token alone."""
    handle = session.scalar(
        select(Attempt.handle).where(Attempt.job_id == job_id, Attempt.number == attempt)
    )
    launched = (handle or {}).get("node_ids") or []
    if launched and node_id not in launched:
        raise NotLaunched(
            f"node {node_id!r} is not a node of attempt {attempt} of job {job_id} "
            f"(its launch has {', '.join(map(str, launched[:16]))})"
        )


@_node_router.post("/register", response_model=RegisterOut)
def register(
    request: Request, job_id: str, attempt: AttemptPath, node_id: NodePath, body: RegisterIn
) -> RegisterOut:
    """An agent announces its node (again after a restart). 409: not the current
    attempt, or an agent of another version or protocol (header ``X-Skyresume-Refused``)."""
    refused = agent_mismatch(body.agent_version, body.protocol)
    if refused is not None:
        log.warning("refused the agent of node %s (job %s): %s", node_id, job_id, refused)
        raise HTTPException(
            status.HTTP_409_CONFLICT, refused, headers={REFUSED_HEADER: AGENT_VERSION_REFUSED}
        )
    live: LiveHeartbeats = request.app.state.liveness
    enrolment: str | None = getattr(request.state, "enrolment", None)
    # The node's batched beat goes first, in this transaction: the cursor handed back
    # must count its newest ack, and a later flush of it must not undo the register.
    pending = live.take(job_id, node_id)
    try:
        with _transaction(request) as session:
            if enrolment is not None:
                # Spent in the register's own transaction: a register that fails (409,
                # 404) leaves the enrolment for the node to try again.
                tokens.use_enrolment(
                    session, request.app.state.token, enrolment, job_id, attempt, node_id,
                    instance=body.instance,
                )  # fmt: skip
            if pending is not None:
                agents.store_heartbeats(session, [pending])
            _require_launched_node(session, job_id, attempt, node_id)
            reg = agents.register_node(
                session,
                job_id,
                attempt,
                node_id,
                node_rank=body.node_rank,
                hostname=body.hostname,
                agent_pid=body.agent_pid,
                provider=body.provider,
                ranks=[r.model_dump() for r in body.ranks],
                client_ip=request.client.host if request.client else None,
            )
            cursor = reg.command_cursor
    except BaseException as e:
        if pending is not None:
            live.restore([pending])
        if isinstance(e, NotFound | agents.NotCurrent):
            raise _translate(e) from None
        if isinstance(e, NotLaunched):
            log.warning("refused the register of node %s (job %s): %s", node_id, job_id, e)
            raise HTTPException(status.HTTP_403_FORBIDDEN, str(e)) from None
        if isinstance(e, tokens.EnrolmentRefused):
            log.warning("refused the enrolment of node %s (job %s): %s", node_id, job_id, e)
            raise unauthorized(str(e)) from None
        raise
    live.registered(job_id, attempt, node_id)
    issued = node_token(request.app.state.token, job_id, attempt, node_id) if enrolment else None
    period = max(HEARTBEAT_S, request.app.state.pressure.interval_s)
    return RegisterOut(heartbeat_s=period, command_cursor=cursor, agent_token=issued)


@_node_router.post("/heartbeat")
async def heartbeat(
    request: Request, job_id: str, attempt: AttemptPath, node_id: NodePath, body: HeartbeatIn
) -> dict[str, Any]:
    """One per node per period: its state and every local rank's progress.
    404 when the node is not registered (the agent registers again), 409 when its
    attempt is not the current one.

    No database on this path (store/liveness.py): the beat is checked against the
    in-memory cache and kept for the next batched flush, so 2,048 nodes cost no
    transaction each and the event loop never waits on a connection. Only a cache
    miss (a job this replica has not loaded) reads SQL, in a worker thread of the
    heartbeat path's own (``backpressure.heartbeat_limiter``: other routes cannot take
    them). The answer names ``interval_s`` when the fleet is big enough that agents
    must beat less often than ``HEARTBEAT_S`` (``backpressure.interval_for``)."""
    live: LiveHeartbeats = request.app.state.liveness
    verdict = live.check(job_id, attempt, node_id)
    if verdict is Verdict.MISS:
        if await request.is_disconnected():  # it gave up while queued: spare the read
            return {}
        try:
            verdict = await anyio.to_thread.run_sync(
                live.load, job_id, attempt, node_id, limiter=_heartbeat_threads(request)
            )
        except NotFound as e:
            raise _translate(e) from None
    if verdict is Verdict.NOT_CURRENT:
        # The rare path: one read, for a node that SIGNAL may have held warm (its
        # attempt ended; a ``regroup`` command carries it into the next one).
        if await anyio.to_thread.run_sync(
            _held, request, job_id, attempt, node_id, limiter=_heartbeat_threads(request)
        ):
            return {"held": True}
        raise _translate(
            agents.NotCurrent(f"attempt {attempt} of job {job_id} is not the current attempt")
        )
    if verdict is Verdict.NOT_REGISTERED:
        raise _translate(
            NotFound(f"node {node_id} is not registered for attempt {attempt} of job {job_id}")
        )
    live.record(job_id, attempt, node_id, body.model_dump(mode="json"))
    if not live.batched:  # no flusher runs (an embedded app): write it through now
        await anyio.to_thread.run_sync(live.flush, limiter=_heartbeat_threads(request))
    interval = request.app.state.pressure.interval_s
    return {"interval_s": interval} if interval > HEARTBEAT_S else {}


def _heartbeat_threads(request: Request) -> anyio.CapacityLimiter:
    """The heartbeat path's worker threads (made on first use, inside the loop)."""
    limiter = getattr(request.app.state, "heartbeat_threads", None)
    if limiter is None:
        limiter = request.app.state.heartbeat_threads = heartbeat_limiter()
    return limiter


def _held(request: Request, job_id: str, attempt: int, node_id: str) -> bool:
    with read_session(request.app.state.sessionmaker) as session:
        try:
            return agents.is_held(session, job_id, attempt, node_id)
        except NotFound:
            return False


def _check_commands(
    request: Request, job_id: str, attempt: int, node_id: str, after: int
) -> list[CommandOut]:
    with read_session(request.app.state.sessionmaker) as session:
        cmds = agents.poll_commands(session, job_id, attempt, node_id, after)
        return [
            CommandOut(seq=c.id, type=c.type, args=_command_args(request, job_id, node_id, c))
            for c in cmds
        ]


def _command_args(request: Request, job_id: str, node_id: str, c: NodeCommand) -> dict[str, Any]:
    """A command's args as the agent gets them. A ``regroup`` addressed to this node
    also carries the agent token of the attempt it moves into: handed here, to the
    agent that holds this attempt's token, the way register hands one for an
    enrolment, and never stored."""
    args = dict(c.args or {})
    into = args.get("attempt")
    if c.type == CommandType.REGROUP and c.node_id == node_id and isinstance(into, int):
        args["agent_token"] = node_token(request.app.state.token, job_id, into, node_id)
    return args


class _CommandWatch:
    """Reads the commands added since its last look, once per ``POLL_INTERVAL_S``, for
    all waiting long-polls together, and wakes them; a waiter queries its own
    commands only when its (job, attempt) got a new one.

    So 64 waiting agents cost one small query per interval, and a burst of commands
    (one per job when a fleet is preempted) costs each waiter one check, not one per
    command. (A first version polled per request and ran a 64-node benchmark out of
    pooled connections.) It polls the database, not an in-process signal, so
    commands written by the reconciler or another replica are seen too; a row whose
    id is below the watermark when it commits late is caught by the waiters' own
    re-check every ``RECHECK_S``.
    """

    def __init__(self, sessionmaker: Any) -> None:
        self._sessionmaker = sessionmaker
        self._watermark: int | None = None
        self.newest: dict[tuple[str, int], int] = {}
        """(job_id, attempt) -> the highest command id seen for it."""
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._waiters = 0
        #: Long-poll reads get their own few worker threads: however many agents wait,
        #: they never take the threads (or pooled connections) other requests need.
        self.limiter = anyio.CapacityLimiter(LONG_POLL_THREADS)

    def _read(self) -> list[tuple[int, str, int]]:
        with read_session(self._sessionmaker) as s:
            if self._watermark is None:
                self._watermark = int(s.scalar(select(func.max(NodeCommand.id))) or 0)
                return []
            q = (
                select(NodeCommand.id, NodeCommand.job_id, NodeCommand.attempt)
                .where(NodeCommand.id > self._watermark)
                .order_by(NodeCommand.id)
                .limit(10_000)
            )
            return [(int(i), str(j), int(a)) for i, j, a in s.execute(q)]

    async def _run(self) -> None:
        while self._waiters > 0:
            try:
                rows = await anyio.to_thread.run_sync(self._read, limiter=self.limiter)
            except Exception:  # the database blinked; waiters still re-check on their own
                log.exception("command watch: could not read node_commands")
                rows = []
            if rows:
                for cid, job_id, attempt in rows:
                    self.newest[(job_id, attempt)] = cid
                self._watermark = rows[-1][0]
                fired, self._changed = self._changed, asyncio.Event()
                fired.set()
            await asyncio.sleep(POLL_INTERVAL_S)
        self._task = None
        self._watermark = None  # nobody watched for a while: start from the top again

    async def wait_change(self, timeout: float) -> None:
        event = self._changed
        self._waiters += 1
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters -= 1


def _command_watch(request: Request) -> _CommandWatch:
    """One watch per app and event loop (a test client may bring a new loop)."""
    loop = asyncio.get_running_loop()
    held = getattr(request.app.state, "agent_command_watch", None)
    if held is None or held[0] is not loop:
        held = (loop, _CommandWatch(request.app.state.sessionmaker))
        request.app.state.agent_command_watch = held
    return held[1]


@_node_router.get("/commands", response_model=CommandsOut)
async def commands(
    request: Request,
    job_id: str,
    attempt: AttemptPath,
    node_id: NodePath,
    after: Annotated[
        int, Query(ge=0, le=MAX_CURSOR, description="cursor: commands with a larger seq")
    ] = 0,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="long-poll seconds")] = 0.0,
) -> CommandsOut:
    """Commands for this node after ``after``; waits up to ``wait`` s for one to arrive.
    409 (also mid-wait, within ``RECHECK_S``) once the attempt is no longer current."""
    deadline = time.monotonic() + wait
    watch = _command_watch(request)
    key = (job_id, attempt)
    seen = -1
    checked_at = 0.0
    while True:
        now = time.monotonic()
        newest = watch.newest.get(key, 0)
        if seen < 0 or newest > seen or now - checked_at >= RECHECK_S:
            seen, checked_at = max(newest, 0), now
            try:
                found = await anyio.to_thread.run_sync(
                    _check_commands, request, job_id, attempt, node_id, after, limiter=watch.limiter
                )
            except (NotFound, agents.NotCurrent) as e:
                raise _translate(e) from None
            if found:
                return CommandsOut(commands=found)
        if now >= deadline or await request.is_disconnected():
            return CommandsOut(commands=[])
        await watch.wait_change(min(RECHECK_S, deadline - now))


@_node_router.post("/reports", response_model=ReportOut)
def report(
    request: Request, job_id: str, attempt: AttemptPath, node_id: NodePath, body: Report
) -> ReportOut:
    """Record a report as an event; the same ``key`` again returns the stored one."""
    try:
        with _transaction(request) as session:
            event, created = agents.record_report(
                session, job_id, attempt, node_id, body.model_dump(mode="json")
            )
            out = ReportOut(event_id=event.id, created=created)
    except (NotFound, agents.NotCurrent) as e:
        raise _translate(e) from None
    except ValueError as e:  # the store's own checks: a 422 shaped as the schema says
        error = {"type": "value_error", "loc": ["body", body.kind], "msg": str(e)[:2000]}
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, [error]) from None
    return out


# --- the agent package (no token: see the module docstring) -------------------------


class PackageOut(BaseModel):
    name: str = "skyresume"
    version: str
    wheel: str
    """The wheel's file name."""
    sha256: str
    build: str
    """The source digest the wheel was built from (its agents register with it)."""
    url: str
    """Where to download it: ``<public URL>/v1/agent/dist/<wheel>``."""
    pip_spec: str
    """``url#sha256=...``: what the task templates install (pip checks the hash)."""


def _wheels(request: Request) -> agent_package.WheelCache:
    cache = getattr(request.app.state, "agent_wheels", None)
    if cache is None:
        cache = agent_package.WheelCache(request.app.state.settings.home)
        request.app.state.agent_wheels = cache
    return cache


async def _current_wheel(request: Request) -> agent_package.AgentWheel:
    """The wheel, built once in the background (``serve`` starts it): a request during
    the build waits on the event loop, holding no worker thread, and a failed build
    is 503 with its reason at once, every time, without building again."""
    cache = _wheels(request)
    cache.start()
    deadline = time.monotonic() + agent_package.BUILD_TIMEOUT_S
    while (outcome := cache.outcome()) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if isinstance(outcome, agent_package.AgentWheel):
        return outcome
    why = str(outcome) if outcome is not None else "the agent wheel is still being built"
    raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, why)


@_package_router.get("/package", response_model=PackageOut)
async def package_info(request: Request) -> PackageOut:
    """The agent package this service serves (built from its own source on first use).
    503 when there is no source tree to build it from (the detail says what to do)."""
    wheel = await _current_wheel(request)
    base = request.app.state.settings.effective_service_url
    return PackageOut(
        version=wheel.version,
        wheel=wheel.filename,
        sha256=wheel.sha256,
        build=wheel.build,
        url=wheel.url(base),
        pip_spec=wheel.pip_spec(base),
    )


@_package_router.get("/dist/{filename}", response_class=FileResponse)
async def package_file(request: Request, filename: str) -> FileResponse:
    """The wheel's bytes. Any other name is 404 naming the one file served here."""
    wheel = await _current_wheel(request)
    if filename != wheel.filename:  # compared, never joined to a path: no traversal
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"no such file {filename!r}: this service serves {wheel.filename}",
        )
    # A wheel is a zip archive; pip names the file from the URL, whatever the type.
    return FileResponse(wheel.path, media_type="application/zip", filename=wheel.filename)


router.include_router(_node_router)
router.include_router(_package_router)
