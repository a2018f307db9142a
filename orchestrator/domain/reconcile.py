"""The reconciler's decision: ``decide(snapshot, config) -> list[Action]``. Pure.

The reconciler gathers a :class:`JobSnapshot` from the store and the launcher, asks
:func:`decide` what to do, and applies the actions (``orchestrator.reconciler``).
Nothing here reads a clock, a database or a process: ``snapshot.now`` is the time.

One attempt is one launch. A failure of an attempt opens one **incident**, and the
incident runs the seven protocol steps (``domain.protocol``) in order; every later
failure of the same attempt is a consequence (ranks whose peer vanished crash too)
and is folded into it. A failure of the *next* attempt before it validated ends the
incident's VALIDATE step as failed and opens a new incident.

Example sequences (the job's statuses, then the incident's steps)::

    RUNNING -> RECOVERING -> PROVISIONING -> RUNNING       preemption with notice:
      detect (notice) . signal (checkpoint_and_stop) . confirm (step of the save)
      . select . stage . launch (attempt 2, expected step) . validate (all ranks)

    RUNNING -> RECOVERING -> FAILED                          tampered checkpoint:
      detect . signal . confirm . select . stage (sha256 mismatch: job FAILED)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from orchestrator.contract import ExitCode
from orchestrator.domain.advisor import interval_changed_meaningfully
from orchestrator.domain.failures import FailureClass
from orchestrator.domain.protocol import ProtocolStep, StepOutcome, next_step
from orchestrator.domain.status import JobStatus

_F = FailureClass

#: Event kinds that are failures of the attempt they name.
FAILURE_KINDS = frozenset({"preemption_notice", "rank_exit", "node_lost", "rank_hang", "stuck"})
#: Rank exits that are not failures: a clean finish, and a save after a stop request.
CLEAN_EXITS = frozenset({int(ExitCode.OK), int(ExitCode.PREEMPTED_SAVED)})
#: Rank exits that mean "do not train on this checkpoint": the job stops, never retries.
REFUSALS = frozenset({int(ExitCode.RESUME_MISMATCH), int(ExitCode.CHECKPOINT_INVALID)})
#: Classes after which the ranks can still save together (every node is alive).
SAVE_CLASSES = frozenset({_F.PREEMPTION_NOTICE})
#: Which cause names an incident when several failures arrive together.
_PRIORITY = [_F.PREEMPTION_NOTICE, _F.NODE_LOST, _F.NAN_DIVERGENCE, _F.SILENT_CORRUPTION]


@dataclass(frozen=True)
class ReconcileConfig:
    register_timeout_s: float = 180.0
    """A node that has not registered this long after launch is lost."""
    validate_timeout_s: float = 300.0
    """Ranks that have not all reported what they resumed from by then failed to start."""
    signal_slack_s: float = 15.0
    """Beyond the grace period, how long SIGNAL waits for agents to report their exit."""


@dataclass(frozen=True)
class RankView:
    rank: int
    step: int | None = None
    """Last step the rank reported progress for (None before its first step)."""
    resumed_step: int | None = None
    """What the rank reported resuming from (0 = fresh start); None = not yet."""
    resumed_digest: str | None = None
    """The manifest digest of what it loaded (None on a fresh start)."""
    report_age_s: float | None = None
    """Seconds between the rank's last datagram and the agent's last heartbeat."""


@dataclass(frozen=True)
class NodeView:
    node_id: str
    node_rank: int
    last_heartbeat_at: datetime | None
    alive: bool | None
    """The launcher's view of the node's processes; None when it could not tell."""
    exited: bool = False
    """The agent reported ``node_exit``."""
    exit_code: int | None = None
    ranks: tuple[RankView, ...] = ()


@dataclass(frozen=True)
class AttemptView:
    number: int
    state: str
    """launching | running | stopping | ended"""
    started_at: datetime
    num_nodes: int
    ranks_per_node: int
    expected_step: int | None = None
    validated_step: int | None = None
    launched: bool = True
    nodes: tuple[NodeView, ...] = ()
    vanished: tuple[str, ...] = ()
    """Nodes the launcher started that are gone without ever registering."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def last_step(self) -> int | None:
        steps = [r.step for n in self.nodes for r in n.ranks if r.step is not None]
        return max(steps) if steps else self.expected_step


@dataclass(frozen=True)
class Failure:
    event_id: int
    kind: str
    failure_class: FailureClass
    occurred_at: datetime
    node_id: str | None = None
    rank: int | None = None
    exit_code: int | None = None
    message: str = ""


@dataclass(frozen=True)
class StepView:
    started_at: datetime
    finished_at: datetime | None = None
    outcome: StepOutcome | None = None
    detail: str = ""


@dataclass(frozen=True)
class IncidentView:
    event_id: int
    attempt: int
    """The attempt the incident ended."""
    failure_class: FailureClass
    steps: dict[ProtocolStep, StepView] = field(default_factory=dict)

    def outcomes(self) -> dict[ProtocolStep, StepOutcome | None]:
        return {k: v.outcome for k, v in self.steps.items()}


@dataclass(frozen=True)
class JobSnapshot:
    job_id: str
    status: JobStatus
    now: datetime
    num_nodes: int
    ranks_per_node: int
    heartbeat_timeout_s: float
    grace_s: float
    attempt: AttemptView | None = None
    """The newest attempt; None before the first launch."""
    failures: tuple[Failure, ...] = ()
    """Failure events of the newest attempt, oldest first."""
    incident: IncidentView | None = None
    """The incident whose protocol has not finished, if any."""


# --- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SetStatus:
    status: JobStatus
    reason: str


@dataclass(frozen=True)
class Launch:
    """Launch (or, after a crash mid-launch, re-launch) attempt ``number``."""

    number: int
    incident_id: int | None = None


@dataclass(frozen=True)
class RecordFailure:
    """A failure the reconciler itself detected (no agent could report it)."""

    kind: str
    failure_class: FailureClass
    node_id: str | None
    message: str
    rank: int | None = None


@dataclass(frozen=True)
class OpenIncident:
    cause: Failure
    attempt: int
    last_step: int | None


@dataclass(frozen=True)
class StartStep:
    incident_id: int
    step: ProtocolStep


@dataclass(frozen=True)
class FinishStep:
    incident_id: int
    step: ProtocolStep
    outcome: StepOutcome
    detail: str


@dataclass(frozen=True)
class SendCommand:
    attempt: int
    type: Literal["checkpoint_and_stop", "stop", "set_checkpoint_every"]
    args: dict[str, object]


@dataclass(frozen=True)
class RunStep:
    """An I/O step the applier performs and finishes itself (confirm, select, stage)."""

    incident_id: int
    step: ProtocolStep


@dataclass(frozen=True)
class Release:
    """Tear the attempt's nodes down and mark it ended."""

    attempt: int
    reason: str


@dataclass(frozen=True)
class MarkValidated:
    attempt: int
    step: int


Action = (
    SetStatus
    | Launch
    | RecordFailure
    | OpenIncident
    | StartStep
    | FinishStep
    | SendCommand
    | RunStep
    | Release
    | MarkValidated
)


# --- decide --------------------------------------------------------------------------------


def _age(now: datetime, then: datetime | None) -> float:
    return float("inf") if then is None else (now - then).total_seconds()


def _primary(failures: tuple[Failure, ...]) -> Failure:
    for cls in _PRIORITY:
        for f in failures:
            if f.failure_class is cls:
                return f
    return failures[0]


def detect(s: JobSnapshot, a: AttemptView, cfg: ReconcileConfig) -> RecordFailure | None:
    """A failure nobody reported: a node that vanished, went silent or never came up,
    or a rank that stopped making progress. None while the attempt looks healthy."""
    if a.state not in ("launching", "running"):
        return None
    seen = {n.node_rank: n for n in a.nodes}
    if a.vanished:
        return RecordFailure(
            "node_lost",
            _F.NODE_LOST,
            a.vanished[0],
            f"node {a.vanished[0]} is gone: it exited before it registered with the service",
        )
    for node in a.nodes:
        if node.exited:
            continue
        if node.alive is False:
            return RecordFailure(
                "node_lost",
                _F.NODE_LOST,
                node.node_id,
                f"node {node.node_id} is gone: its processes vanished without a notice",
            )
        hb = _age(s.now, node.last_heartbeat_at)
        if hb > s.heartbeat_timeout_s:
            return RecordFailure(
                "node_lost",
                _F.NODE_LOST,
                node.node_id,
                f"node {node.node_id} sent no heartbeat for {hb:.0f} s "
                f"(timeout {s.heartbeat_timeout_s:.0f} s)",
            )
    if a.validated_step is not None:
        # A frozen rank stalls every peer at its next collective, so all go silent
        # together; name them all, the one silent longest first.
        silent = sorted(
            (
                ((r.report_age_s or 0.0) + _age(s.now, n.last_heartbeat_at), r.rank, n.node_id)
                for n in a.nodes
                if not n.exited
                for r in n.ranks
                if r.report_age_s is not None
            ),
            reverse=True,
        )
        stalled = [x for x in silent if x[0] > s.heartbeat_timeout_s]
        if stalled:
            age, rank, node_id = stalled[0]
            others = ", ".join(str(x[1]) for x in stalled[1:])
            return RecordFailure(
                "rank_hang",
                _F.NCCL_TIMEOUT,
                node_id,
                f"rank {rank} on {node_id} made no progress for {age:.0f} s "
                f"(timeout {s.heartbeat_timeout_s:.0f} s): hung in a collective?"
                + (f" Also silent: ranks {others}." if others else ""),
                rank=rank,
            )
    if _age(s.now, a.started_at) > cfg.register_timeout_s:
        for k in range(a.num_nodes):
            if k not in seen:
                return RecordFailure(
                    "node_lost",
                    _F.NODE_LOST,
                    None,
                    f"node {k} of attempt {a.number} never registered "
                    f"in {cfg.register_timeout_s:.0f} s",
                )
    return None


def resumed_everywhere(a: AttemptView) -> int | None:
    """The step every rank of the attempt reported resuming from, when all have and
    all agree with each other and with the expected step; else None."""
    ranks = [r for n in a.nodes for r in n.ranks]
    if len(a.nodes) < a.num_nodes or len(ranks) < a.world_size:
        return None
    steps = {r.resumed_step for r in ranks}
    if None in steps or len(steps) != 1:
        return None
    if len({r.resumed_digest for r in ranks}) != 1:
        return None  # same step, different manifests: never train on that
    (step,) = steps
    assert step is not None
    if a.expected_step is not None and step != a.expected_step:
        return None
    return step


def _refusal(failures: tuple[Failure, ...]) -> Failure | None:
    return next((f for f in failures if f.exit_code in REFUSALS), None)


def _all_stopped(a: AttemptView) -> bool:
    return all(n.exited or n.alive is False for n in a.nodes)


def decide(s: JobSnapshot, cfg: ReconcileConfig | None = None) -> list[Action]:
    cfg = cfg or ReconcileConfig()
    a = s.attempt
    if s.status.is_terminal():
        if a is not None and a.state != "ended":
            return [Release(a.number, f"job {s.status}")]
        return []
    if a is None:
        return [SetStatus(JobStatus.PROVISIONING, "launching attempt 1"), Launch(1)]
    if not a.launched and a.state == "launching":
        return [Launch(a.number)]
    if s.incident is not None:
        return _protocol(s, a, s.incident, cfg)

    refusal = _refusal(s.failures)
    if refusal is not None:
        return _fail(a, f"ranks refused to resume: {refusal.message or refusal.kind}")
    if s.failures:
        # A node that vanished names the incident even if its peers' crashes were
        # reported first: record it before opening.
        lost = detect(s, a, cfg)
        if (
            lost is not None
            and lost.failure_class is _F.NODE_LOST
            and not any(f.failure_class is _F.NODE_LOST for f in s.failures)
        ):
            return [lost]
        cause = _primary(s.failures)
        return [
            OpenIncident(cause, a.number, a.last_step()),
            SetStatus(JobStatus.RECOVERING, f"{cause.failure_class}: {cause.message}"[:500]),
        ]
    found = detect(s, a, cfg)
    if found is not None:
        return [found]
    if (
        len(a.nodes) == a.num_nodes
        and all(n.exited for n in a.nodes)
        and all(n.exit_code == 0 for n in a.nodes)
    ):
        done: list[Action] = [
            SetStatus(JobStatus.SUCCEEDED, f"training finished at step {a.last_step()}"),
            Release(a.number, "finished"),
        ]
        if s.status is JobStatus.PROVISIONING:  # finished before every rank reported in
            done.insert(0, SetStatus(JobStatus.RUNNING, "every node ran to completion"))
        return done
    if a.state == "ended":
        return [SetStatus(JobStatus.FAILED, f"attempt {a.number} ended with no outcome recorded")]

    if a.validated_step is None:
        step = resumed_everywhere(a)
        if step is not None:
            out: list[Action] = [MarkValidated(a.number, step)]
            if s.status is JobStatus.PROVISIONING:
                out.append(SetStatus(JobStatus.RUNNING, f"all {a.world_size} ranks at step {step}"))
            return out
        if _age(s.now, a.started_at) > cfg.validate_timeout_s:
            return [
                RecordFailure(
                    "stuck",
                    _F.RENDEZVOUS_FAILURE,
                    None,
                    f"attempt {a.number}: not every rank reported its resume step "
                    f"within {cfg.validate_timeout_s:.0f} s",
                )
            ]
    return []


def _fail(a: AttemptView, reason: str) -> list[Action]:
    out: list[Action] = [SetStatus(JobStatus.FAILED, reason)]
    if a.state != "ended":
        out.append(Release(a.number, reason))
    return out


def _protocol(
    s: JobSnapshot, a: AttemptView, inc: IncidentView, cfg: ReconcileConfig
) -> list[Action]:
    step = next_step(inc.outcomes())
    if step is None:  # gather only passes open incidents; nothing to do
        return []
    view = inc.steps.get(step)
    i = inc.event_id
    if step is ProtocolStep.SIGNAL:
        if view is None:
            if inc.failure_class in SAVE_CLASSES:
                cmd = SendCommand(
                    inc.attempt,
                    "checkpoint_and_stop",
                    {"reason": str(inc.failure_class), "grace_s": s.grace_s},
                )
            else:
                cmd = SendCommand(inc.attempt, "stop", {"reason": str(inc.failure_class)})
            return [StartStep(i, step), cmd]
        waited = _age(s.now, view.started_at)
        if _all_stopped(a):
            how = "saved and stopped" if inc.failure_class in SAVE_CLASSES else "stopped"
            return [FinishStep(i, step, StepOutcome.OK, f"every rank {how} ({waited:.1f} s)")]
        if waited > s.grace_s + cfg.signal_slack_s:
            left = [n.node_id for n in a.nodes if not (n.exited or n.alive is False)]
            return [
                FinishStep(
                    i,
                    step,
                    StepOutcome.OK,
                    f"grace of {s.grace_s:.0f} s over; still running, released: {', '.join(left)}",
                )
            ]
        return []
    if step in (
        ProtocolStep.CONFIRM_CHECKPOINT,
        ProtocolStep.SELECT_REPLACEMENT,
        ProtocolStep.STAGE,
    ):
        return [RunStep(i, step)]
    if step is ProtocolStep.LAUNCH:
        return [Launch(inc.attempt + 1, incident_id=i)]
    if step is ProtocolStep.VALIDATE:
        if a.number <= inc.attempt:  # launch recorded but attempt not gathered yet
            return []
        refusal = _refusal(s.failures)
        if refusal is not None:
            reason = f"ranks refused to resume: {refusal.message or refusal.kind}"
            return [FinishStep(i, step, StepOutcome.FAILED, reason), *_fail(a, reason)]
        resumed = resumed_everywhere(a)
        if resumed is not None:
            return [
                FinishStep(
                    i,
                    step,
                    StepOutcome.OK,
                    f"all {a.world_size} ranks resumed at step {resumed}",
                ),
                MarkValidated(a.number, resumed),
                SetStatus(JobStatus.RUNNING, f"recovered: all ranks at step {resumed}"),
            ]
        if s.failures:
            f = _primary(s.failures)
            return [
                FinishStep(
                    i,
                    step,
                    StepOutcome.FAILED,
                    f"attempt {a.number} failed before validating: {f.failure_class}",
                )
            ]
        found = detect(s, a, cfg)
        if found is not None:
            return [found]
        if _age(s.now, a.started_at) > cfg.validate_timeout_s:
            reason = f"ranks did not all report a resume step in {cfg.validate_timeout_s:.0f} s"
            return [
                FinishStep(i, step, StepOutcome.FAILED, reason),
                RecordFailure("stuck", _F.RENDEZVOUS_FAILURE, None, reason),
            ]
        return []
    return []  # DETECT is written when the incident opens


def checkpoint_every_update(
    current_every: int, step_seconds: float, interval_seconds: float
) -> int | None:
    """The new ``every_steps`` for an advised interval, or None when the change is not
    meaningful (under 20 %): running jobs are not told every noisy estimate."""
    if current_every < 1 or step_seconds <= 0 or interval_seconds <= 0:
        raise ValueError("current_every, step_seconds and interval_seconds must be positive")
    new = max(1, round(interval_seconds / step_seconds))
    if new == current_every or not interval_changed_meaningfully(
        current_every * step_seconds, new * step_seconds
    ):
        return None
    return new
