"""Repository functions for node agents: registration, heartbeats, commands, reports.

The API's agent routes and the reconciler both call these. Like ``repo``, each takes
a Session and commits nothing: the caller owns the transaction.

Who is *current*: an agent talks for one attempt of one job. Only the newest attempt
(the highest number) counts, and only while its state is not ``ended`` and the job is
not terminal. Agents of any other attempt get 409 from register/heartbeat/commands
and stop their ranks (the service moved on without them). Reports are history, so a
report for an attempt that exists is recorded even after the service moved on: an
agent's last ``rank_exit``/``node_exit`` must not be lost to a race with the
reconciler.

Every report becomes one ``failure_events`` row (kind = the report kind), idempotent
on ``a<attempt>:<node_id>:<key>``; a ``checkpoint`` report also upserts a
``checkpoints`` row with status ``complete``. A ``staged`` event's details are exactly
``STAGED_DETAILS`` (node_id, attempt, step, ok, detail, bytes, seconds, uri).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from sqlalchemy import Table, bindparam, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrator.contract import (
    AnomalyFinding,
    AttemptState,
    CommandType,
    ExitCode,
    NodeState,
    ReportKind,
)
from orchestrator.domain.failures import (
    Classification,
    FailureClass,
    classify_failure,
    exception_signature,
)
from orchestrator.domain.status import JobStatus
from orchestrator.store import repo
from orchestrator.store.models import Attempt, Checkpoint, FailureEvent, Node, NodeCommand
from orchestrator.store.repo import NotFound, utcnow

#: Command types an agent understands (docs/agent.md).
COMMAND_TYPES = frozenset(CommandType)
#: Report kinds an agent sends (docs/agent.md).
REPORT_KINDS = frozenset(ReportKind)
#: Node states: ``registered`` until the first heartbeat, then what the agent says.
NODE_STATES = frozenset(NodeState)
#: Exit codes that are not failures: done, or saved after a stop was asked for.
CLEAN_EXIT_CODES = frozenset({int(ExitCode.OK), int(ExitCode.PREEMPTED_SAVED)})
#: Evidence size limits (characters): one rank's stack, all stacks of one report, and
#: ranks per report. The agent cuts its stacks to fit (orchestrator/agent/evidence.py,
#: same numbers); a report over them is refused, never stored half.
EVIDENCE_STACK_CAP = 64 * 1024
EVIDENCE_REPORT_CAP = 1024 * 1024
EVIDENCE_MAX_RANKS = 256


class NotCurrent(Exception):
    """The attempt is not the job's current one; the API answers 409."""


def current_attempt(session: Session, job_id: str) -> Attempt | None:
    """The job's highest-numbered attempt, whatever its state (None before any launch)."""
    q = select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number.desc()).limit(1)
    return session.scalars(q).first()


def is_current_attempt(session: Session, job_id: str, attempt: int) -> bool:
    """True when ``attempt`` is the job's newest, not ended, and the job is not terminal.

    Raises NotFound for an unknown job.
    """
    job = repo.get_job(session, job_id)
    if JobStatus(job.status).is_terminal():
        return False
    newest = current_attempt(session, job_id)
    return newest is not None and newest.number == attempt and newest.state != AttemptState.ENDED


def _require_current(session: Session, job_id: str, attempt: int) -> None:
    if not is_current_attempt(session, job_id, attempt):
        raise NotCurrent(f"attempt {attempt} of job {job_id} is not the current attempt")


#: An attempt's ``knobs`` key: the node ids its SIGNAL held warm (``HoldWarm``). Their
#: agents keep beating and polling that attempt's commands after it ended, until a
#: ``regroup`` command carries them into the next one (their register there moves the
#: node row on), or they are torn down, or the job ends. On the attempt row, which only
#: the reconciler writes: a node row's progress is rewritten by every heartbeat flush.
HELD_KEY = "held"


def held_ids(a: Attempt) -> frozenset[str]:
    raw = (a.knobs or {}).get(HELD_KEY)
    return frozenset(x for x in raw if isinstance(x, str)) if isinstance(raw, list) else frozenset()


def hold_nodes(session: Session, job_id: str, attempt: int, node_ids: Iterable[str]) -> None:
    """Record ``node_ids`` of ``attempt`` as held warm."""
    a = session.scalars(
        select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)
    ).first()
    if a is None:
        raise NotCurrent(f"job {job_id} has no attempt {attempt}")
    a.knobs = {**(a.knobs or {}), HELD_KEY: sorted(held_ids(a) | set(node_ids))}
    session.flush()


def is_held(session: Session, job_id: str, attempt: int, node_id: str) -> bool:
    """``node_id`` is held warm at ``attempt`` (the attempt may have ended), has not
    moved on, and the job goes on: its agent is answered, not told it is superseded."""
    a = session.scalars(
        select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)
    ).first()
    if a is None or node_id not in held_ids(a):
        return False
    node = _node(session, job_id, node_id)
    if node is None or node.attempt != attempt:
        return False
    return not JobStatus(repo.get_job(session, job_id).status).is_terminal()


def _attempt_exists(session: Session, job_id: str, attempt: int) -> bool:
    q = select(func.count()).select_from(Attempt)
    q = q.where(Attempt.job_id == job_id, Attempt.number == attempt)
    return bool(session.scalar(q))


def _node(session: Session, job_id: str, node_id: str) -> Node | None:
    q = select(Node).where(Node.job_id == job_id, Node.node_id == node_id)
    return session.scalars(q).first()


@dataclass(frozen=True)
class Registration:
    node: Node
    command_cursor: int
    """The last command this node acknowledged (0 for a new node): long-poll after it."""


def register_node(
    session: Session,
    job_id: str,
    attempt: int,
    node_id: str,
    *,
    node_rank: int,
    hostname: str | None = None,
    agent_pid: int | None = None,
    provider: str | None = None,
    ranks: list[dict[str, Any]] | None = None,
    now: datetime | None = None,
    client_ip: str | None = None,
) -> Registration:
    """Create the node row, or refresh it when an agent registers again (a restarted
    agent keeps the command cursor its predecessor acknowledged).

    Raises NotFound (unknown job) or NotCurrent (stale attempt).
    """
    _require_current(session, job_id, attempt)
    now = now or utcnow()
    node = _node(session, job_id, node_id)
    # client_ip: the address the service saw the agent at; a kept node's is the
    # rendezvous address of a group that spans launches.
    info = {"hostname": hostname, "agent_pid": agent_pid, "provider": provider,
            "client_ip": client_ip}  # fmt: skip
    if node is None:
        node = Node(
            job_id=job_id,
            attempt=attempt,
            node_id=node_id,
            node_rank=node_rank,
            address=hostname,
            state=NodeState.REGISTERED,
            last_heartbeat_at=now,
            progress={"ranks": ranks or [], **info},
            registered_at=now,
        )
        try:
            with session.begin_nested():
                session.add(node)
                session.flush()
        except IntegrityError:  # two registrations raced; the other one won
            node = _node(session, job_id, node_id)
            if node is None:
                raise
        else:
            return Registration(node, 0)
    cursor = int((node.progress or {}).get("acked_command") or 0) if node.attempt == attempt else 0
    node.attempt = attempt
    node.node_rank = node_rank
    node.address = hostname
    node.state = NodeState.REGISTERED
    node.last_heartbeat_at = now
    node.progress = {**(node.progress or {}), "ranks": ranks or [], **info}
    session.flush()
    return Registration(node, cursor)


#: Progress keys register writes and a heartbeat keeps (a beat's body has none of them).
_REGISTER_KEYS = ("hostname", "agent_pid", "provider", "client_ip")


def merge_progress(
    old: dict[str, Any] | None, body: dict[str, Any], acked: int | None
) -> dict[str, Any]:
    """A node's progress after a heartbeat: the body, what register wrote about the
    node, and the command cursor (an agent that acked nothing new must not rewind it)."""
    old = old or {}
    keep = {k: v for k, v in old.items() if k in _REGISTER_KEYS}
    if acked is None:
        acked = old.get("acked_command")
    return {**keep, **body, "acked_command": acked}


def merged_state(row_state: str, beat_state: str) -> str:
    """A batched beat never turns an ``exited`` node (its node_exit report, written
    after the beat was sent) back into a live one; only register resets the state."""
    return row_state if row_state == NodeState.EXITED else beat_state


def record_heartbeat(
    session: Session,
    job_id: str,
    attempt: int,
    node_id: str,
    body: dict[str, Any],
    *,
    now: datetime | None = None,
) -> Node:
    """Store the heartbeat body as the node's progress and its state, at once (the
    service batches through ``store.liveness``; this is the direct path).

    Raises NotFound when the node never registered (the agent registers again),
    NotCurrent for a stale attempt.
    """
    _require_current(session, job_id, attempt)
    node = _node(session, job_id, node_id)
    if node is None or node.attempt != attempt:
        raise NotFound(f"node {node_id} is not registered for attempt {attempt} of job {job_id}")
    state = body.get("state")
    if state not in NODE_STATES:
        raise ValueError(f"state must be one of {sorted(NODE_STATES)}, got {state!r}")
    node.progress = merge_progress(node.progress, body, body.get("acked_command"))
    node.state = state
    node.last_heartbeat_at = now or utcnow()
    session.flush()
    return node


class BeatLike(Protocol):
    """One node's newest accepted heartbeat (``liveness.Beat``)."""

    @property
    def job_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def node_id(self) -> str: ...
    @property
    def at(self) -> datetime: ...
    @property
    def state(self) -> str: ...
    @property
    def body(self) -> dict[str, Any]: ...
    @property
    def acked(self) -> int | None: ...


def store_heartbeats(session: Session, beats: Iterable[BeatLike]) -> int:
    """Write many nodes' newest beats in the caller's transaction: one SELECT of their
    rows, one executemany UPDATE. A beat whose row is gone, belongs to another attempt
    now, or is older than the row's ``last_heartbeat_at`` (another replica, or a
    register, wrote a newer one) is skipped. Returns the rows written.

    Validation happened when the beat was accepted; the row's attempt and time are
    checked again in the UPDATE itself, so a register committed meanwhile wins."""
    beats = list(beats)
    if not beats:
        return 0
    t = cast(Table, Node.__table__)
    rows: dict[tuple[str, str], Any] = {}
    by_job: dict[str, list[str]] = {}
    for b in beats:
        by_job.setdefault(b.job_id, []).append(b.node_id)
    for job_id, node_ids in by_job.items():
        q = select(t.c.id, t.c.job_id, t.c.node_id, t.c.attempt, t.c.state, t.c.progress,
                   t.c.last_heartbeat_at)  # fmt: skip
        for chunk in _chunks(node_ids, 500):
            for row in session.execute(q.where(t.c.job_id == job_id, t.c.node_id.in_(chunk))):
                rows[(row.job_id, row.node_id)] = row
    params = []
    for b in beats:
        r = rows.get((b.job_id, b.node_id))
        if r is None or r.attempt != b.attempt:
            continue
        if r.last_heartbeat_at is not None and _aware(r.last_heartbeat_at) >= b.at:
            continue
        params.append(
            {
                "b_id": r.id,
                "b_attempt": b.attempt,
                "b_at": b.at,
                "b_state": merged_state(r.state, b.state),
                "b_progress": merge_progress(r.progress, b.body, b.acked),
            }
        )
    if not params:
        return 0
    stmt = (
        t.update()
        .where(
            t.c.id == bindparam("b_id"),
            t.c.attempt == bindparam("b_attempt"),
            or_(t.c.last_heartbeat_at.is_(None), t.c.last_heartbeat_at < bindparam("b_at")),
        )
        .values(
            state=bindparam("b_state"),
            progress=bindparam("b_progress"),
            last_heartbeat_at=bindparam("b_at"),
        )
    )
    session.execute(stmt, params)
    return len(params)


def _chunks(xs: list[str], n: int) -> Iterator[list[str]]:
    for i in range(0, len(xs), n):
        yield xs[i : i + n]


def _aware(dt: datetime) -> datetime:
    """SQLite returns naive datetimes; every time stored here is UTC."""
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)


def list_nodes(session: Session, job_id: str, attempt: int | None = None) -> list[Node]:
    q = select(Node).where(Node.job_id == job_id)
    if attempt is not None:
        q = q.where(Node.attempt == attempt)
    return list(session.scalars(q.order_by(Node.attempt, Node.node_rank, Node.node_id)))


def enqueue_command(
    session: Session,
    job_id: str,
    attempt: int,
    type: str,
    args: dict[str, Any] | None = None,
    node_id: str | None = None,
    *,
    now: datetime | None = None,
) -> NodeCommand:
    """Queue a command for one node (``node_id``) or every node of the attempt (None)."""
    if type not in COMMAND_TYPES:
        raise ValueError(f"command type must be one of {sorted(COMMAND_TYPES)}, got {type!r}")
    if args is not None and not isinstance(args, dict):
        raise ValueError(f"command args must be a JSON object, got {args!r}")
    repo.get_job(session, job_id)
    cmd = NodeCommand(
        job_id=job_id,
        attempt=attempt,
        node_id=node_id,
        type=type,
        args=dict(args or {}),
        created_at=now or utcnow(),
    )
    session.add(cmd)
    session.flush()
    return cmd


def commands_after(
    session: Session, job_id: str, attempt: int, node_id: str, after: int
) -> list[NodeCommand]:
    """Commands for this node (or for all nodes) of this attempt with id > ``after``."""
    q = (
        select(NodeCommand)
        .where(
            NodeCommand.job_id == job_id,
            NodeCommand.attempt == attempt,
            NodeCommand.id > after,
            (NodeCommand.node_id.is_(None)) | (NodeCommand.node_id == node_id),
        )
        .order_by(NodeCommand.id)
    )
    return list(session.scalars(q))


def poll_commands(
    session: Session, job_id: str, attempt: int, node_id: str, after: int
) -> list[NodeCommand]:
    """One long-poll check: NotCurrent when the attempt is stale (unless the node is
    held warm at it: its ``regroup`` comes there), else what is new."""
    if not is_current_attempt(session, job_id, attempt) and not is_held(
        session, job_id, attempt, node_id
    ):
        raise NotCurrent(f"attempt {attempt} of job {job_id} is not the current attempt")
    return commands_after(session, job_id, attempt, node_id, after)


#: The failure classes an anomaly report may name: the contract's findings.
_ANOMALY_CLASSES = frozenset(FailureClass(f.value) for f in AnomalyFinding)


def _event_fields(kind: str, report: dict[str, Any]) -> dict[str, Any]:
    """failure_class, rank and message of the event a report becomes."""
    if kind == ReportKind.PREEMPTION_NOTICE:
        return {
            "failure_class": FailureClass.PREEMPTION_NOTICE.value,
            "message": f"{report.get('provider')} notice {report.get('notice_kind')}"
            f" (deadline {report.get('deadline') or 'unknown'})",
        }
    if kind == ReportKind.RANK_EXIT:
        code, sig = report.get("exit_code"), report.get("signal")
        how = f"signal {sig}" if sig else f"exit code {code}"
        out: dict[str, Any] = {
            "rank": report.get("rank"),
            "message": f"rank {report.get('rank')} exited: {how}",
        }
        tail = "\n".join(report.get("log_tail") or [])
        if report.get("killed_by_agent"):
            # The SIGKILL was ours, not the kernel's: read the log alone, and without
            # a better cause the rank failed to finish its emergency save in time.
            out["message"] += " (SIGKILLed by the agent after the grace period)"
            c = classify_failure(None, None, tail)
            if c.failure_class is FailureClass.UNKNOWN:
                c = Classification(
                    FailureClass.CHECKPOINT_IO,
                    True,
                    0.5,
                    ("did not exit within the grace period after SIGTERM",),
                )
            out["failure_class"] = c.failure_class.value
            out["classification"] = c.to_json_dict()
        elif code not in CLEAN_EXIT_CODES or sig:
            c = classify_failure(code, sig, tail)
            out["failure_class"] = c.failure_class.value
            out["classification"] = c.to_json_dict()
            # What makes two user errors "the same": the exception, numbers and paths
            # normalised (the reconciler fails fast on a repeat, not on "exit code 1").
            signature = exception_signature(tail)
            if signature is not None:
                out["signature"] = signature
        return out
    if kind == ReportKind.ANOMALY:
        finding = report.get("finding")
        if finding not in _ANOMALY_CLASSES:
            raise ValueError(
                f"anomaly finding must be one of {sorted(_ANOMALY_CLASSES)}, got {finding!r}"
            )
        return {
            "failure_class": finding,
            "rank": report.get("rank"),
            "message": f"rank {report.get('rank')}: {finding} at step {report.get('step')}",
        }
    if kind == ReportKind.CHECKPOINT:
        return {"message": f"checkpoint at step {report.get('step')}"}
    if kind == ReportKind.NODE_EXIT:
        return {"message": f"node exited with {report.get('exit_code')}: {report.get('reason')}"}
    if kind == ReportKind.EVIDENCE:
        return _evidence_fields(report)
    if kind == ReportKind.HEALTH_CHECK:
        return _health_check_fields(report)
    if kind == ReportKind.STAGED:
        return _staged_fields(report)
    raise ValueError(f"report kind must be one of {sorted(REPORT_KINDS)}, got {kind!r}")


def _evidence_fields(report: dict[str, Any]) -> dict[str, Any]:
    """Stacks taken before a kill: no failure class (the incident has one already);
    the message carries the agent's findings (which rank, stuck in what)."""
    ranks = report.get("ranks") or []
    if not isinstance(ranks, list) or len(ranks) > EVIDENCE_MAX_RANKS:
        raise ValueError(f"evidence: ranks must be a list of at most {EVIDENCE_MAX_RANKS}")
    total = 0
    for r in ranks:
        stack = (r or {}).get("stack") or ""
        if len(stack) > EVIDENCE_STACK_CAP:
            raise ValueError(
                f"evidence: rank {r.get('rank')}'s stack is {len(stack)} characters, "
                f"over the {EVIDENCE_STACK_CAP} limit"
            )
        total += len(stack)
    if total > EVIDENCE_REPORT_CAP:
        raise ValueError(
            f"evidence: {total} characters of stacks, over the {EVIDENCE_REPORT_CAP} limit"
        )
    tools = sorted({str(r.get("tool")) for r in ranks if r and r.get("tool")}) or ["no stacks"]
    findings = [str(f) for f in report.get("findings") or []]
    message = f"evidence from {len(ranks)} rank(s) ({', '.join(tools)})"
    if findings:
        message += ": " + "; ".join(findings)
    return {"message": message[:2000]}


def _health_check_fields(report: dict[str, Any]) -> dict[str, Any]:
    """The node's checks before torchrun: class ``health_check_failed`` when any
    failed (the node never trained; the reconciler replaces it), none when all passed."""
    checks = report.get("checks")
    if not isinstance(checks, list) or not checks:
        raise ValueError("health_check: checks must be a non-empty list")
    bad = [c for c in checks if isinstance(c, dict) and c.get("status") == "fail"]
    if bad:
        why = "; ".join(f"{c.get('name')}: {c.get('detail')}" for c in bad)
        return {
            "failure_class": FailureClass.HEALTH_CHECK_FAILED.value,
            "message": f"health check failed: {why}"[:2000],
        }
    counts: dict[str, int] = {}
    for c in checks:
        st = str((c or {}).get("status"))
        counts[st] = counts.get(st, 0) + 1
    return {
        "message": "health checks passed ("
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + ")"
    }


#: The details of a ``staged`` event, exactly (the reconciler's STAGE step reads them).
STAGED_DETAILS = frozenset(
    {"node_id", "attempt", "step", "ok", "detail", "bytes", "seconds", "uri"}
)


def _staged_fields(report: dict[str, Any]) -> dict[str, Any]:
    """The agent staged the resume step onto its disk before torchrun, or could not:
    class ``checkpoint_io`` on a failure (the node exits 78 and never trained)."""
    got = set(report) - {"key", "kind"}
    if got != STAGED_DETAILS - {"attempt"}:
        want = sorted(STAGED_DETAILS - {"attempt"})
        raise ValueError(f"staged: fields must be exactly {want}, got {sorted(got)}")
    if not isinstance(report["ok"], bool):
        raise ValueError(f"staged: ok must be true or false, got {report['ok']!r}")
    where = f"step {report['step']} from {report['uri']}"
    if report["ok"]:
        return {"message": f"staged {where} ({report['bytes']} bytes in {report['seconds']} s)"}
    return {
        "failure_class": FailureClass.CHECKPOINT_IO.value,
        "message": f"staging {where} failed: {report['detail']}"[:2000],
    }


def record_report(
    session: Session,
    job_id: str,
    attempt: int,
    node_id: str,
    report: dict[str, Any],
    *,
    now: datetime | None = None,
) -> tuple[FailureEvent, bool]:
    """Record one agent report as an event (and its side rows); (event, created).

    ``report`` holds ``key``, ``kind`` and the kind's fields (docs/agent.md). The
    same key from the same node of the same attempt returns the stored event.
    Raises NotFound (unknown job) or NotCurrent (no such attempt).
    """
    repo.get_job(session, job_id)
    if not _attempt_exists(session, job_id, attempt):
        raise NotCurrent(f"job {job_id} has no attempt {attempt}")
    key, kind = report.get("key"), report.get("kind")
    if not isinstance(key, str) or not key:
        raise ValueError("report key must be a non-empty string")
    if kind == ReportKind.STAGED and report.get("node_id") != node_id:
        raise ValueError(f"staged: node_id {report.get('node_id')!r} is not the reporting node")
    fields = _event_fields(str(kind), report)
    classification = fields.pop("classification", None)
    signature = fields.pop("signature", None)
    details = {k: v for k, v in report.items() if k not in ("key", "kind")}
    details["attempt"] = attempt
    if classification is not None:
        details["classification"] = classification
    if signature is not None:
        details["signature"] = signature
    event, created = repo.record_event(
        session,
        job_id,
        idempotency_key=f"a{attempt}:{node_id}:{key}"[:128],
        kind=str(kind),
        node_id=node_id,
        details=details,
        now=now,
        **fields,
    )
    if not created:
        return event, False
    if kind == ReportKind.CHECKPOINT:
        _upsert_checkpoint(session, job_id, report, now=now)
    elif kind == ReportKind.NODE_EXIT:
        node = _node(session, job_id, node_id)
        if node is not None and node.attempt == attempt:
            node.state = NodeState.EXITED
            session.flush()
    return event, True


def _upsert_checkpoint(
    session: Session, job_id: str, report: dict[str, Any], *, now: datetime | None
) -> Checkpoint:
    step = int(report["step"])
    uri = report.get("uploaded_uri") or report.get("path") or ""
    q = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
    row = session.scalars(q).first()
    if row is None:
        row = Checkpoint(
            job_id=job_id,
            step=step,
            uri=uri,
            status="complete",
            world_size=report.get("world_size"),
            created_at=now or utcnow(),
        )
        try:
            with session.begin_nested():
                session.add(row)
                session.flush()
            return row
        except IntegrityError:
            row = session.scalars(q).first()
            if row is None:
                raise
    # A second node's report of the same step (or the upload after the local save)
    # only improves the row: a durable URI wins over a node-local path.
    if report.get("uploaded_uri"):
        row.uri = report["uploaded_uri"]
    if report.get("world_size") and not row.world_size:
        row.world_size = report["world_size"]
    row.status = "complete"
    session.flush()
    return row
