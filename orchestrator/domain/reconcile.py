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

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum

from orchestrator.contract import AttemptState, CommandType, EventKind, ExitCode
from orchestrator.domain import elastic as el
from orchestrator.domain import remedy as rm
from orchestrator.domain import silence as sl
from orchestrator.domain.advisor import collective_timeout_s, interval_changed_meaningfully
from orchestrator.domain.failures import FailureClass
from orchestrator.domain.memory import BatchNotDivisible, DoesNotFit, plan_memory
from orchestrator.domain.plan import Placement, TrainingKnobs
from orchestrator.domain.planner import Candidate, FailureRecord
from orchestrator.domain.policy import RecoveryAction
from orchestrator.domain.protocol import ORDER, ProtocolStep, StepOutcome
from orchestrator.domain.spec import JobSpec
from orchestrator.domain.status import JobStatus

_F = FailureClass
_P = ProtocolStep
_A = RecoveryAction

#: Event kinds that can be failures of the attempt they name.
FAILURE_KINDS = frozenset(
    {
        EventKind.PREEMPTION_NOTICE,
        EventKind.RANK_EXIT,
        EventKind.NODE_LOST,
        EventKind.RANK_HANG,
        EventKind.STUCK,
        EventKind.ANOMALY,
        EventKind.HEALTH_CHECK,
        EventKind.GROW,
    }
)
#: Rank exits that are not failures: a clean finish, and a save after a stop request.
CLEAN_EXITS = frozenset({int(ExitCode.OK), int(ExitCode.PREEMPTED_SAVED)})
#: Rank exits that mean "do not train on this checkpoint": the job stops, never retries.
REFUSALS = frozenset({int(ExitCode.RESUME_MISMATCH), int(ExitCode.CHECKPOINT_INVALID)})
#: Classes after which the ranks can still save together (every node is alive).
SAVE_CLASSES = frozenset({_F.PREEMPTION_NOTICE, _F.SLOW_PEER, _F.ELASTIC_GROW})
#: Classes whose ranks are stuck: their stacks are taken before they are stopped.
STACK_CLASSES = frozenset({_F.NCCL_TIMEOUT, _F.RENDEZVOUS_FAILURE})

#: Which failure a rank reported names an incident when several arrive together,
#: strongest first (after a notice and a node the reconciler saw vanish, see
#: :func:`primary_cause`). Root causes outrank what they do to the others: a rank's
#: OOM stalls its peers' collectives (timeouts) and torchrun SIGTERMs the rest of
#: each group; those are consequences, never the cause.
CAUSE_ORDER: tuple[frozenset[FailureClass], ...] = (
    frozenset({_F.PREEMPTION_NOTICE}),
    frozenset(
        {
            _F.GPU_HARDWARE,
            _F.CUDA_OOM,
            _F.HOST_OOM_KILLED,
            _F.NAN_DIVERGENCE,
            _F.LOSS_SPIKE,
            _F.SILENT_CORRUPTION,
            _F.USER_CODE_ERROR,
            _F.CHECKPOINT_IO,
            _F.HEALTH_CHECK_FAILED,
            _F.SLOW_PEER,
        }
    ),
    frozenset({_F.NODE_LOST}),
    frozenset({_F.NCCL_TRANSPORT, _F.NCCL_TIMEOUT, _F.RENDEZVOUS_FAILURE, _F.CAPACITY_UNAVAILABLE}),
    frozenset({_F.EXTERNAL_TERMINATION}),
    frozenset({_F.UNKNOWN}),
    frozenset({_F.ELASTIC_GROW}),  # a planned grow yields to any failure beside it
)


@dataclass(frozen=True)
class ReconcileConfig:
    register_timeout_s: float = 180.0
    """A node that has not registered this long after launch is lost."""
    validate_timeout_s: float = 300.0
    """How long ranks may take to report what they resumed from when neither the spec
    (``restarts.validate_timeout_s``) nor an earlier attempt's measured start-up says."""
    validate_floor_s: float = 120.0
    """The least a measured start-up gives (a fast first start is no promise)."""
    validate_factor: float = 3.0
    """The measured start-up is multiplied by this (a relaunch may load more, slower)."""
    signal_slack_s: float = 15.0
    """Beyond the grace period, how long SIGNAL waits for agents to report their exit."""
    slow_reports_to_act: int = 3
    """Straggler reports naming the same node before it is replaced: one slow window
    is noise (a checkpoint upload, a page cache flush); three is a slow node."""
    backoff_base_s: float = 5.0
    """First wait before a relaunch in place or a launch retry; doubles per try."""
    backoff_cap_s: float = 300.0
    launch_retries: int = 2
    """A launch that failed for another reason than capacity (a node's setup that
    could not fetch a package, a provider's transient error) is tried again this many
    times on the same placement, after a backoff, before the job fails with it."""
    hearsay_wait_s: float = 10.0
    """How long a rank's word that a peer crashed (:func:`hearsay`) waits, while a node
    is still silent, for that node's own report or the sight of its loss before it
    opens an incident as ``node_lost``."""
    silence: sl.SilenceConfig = field(default_factory=sl.SilenceConfig)
    """When silence counts against a node (``domain.silence``): intake, stalls,
    disruption."""
    elastic: el.ElasticConfig = field(default_factory=el.ElasticConfig)
    """Whether an elastic run shrinks onto its survivors (``domain.elastic``)."""
    warm_wait_s: float = 20.0
    """How long SIGNAL waits, from the incident's detection, for an elastic job's
    survivors to report that every rank left the broken group and waits warm (their
    next heartbeat): the loss is often seen before they say so, and a rank whose
    save was in flight says so only once that save's collective failed. A survivor
    rank that exits ends the wait at once (its script does not regroup)."""


@dataclass(frozen=True)
class LauncherAbilities:
    """What a launcher can do beyond launch/status/down, declared by the launcher.
    (Staging is no ability: every node stages its checkpoint itself.)"""

    restarts_in_place: bool = False
    """It can start a new attempt on the nodes of the last one (no re-provisioning)."""
    chaos: bool = False
    """It can preempt, kill and slow its nodes on request (``skyresume chaos``)."""
    keeps_survivors: bool = False
    """A relaunch can keep the healthy nodes of the last attempt and add only the
    replacements (another launch) beside them, one group across both."""
    releases_single_nodes: bool = False
    """It can give back one node of a launch (SkyPilot cannot: a cluster goes whole)."""
    refills_clusters: bool = False
    """Launching onto the failed attempt's cluster keeps its running nodes and adds only
    the missing ones, ranks and rendezvous its own (SkyPilot's provisioner does)."""
    confirms_down: bool = False
    """Its ``down`` only asks (SkyPilot's teardown takes minutes): an attempt counts as
    given back once ``confirm_down`` says its clusters are gone, not when asked."""


class LaunchVerb(StrEnum):
    """How an attempt gets its nodes: decided by SELECT (from the failure's class, the
    survivors and the launcher's abilities), recorded with the attempt, carried out by
    LAUNCH as decided. After one failed request of a verb other than a fresh launch,
    the next try is a fresh launch on a new cluster (:func:`launch_verb`)::

        R1 (transport error) -> R2 restart_in_place (ok)
        R1 (preempted) -> R2 refill (refused: the cluster is not INIT with fewer nodes)
          -> R2 fresh launch (ok)
        R1 (preempted) -> R2 refill (StopFailoverError: capacity) -> R2 fresh launch in
          another region (ok)
    """

    LAUNCH = "launch"  # new nodes for the whole group (a new cluster)
    RESTART_IN_PLACE = "restart_in_place"  # every node of the last attempt, restarted
    JOIN_SURVIVORS = "join_survivors"  # the kept nodes restart; replacements launch beside
    REFILL = "refill"  # launched onto the last attempt's cluster: the cloud keeps its
    #                    running nodes and provisions the missing ones
    SHRINK = "shrink"  # elastic: the kept nodes restart at once as a smaller group; the
    #                    replacements launch beside them as standby (``AttemptView.spare``)


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
    step_time: float | None = None
    """The rank's last measured step time, seconds."""
    exit_code: int | None = None
    """How the rank ended, as its agent saw it (None: alive, or not known)."""
    signal: str | None = None
    """The signal that ended it (``SIGTERM``), if one did."""
    cpu_idle_s: float | None = None
    """Seconds since the rank's process last used CPU, as its agent measured (None: not
    measured). Evidence of work for a script that sends no progress reports."""
    max_steps: int | None = None
    """Where the rank's run ends (``training.Run.steps``), when it says."""
    regrouping: int | None = None
    """Elastic warm regroup: the rank left its process group (generation this) and
    waits, alive and warm, for a newer membership; None: in a group, or not known."""


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
    saved_step: int | None = None
    """The node's exit report: the newest checkpoint its ranks reported saving (None:
    none reported; never assumed from the failure's class)."""
    exit_reason: str = ""
    """The node's exit report's reason (``all ranks exited 0``, ``rank 3 ended with
    signal SIGTERM``)."""
    own_found: bool | None = None
    """Its agent found ``checkpoint.own``'s path on the node and passed it to the
    ranks (True), looked and found nothing (False), or was not asked to (None)."""
    ranks: tuple[RankView, ...] = ()
    host: str | None = None
    """The machine the node runs on (what a hardware fault is blamed on)."""
    address: str | None = None
    """Where the service saw its agent register from: a kept node's is the rendezvous
    address of a group that spans launches."""
    held: bool = False
    """SIGNAL held it warm (``HoldWarm``): its agent stays through the attempt's end,
    its ranks wait, and a warm shrink carries it into the next attempt."""

    @property
    def waiting_warm(self) -> bool:
        """Every rank of the node is alive and waiting for a membership (they left a
        group that lost a peer): nothing to save or stop, only a group to re-form."""
        return bool(self.ranks) and all(
            r.regrouping is not None and r.exit_code is None and r.signal is None
            for r in self.ranks
        )


@dataclass(frozen=True)
class LaunchFailure:
    """One launch of the attempt that the provider refused or that failed."""

    at: datetime
    cloud: str
    region: str
    instance_type: str
    capacity: bool
    """A capacity or quota refusal: another region or type may well work."""
    message: str = ""
    retryable: bool = True
    """False when the task itself was refused: trying it again cannot help."""
    verb: LaunchVerb = LaunchVerb.LAUNCH
    """The verb of the request that failed (a refill or a restart in place falls back to
    a fresh launch after one failure)."""


class LaunchPhase(StrEnum):
    """Where a launch request is (``Launcher.progress``)."""

    PROVISIONING = "provisioning"  # asked for; the nodes are not all up yet
    UP = "up"  # every node is provisioned and its task's run has started
    FAILED = "failed"  # the request failed inside the provider
    UNKNOWN = "unknown"  # the provider could not be read now: neither up nor failed


@dataclass(frozen=True)
class LaunchProgress:
    """Where a launch request is (``Launcher.progress``). A launch takes minutes on a
    cloud and can fail after it was accepted; the reconciler polls this instead of
    waiting on it."""

    phase: LaunchPhase
    detail: str = ""
    capacity: bool = False
    """FAILED for want of capacity or quota (a stockout): the job re-plans."""
    hosts: tuple[str, ...] = ()
    """The host of each node once known (UP), in node order."""


@dataclass(frozen=True)
class StagedView:
    """One node's report of staging the checkpoint onto its disk."""

    node_id: str
    ok: bool
    step: int | None = None
    detail: str = ""
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class SpareView:
    """A shrunk attempt's replacements (``LaunchVerb.SHRINK``): launched beside the
    group as standby, training nothing, until the group grows back onto them."""

    count: int
    """How many were asked for."""
    nodes: tuple[NodeView, ...] = ()
    """Those whose agents registered (node ranks after the training group's)."""
    progress: LaunchProgress | None = None
    """Their launch request's progress, read until they are up (None: up, or unread)."""
    up: bool = False
    """The launcher reported them all up."""
    released: bool = False
    """Given back (lost, or never came): the job runs on at its shrunk size."""
    failures: tuple[Failure, ...] = ()
    """Failures reported by or about a spare (a health check, a lost spare): they end
    the spare, never the training group's attempt."""
    node_ids: frozenset[str] = frozenset()
    """Every spare's node id: the standby launch's and any registered past the group."""
    tries: int = 0
    """Standby launches asked for since the group formed, this one's included (0: an
    attempt placed on fewer nodes that asked for none yet)."""
    asked_at: datetime | None = None
    """When this standby launch was requested (None: with the attempt's own launch)."""
    released_at: datetime | None = None
    """When it was given back or refused (None: it was not)."""
    past_ids: frozenset[str] = frozenset()
    """Earlier tries' node ids (given back): their failures end neither the group nor
    this try."""


@dataclass(frozen=True)
class AttemptView:
    number: int
    state: str
    """An ``AttemptState``: launching | running | stopping | ended"""
    started_at: datetime
    num_nodes: int
    ranks_per_node: int
    expected_step: int | None = None
    validated_step: int | None = None
    launched: bool = True
    nodes: tuple[NodeView, ...] = ()
    vanished: tuple[str, ...] = ()
    """Nodes the launcher started that are gone without ever registering."""
    placement: Placement | None = None
    """What it was recorded with and launched on (knobs included)."""
    launch_failures: tuple[LaunchFailure, ...] = ()
    hosts: dict[str, str] = field(default_factory=dict)
    """node id -> host, from the launcher's handle."""
    requested_at: datetime | None = None
    """When the launch request was accepted (the provisioning timeout counts from it)."""
    up_at: datetime | None = None
    """When the launcher reported every node up (the register timeout counts from it);
    None while provisioning."""
    provision: LaunchProgress | None = None
    """The launch request's progress, read while launched and not up."""
    staged: tuple[StagedView, ...] = ()
    """The nodes' staging reports for this attempt."""
    verb: LaunchVerb = LaunchVerb.LAUNCH
    """How SELECT said the attempt gets its nodes (recorded with it)."""
    keep: tuple[str, ...] = ()
    """The failed attempt's nodes this one keeps (a refill or a join)."""
    launches: int = 1
    """How many launches the attempt runs on (kept nodes and their replacements are
    two): a restart in place of several restarts them as one group."""
    spare: SpareView | None = None
    """A shrunk attempt's standby replacements (not in ``nodes``, not in the world:
    ``num_nodes`` counts the training group only)."""
    full_nodes: int | None = None
    """The node count it was placed for when it trains on fewer (a shrunk attempt):
    the spec's ``num_nodes``. None: it trains on every node it was placed for."""

    @property
    def provisioning(self) -> bool:
        """Asked for and not up yet."""
        return self.launched and self.up_at is None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def last_step(self) -> int | None:
        steps = [r.step for n in self.nodes for r in n.ranks if r.step is not None]
        return max(steps) if steps else self.expected_step

    def host_of(self, node_id: str | None) -> str | None:
        if node_id is None:
            return None
        node = next((n for n in self.nodes if n.node_id == node_id), None)
        return self.hosts.get(node_id) or (node.host if node is not None else None)


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
    signature: str | None = None
    """A user error's exception signature (type and normalised message)."""
    step: int | None = None
    """For an anomaly: the step it began at."""


@dataclass(frozen=True)
class ConfirmedCheckpoint:
    """CONFIRM's result: the checkpoint the relaunch resumes from."""

    step: int | None
    """None: no usable checkpoint, a fresh start."""
    uri: str | None = None
    """The step directory (``s3://``, ``gs://``, ``file://``) the new nodes stage."""
    poisoned: dict[int, str] = field(default_factory=dict)
    """step -> manifest digest of checkpoints a rollback went past (never resumed)."""


@dataclass(frozen=True)
class Selection:
    """SELECT's result: what the relaunch runs on and how it gets its nodes."""

    remedy: RecoveryAction
    placement: Placement
    verb: LaunchVerb
    exclude_hosts: tuple[str, ...] = ()
    """Every host this job must never be placed on again."""
    keep: tuple[str, ...] = ()
    """The failed attempt's nodes that stay (a refill or a join), in node-rank order."""
    keep_hosts: tuple[str, ...] = ()
    train_nodes: int | None = None
    """A shrink: the kept nodes train alone as a group of this many while the
    replacements of ``placement.num_nodes`` come up beside them."""
    warm: bool = False
    """A shrink whose kept nodes were held warm at SIGNAL: they are carried into the
    next attempt (a ``regroup`` command each), not restarted."""


@dataclass(frozen=True)
class ResumeValidated:
    """VALIDATE's result when every rank's resume report agreed (a measured start-up)."""

    resumed_step: int


#: What a protocol step hands the steps after it (the store round-trips each).
StepResult = ConfirmedCheckpoint | Selection | ResumeValidated


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
    node_id: str | None = None
    """The node the cause was on (None: the attempt as a whole)."""
    host: str | None = None
    signature: str | None = None
    onset_step: int | None = None
    confirmed: ConfirmedCheckpoint | None = None
    """CONFIRM's result, once it finished."""
    selection: Selection | None = None
    """SELECT's result, once it finished."""

    def outcomes(self) -> dict[ProtocolStep, StepOutcome | None]:
        return {k: v.outcome for k, v in self.steps.items()}


@dataclass(frozen=True)
class CheckpointListing:
    """What the checkpoint store holds, read when CONFIRM needs it."""

    uri: str
    complete: tuple[int, ...] = ()
    """Steps of the checkpoints with a manifest and a COMMIT that names it."""
    digests: dict[int, str] = field(default_factory=dict)
    """step -> manifest digest of each complete one (a step saved again differs)."""
    error: str | None = None
    """The store could not be read: missing, never empty (a blind listing would
    restart from step 0 and throw the saved work away)."""


@dataclass(frozen=True)
class JobSnapshot:
    job_id: str
    status: JobStatus
    now: datetime
    spec: JobSpec
    attempt: AttemptView | None = None
    """The newest attempt; None before the first launch."""
    failures: tuple[Failure, ...] = ()
    """Failure events of the newest attempt, oldest first."""
    incident: IncidentView | None = None
    """The incident whose protocol has not finished, if any."""
    past_incidents: tuple[rm.PastIncident, ...] = ()
    """The job's earlier incidents, oldest first (the open one excluded)."""
    listing: CheckpointListing | None = None
    """Gathered while the open incident is at CONFIRM."""
    candidates: tuple[Candidate, ...] | None = None
    """What the launcher could run the job on, gathered when a placement is chosen."""
    candidates_error: str | None = None
    history: tuple[FailureRecord, ...] = ()
    """Placement failures of every job (preemptions, lost nodes, stockouts)."""
    excluded_hosts: frozenset[str] = frozenset()
    """Hosts earlier incidents of this job blamed (never relaunched into)."""
    abilities: LauncherAbilities = LauncherAbilities()
    restarts_done: int = 0
    """Relaunches after an incident so far (the job's restart count)."""
    blocking_save_s: float | None = None
    """The longest recent save that blocked training (the ranks' checkpoint reports)."""
    poisoned: frozenset[tuple[int, str]] = frozenset()
    """(step, manifest digest) of checkpoints an earlier rollback went past: saved
    from a diverged state, never resumed (until the run saves that step again)."""
    heard_since: datetime | None = None
    """Since when the service deciding has been there to hear agents (its reconciler's
    start). Silence is counted from then at the earliest: heartbeats that went
    unanswered while the service itself was down (a restart, a crash) say nothing
    about the nodes, so a restart never turns into every node lost."""
    startup_s: tuple[float, ...] = ()
    """Measured start-ups of the job's validated attempts: seconds from their nodes being
    up to every rank having reported what it resumed from."""
    plain: bool = False
    """A ``plain_script`` event was recorded for the job: its ranks send no progress
    reports, and it runs under the plain-script contract from then on."""
    intake: tuple[sl.IntakeSample, ...] = ()
    """The fleet's heartbeat intake per reconciler tick, oldest first (``domain.silence``):
    time in which the service heard too little, or did not run, is not held against a
    node. Empty: nothing is known, silence counts as it is (since ``heard_since``)."""
    degraded_noted: bool = False
    """A ``control_plane_degraded`` event was recorded for the newest attempt."""
    provision_s: tuple[float, ...] = ()
    """Measured provisioning times (request accepted to every node up) of recent fresh
    launches in the newest attempt's cloud and region, any job's: what a
    replacement is expected to take (``domain.elastic``)."""

    @property
    def num_nodes(self) -> int:
        return self.spec.num_nodes

    @property
    def ranks_per_node(self) -> int:
        return self.spec.ranks_per_node

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.spec.restarts.heartbeat_timeout_s

    @property
    def grace_s(self) -> float:
        return self.spec.restarts.grace_period_s


# --- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SetStatus:
    status: JobStatus
    reason: str


@dataclass(frozen=True)
class RecordAttempt:
    """Record attempt ``number`` with exactly what LAUNCH will start: the placement,
    the knobs and where the ranks resume from. Its nodes start on a later tick, once
    the row is committed (an agent registering first would be told it is stale)."""

    number: int
    incident_id: int | None
    placement: Placement
    resume_step: int | None
    """None: whatever the ranks find (first launch); 0: fresh; N: that step only."""
    resume_from: str
    """``latest`` | ``none`` | a step directory path (``{node_disk}`` allowed) or URI."""
    verb: LaunchVerb = LaunchVerb.LAUNCH
    """How the attempt gets its nodes (SELECT's decision)."""
    exclude_hosts: tuple[str, ...] = ()
    skip_steps: tuple[int, int] | None = None
    """rollback_skip: the ranks skip the batches of these steps (inclusive)."""
    collective_timeout_s: int | None = None
    """The process group's timeout from the measured step and save times."""
    stage_from: str | None = None
    """The confirmed step directory (``s3://``, ``gs://``, ``file://``) each node stages
    onto its own disk before its ranks start; ``resume_from`` then names the staged copy."""
    keep: tuple[str, ...] = ()
    """Nodes of the failed attempt that stay (healthy): they take node ranks 0..k-1 and
    restart in place; only the rest is launched, beside them."""
    keep_hosts: tuple[str, ...] = ()
    train_nodes: int | None = None
    """A shrink (``LaunchVerb.SHRINK``): the first this many nodes (the kept ones) are
    the training group; the rest of ``placement.num_nodes`` launch as standby."""
    warm: bool = False
    """A shrink whose kept nodes are carried warm (``Selection.warm``): LAUNCH hands
    each one a membership instead of restarting it."""


@dataclass(frozen=True)
class StartNodes:
    """Start the recorded attempt's nodes (the launcher is asked, never blocked on
    twice: a launcher that already started them returns the same handle)."""

    number: int
    incident_id: int | None = None
    verb: LaunchVerb = LaunchVerb.LAUNCH
    """How: ``decide`` says, the reconciler carries it out (never picks one itself)."""
    launch_try: int = 0
    """The attempt's failed requests so far: the request's key (job, attempt, try), so a
    failed request is never adopted again."""


@dataclass(frozen=True)
class MarkProvisioned:
    """The launch request is done: every node is up (the register timeout starts)."""

    number: int
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchRequestFailed:
    """The provider failed the accepted launch request (or it never came up in the
    provisioning timeout): record it as a refused launch and give the nodes back."""

    number: int
    detail: str
    capacity: bool
    verb: LaunchVerb = LaunchVerb.LAUNCH
    """The verb of the request that failed."""


@dataclass(frozen=True)
class Replan:
    """The attempt's launch was refused for capacity: record the next placement."""

    number: int
    placement: Placement
    reason: str


@dataclass(frozen=True)
class RecordFailure:
    """A failure the reconciler itself detected (no agent could report it)."""

    kind: EventKind
    failure_class: FailureClass
    node_id: str | None
    message: str
    rank: int | None = None


@dataclass(frozen=True)
class RecordNote:
    """A fact about the job the reconciler noticed that is no failure (recorded once
    per kind, attempt and ``key``): e.g. its ranks send no progress reports."""

    kind: EventKind
    attempt: int
    message: str
    key: str = ""
    """Tells apart notes of one kind in one attempt (a spare's tries)."""


@dataclass(frozen=True)
class OpenIncident:
    cause: Failure
    attempt: int
    last_step: int | None
    consequences: tuple[int, ...] = ()
    """Event ids of the attempt's other failures: what the cause did to the rest."""
    host: str | None = None
    onset_step: int | None = None


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
    result: StepResult | None = None


@dataclass(frozen=True)
class SendCommand:
    attempt: int
    type: CommandType
    args: dict[str, object]


@dataclass(frozen=True)
class HoldWarm:
    """Elastic: keep these nodes of the attempt as they are, agents and ranks alive
    (their ranks left the group that lost a peer and wait for a membership). Their
    agents are answered after the attempt ends, until a warm shrink carries them into
    the next attempt or they are restarted or released."""

    attempt: int
    node_ids: tuple[str, ...]


@dataclass(frozen=True)
class Release:
    """Mark the attempt ended; tear its nodes down unless they stay for a restart in
    place."""

    attempt: int
    reason: str
    keep_nodes: bool = False
    release_nodes: tuple[str, ...] = ()
    """With ``keep_nodes``: these nodes of the attempt are given back all the same (the
    lost ones, when the healthy ones stay for the relaunch)."""


@dataclass(frozen=True)
class MarkValidated:
    attempt: int
    step: int


@dataclass(frozen=True)
class ReleaseSpare:
    """Give back a shrunk attempt's standby replacements (lost, or never up): the
    attempt goes on training at its shrunk size."""

    attempt: int
    reason: str


@dataclass(frozen=True)
class LaunchSpare:
    """Ask again for the replacements of an attempt that trains on fewer nodes than
    the spec's (its standby was refused or given back, or it was placed on fewer):
    ``count`` nodes launch beside the group as standby, node ranks from
    ``node_rank_base``, and the group grows onto them once they registered."""

    attempt: int
    count: int
    node_rank_base: int
    """Past every earlier try's: a new try's nodes never take a given-back one's id."""
    tries: int
    """The standby launches the attempt will have asked for, this one included."""
    reason: str


Action = (
    SetStatus
    | HoldWarm
    | RecordAttempt
    | StartNodes
    | MarkProvisioned
    | LaunchRequestFailed
    | Replan
    | RecordFailure
    | RecordNote
    | OpenIncident
    | StartStep
    | FinishStep
    | SendCommand
    | Release
    | MarkValidated
    | ReleaseSpare
    | LaunchSpare
)

FOLLOWED_AT_ONCE: tuple[type, ...] = (
    OpenIncident, StartStep, FinishStep, RecordFailure, RecordAttempt, HoldWarm,
    MarkProvisioned, MarkValidated,
)  # fmt: skip
"""Actions that only write down what the next round acts on (an incident opened, a
protocol step started or finished, an attempt recorded, nodes held or up, a resume
checked). Nothing outside the service has to happen first, so the next round is
decided at once rather than one reconcile interval later: a recovery is a dozen such
rounds, and at 0.5 s apiece they were most of an elastic shrink's pause."""

MAX_ROUNDS_AT_ONCE = 10
"""Rounds one tick runs for one job back to back, at most (a bound, never reached by
a protocol that makes progress)."""


def decides_again_at_once(actions: Sequence[Action], previous: Sequence[Action] = ()) -> bool:
    """Whether a round that applied ``actions`` (after one that applied ``previous``) is
    followed at once by another round for the same job: it recorded something the next
    decision reads, and it did not repeat the round before (a round deciding the same
    thing twice is waiting on the world, not on its own record)."""
    if list(actions) == list(previous):
        return False
    return any(isinstance(a, FOLLOWED_AT_ONCE) for a in actions)


# --- detect --------------------------------------------------------------------------------


def _age(now: datetime, then: datetime | None) -> float:
    return float("inf") if then is None else (now - then).total_seconds()


def _silence(
    s: JobSnapshot,
    last_heard: datetime | None,
    blind: sl.Deafness,
    cfg: ReconcileConfig,
    peers_heard_after: float | None = None,
) -> float:
    """How long a node has been silent as far as this service can tell: since its
    last heartbeat, or since the service came up when that was later, less the time
    the service itself was deaf or stalled (``domain.silence``), unless the fleet and
    its job's peers were heard around it since (``peers_heard_after``)."""
    if last_heard is not None and s.heard_since is not None:
        last_heard = max(last_heard, s.heard_since)
    return sl.relative_silence(
        last_heard, s.now, blind, cfg.silence, peers_heard_after=peers_heard_after
    )


def silences(s: JobSnapshot, a: AttemptView, cfg: ReconcileConfig) -> dict[str, float]:
    """Each live (not exited) node's relative silence, in seconds."""
    blind = sl.deafness(s.intake, s.now, cfg.silence)
    live = [n for n in a.nodes if not n.exited]
    around = sl.peers_heard_after(
        {n.node_id: n.last_heartbeat_at for n in live}, blind, cfg.silence
    )
    return {
        n.node_id: _silence(s, n.last_heartbeat_at, blind, cfg, around[n.node_id]) for n in live
    }


def degraded_note(s: JobSnapshot, a: AttemptView, cfg: ReconcileConfig) -> RecordNote | None:
    """A ``control_plane_degraded`` note (once per attempt) when silence past the
    timeout was not held against nodes: the service was deaf or stalled, or many of
    the job's nodes went silent at once (a disruption)."""
    if s.degraded_noted or a.state not in (AttemptState.LAUNCHING, AttemptState.RUNNING):
        return None
    timeout = s.heartbeat_timeout_s
    relative = silences(s, a, cfg)
    waiting = sl.disruption(relative, timeout, cfg.silence)
    if waiting is not None:
        return RecordNote(EventKind.CONTROL_PLANE_DEGRADED, a.number, waiting.message(timeout))
    blind = sl.deafness(s.intake, s.now, cfg.silence)
    no_blind = sl.Deafness()
    forgiven = [
        n.node_id
        for n in a.nodes
        if not n.exited
        and _silence(s, n.last_heartbeat_at, no_blind, cfg) > timeout >= relative[n.node_id]
    ]
    if not forgiven:
        return None
    why = "did not run" if blind.stalls else "heard too little of the fleet"
    return RecordNote(
        EventKind.CONTROL_PLANE_DEGRADED,
        a.number,
        f"{len(forgiven)} of {len(relative)} nodes silent past the {timeout:.0f} s heartbeat "
        f"timeout (first {forgiven[0]}) while the service {why}: not held against them",
    )


def hearsay(f: Failure) -> bool:
    """A rank's log that says a *peer* crashed (gloo's "Connection closed by peer ...
    typically caused by a remote worker crashing", classed ``node_lost``): a claim
    about another node, not the reconciler's own sight of a loss (kind ``node_lost``)."""
    return f.failure_class is _F.NODE_LOST and f.kind != EventKind.NODE_LOST


def _all_nodes_spoke(failures: tuple[Failure, ...], nodes: Collection[str]) -> bool:
    """Every one of ``nodes`` reported a failure of its own: none is silent."""
    return bool(nodes) and set(nodes) <= {f.node_id for f in failures}


def primary_cause(failures: tuple[Failure, ...], nodes: Collection[str] = ()) -> Failure:
    """The first cause among failures that arrived together.

    A notice first; then a node the reconciler saw vanish or go silent, whatever its
    peers' logs say (they crash *because* it vanished: a collective to a dead peer
    reads like anything, a transport error, a timeout, even a user error when a
    warning line matches); then the strongest class in :data:`CAUSE_ORDER`, the
    earliest within it.

    A :func:`hearsay` loss is set aside when every node of the attempt (``nodes``)
    reported a failure of its own: no node is missing, so the peer that "crashed" is
    one that said why itself (a rank whose collective failed on a transport error;
    gloo then closes its pairs and every peer reads a remote crash). Seen on SkyPilot:
    the peer's exit reached the service before the failed rank's own report."""
    notices = [f for f in failures if f.failure_class is _F.PREEMPTION_NOTICE]
    if notices:
        return min(notices, key=lambda f: (f.occurred_at, f.event_id))
    lost = [f for f in failures if f.kind == EventKind.NODE_LOST]
    if lost:
        return min(lost, key=lambda f: (f.occurred_at, f.event_id))
    pool = failures
    if _all_nodes_spoke(failures, nodes) and not all(hearsay(f) for f in failures):
        pool = tuple(f for f in failures if not hearsay(f))
    for group in CAUSE_ORDER:
        found = [f for f in pool if f.failure_class in group]
        if found:
            return min(found, key=lambda f: (f.occurred_at, f.event_id))
    return pool[0]


def _node_ids(a: AttemptView) -> tuple[str, ...]:
    return tuple(n.node_id for n in a.nodes)


def _silent_nodes(a: AttemptView, failures: tuple[Failure, ...]) -> list[str]:
    """The attempt's live nodes that reported no failure."""
    spoke = {f.node_id for f in failures}
    return [n.node_id for n in a.nodes if not n.exited and n.node_id not in spoke]


def _after_hearsay(s: JobSnapshot, a: AttemptView, failures: tuple[Failure, ...],
                   cfg: ReconcileConfig) -> list[Action] | None:  # fmt: skip
    """What only :func:`hearsay` so far calls for, or None to open the incident.

    For up to ``hearsay_wait_s``: wait ([]) for the crashed rank's own report (its
    transport error then names the incident) or for the sight of a node's loss
    (``detect``). Also when every node has spoken, hearsay alone: a rank that crashed
    took its node's other ranks down with it (torchrun SIGTERMs them, and they too read
    the broken pairs as a peer's crash), and their word may reach the service before
    the crashed rank's own exit report (seen here: a chaos transport error in rank 0
    recorded as node_lost). After the wait, when exactly one live node is still
    silent, that node is the one the peers heard crash: its loss is recorded on it.
    The reporter is the witness, not the lost node; an incident named after it gave
    back the survivor and kept the dead node (seen on the emulated AWS with one
    cluster per node: the survivor's cluster downed, the join failed, a fresh
    launch, 143 s).

    Hearsay beside a rank's own error waits too while some node is still silent: the
    rank that crashed and a rank of its own node that read the broken pairs spoke
    first, the other nodes not yet (seen here on a loaded machine: rank 0's transport
    error and rank 1's "closed by peer", both on node 0, node 1 a second later; named
    node_lost, the live node 0 was replaced). Once every node has spoken,
    :func:`primary_cause` sets the hearsay aside."""
    heard = [f for f in failures if hearsay(f)]
    if not heard:
        return None
    if len(heard) < len(failures) and _all_nodes_spoke(failures, _node_ids(a)):
        return None
    silent = _silent_nodes(a, failures)
    first = min(heard, key=lambda f: (f.occurred_at, f.event_id))
    if (s.now - first.occurred_at).total_seconds() < cfg.hearsay_wait_s:
        return []
    if len(silent) != 1:
        return None
    return [
        RecordFailure(
            EventKind.NODE_LOST,
            _F.NODE_LOST,
            silent[0],
            f"node {silent[0]} is silent while its peers' ranks say a peer crashed "
            f"({first.node_id}: {first.message})"[:500],
        )
    ]


def detect(s: JobSnapshot, a: AttemptView, cfg: ReconcileConfig) -> RecordFailure | None:
    """A failure nobody reported: a node that vanished, went silent or never came up,
    or a rank that stopped making progress. None while the attempt looks healthy."""
    if a.state not in (AttemptState.LAUNCHING, AttemptState.RUNNING):
        return None
    seen = {n.node_rank: n for n in a.nodes}
    relative = silences(s, a, cfg)
    # Many nodes silent at once: the service waits (``degraded_note`` says so); a node
    # the launcher says is gone is still lost below, whatever the others do.
    waiting = sl.disruption(relative, s.heartbeat_timeout_s, cfg.silence)
    if a.vanished:
        return RecordFailure(
            EventKind.NODE_LOST,
            _F.NODE_LOST,
            a.vanished[0],
            f"node {a.vanished[0]} is gone: it exited before it registered with the service",
        )
    for node in a.nodes:
        if node.exited:
            continue
        if node.alive is False:
            return RecordFailure(
                EventKind.NODE_LOST,
                _F.NODE_LOST,
                node.node_id,
                f"node {node.node_id} is gone: its processes vanished without a notice",
            )
        hb = relative[node.node_id]
        if hb > s.heartbeat_timeout_s and waiting is None:
            return RecordFailure(
                EventKind.NODE_LOST,
                _F.NODE_LOST,
                node.node_id,
                f"node {node.node_id} sent no heartbeat for {hb:.0f} s "
                f"(timeout {s.heartbeat_timeout_s:.0f} s)",
            )
    if waiting is None:
        alone = _left_behind(s, a, relative, cfg)
        if alone is not None:
            return alone
    # A hang is a rank that stopped while its agent still heartbeats. While some node's
    # agent has been silent for half the timeout, the others' stalled ranks are waiting
    # on it: that node is lost at the timeout, and calling its peers hung first (their
    # silence counts the last report's age too) named the wrong failure in a race.
    unheard = any(hb > s.heartbeat_timeout_s / 2 for hb in relative.values())
    if a.validated_step is not None and not unheard:
        # A frozen rank stalls every peer at its next collective, so all go silent
        # together; name them all, the one silent longest first.
        silent = sorted(
            (
                ((r.report_age_s or 0.0) + relative[n.node_id], r.rank, n.node_id)
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
                EventKind.RANK_HANG,
                _F.NCCL_TIMEOUT,
                node_id,
                f"rank {rank} on {node_id} made no progress for {age:.0f} s "
                f"(timeout {s.heartbeat_timeout_s:.0f} s): hung in a collective?"
                + (f" Also silent: ranks {others}." if others else ""),
                rank=rank,
            )
    if a.up_at is not None and _age(s.now, a.up_at) > cfg.register_timeout_s:
        for k in range(a.num_nodes):
            if k not in seen:
                return RecordFailure(
                    EventKind.NODE_LOST,
                    _F.NODE_LOST,
                    None,
                    f"node {k} of attempt {a.number} never registered "
                    f"in {cfg.register_timeout_s:.0f} s after it was up",
                )
    return None


def _left_behind(
    s: JobSnapshot, a: AttemptView, relative: dict[str, float], cfg: ReconcileConfig
) -> RecordFailure | None:
    """The peer a warm group lost: every live node but one waits warm (each of its
    ranks left a group that lost a peer, alive, for a new membership) and that one
    has been silent for ``hearsay_wait_s`` (at most half the heartbeat timeout). A
    live node of a broken group regroups too, and its agent beats at once when its
    ranks do; one that stays silent is the one they lost. On a cloud this is seen
    long before the heartbeat timeout or the launcher's status (SkyPilot's cached
    status stays UP until its refresh daemon runs, every 60 s: sky/server/
    constants.py:110, shared/SKYPILOT.md); the local provisioner sees the processes
    vanish at once (``alive``)."""
    live = [n for n in a.nodes if not n.exited]
    behind = [n for n in live if not n.waiting_warm]
    if len(live) < 2 or len(behind) != 1:
        return None
    node = behind[0]
    quiet = relative.get(node.node_id, 0.0)
    if quiet < min(cfg.hearsay_wait_s, s.heartbeat_timeout_s / 2):
        return None
    return RecordFailure(
        EventKind.NODE_LOST,
        _F.NODE_LOST,
        node.node_id,
        f"node {node.node_id} silent for {quiet:.0f} s while every rank of its "
        f"{len(live) - 1} peer node{'s' if len(live) > 2 else ''} left the group to regroup "
        f"(heartbeat timeout {s.heartbeat_timeout_s:.0f} s)",
    )


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


def _actionable(s: JobSnapshot, cfg: ReconcileConfig) -> tuple[Failure, ...]:
    """The failures that open an incident: a straggler counts once it was reported
    ``slow_reports_to_act`` times for the same node, every other failure at once."""
    slow: dict[str | None, int] = {}
    for f in s.failures:
        if f.failure_class is _F.SLOW_PEER:
            slow[f.node_id] = slow.get(f.node_id, 0) + 1
    return tuple(
        f
        for f in s.failures
        if f.failure_class is not _F.SLOW_PEER or slow[f.node_id] >= cfg.slow_reports_to_act
    )


# --- decide --------------------------------------------------------------------------------


def decide(s: JobSnapshot, cfg: ReconcileConfig | None = None) -> list[Action]:
    cfg = cfg or ReconcileConfig()
    a = s.attempt
    if s.status.is_terminal():
        if a is not None and a.state != AttemptState.ENDED:
            return [Release(a.number, f"job {s.status}")]
        return []
    if a is None:
        return _first_launch(s)
    if finished(a) and not _stopped_by_us(s, a):
        # Before any protocol step: a run that finished is never restarted, whatever
        # step an incident is at (a relaunch that ran to its end never validated).
        return _succeed(s, a)
    if s.incident is not None:
        return _protocol(s, a, s.incident, cfg)
    if a.state == AttemptState.LAUNCHING and (not a.launched or a.provisioning):
        return _launch(s, a, None, cfg)

    failures = _actionable(s, cfg)
    refusal = _refusal(failures)
    if refusal is not None:
        return _fail(a, f"ranks refused to resume: {refusal.message or refusal.kind}")
    if failures:
        # A node that vanished names the incident even if its peers' crashes were
        # reported first: record it before opening.
        lost = detect(s, a, cfg)
        if (
            lost is not None
            and lost.failure_class is _F.NODE_LOST
            and not any(f.kind == EventKind.NODE_LOST for f in failures)
        ):
            return [lost]
        waiting = _after_hearsay(s, a, failures, cfg)
        if waiting is not None:
            return waiting
        cause = primary_cause(failures, _node_ids(a))
        onsets = [
            f.step
            for f in failures
            if f.failure_class is cause.failure_class and f.step is not None
        ]
        return [
            OpenIncident(
                cause,
                a.number,
                a.last_step(),
                consequences=tuple(f.event_id for f in failures if f is not cause),
                host=a.host_of(cause.node_id),
                onset_step=min(onsets) if onsets else None,
            ),
            SetStatus(JobStatus.RECOVERING, f"{cause.failure_class}: {cause.message}"[:500]),
        ]
    found = detect(s, a, cfg)
    if found is not None:
        return [found]
    note = degraded_note(s, a, cfg)
    if note is not None:
        return [note]
    if a.state == AttemptState.ENDED:
        return [SetStatus(JobStatus.FAILED, f"attempt {a.number} ended with no outcome recorded")]

    if a.validated_step is None:
        step = resumed_everywhere(a)
        if step is not None:
            out: list[Action] = [MarkValidated(a.number, step)]
            if s.status is JobStatus.PROVISIONING:
                out.append(SetStatus(JobStatus.RUNNING, f"all {a.world_size} ranks at step {step}"))
            return out
        start = startup(s, a, cfg)
        if isinstance(start, RecordFailure):
            return [start]
        if isinstance(start, PlainRun):
            plain: list[Action] = [] if s.plain else [RecordNote(_PLAIN, a.number, start.notice)]
            if s.status is JobStatus.PROVISIONING:
                plain.append(SetStatus(JobStatus.RUNNING, start.status))
            return plain
    if a.validated_step is None:
        return []
    if a.spare is not None:
        return _spare(s, a, a.spare, cfg)
    return _ask_again(s, a, None, cfg)


# --- elastic: the shrunk group's spare --------------------------------------------------


def _spare(s: JobSnapshot, a: AttemptView, sp: SpareView, cfg: ReconcileConfig) -> list[Action]:
    """A shrunk attempt that trains: grow back once every replacement registered, or
    give them up (and run on shrunk) when they failed or never came."""
    if sp.released:
        return _ask_again(s, a, sp, cfg)
    lost = _spare_lost(s, a, sp, cfg)
    if lost is not None:
        text = (
            f"replacement lost: {lost}; training goes on at {a.num_nodes} of "
            f"{a.full_nodes or a.num_nodes} nodes (min_nodes {s.spec.effective_min_nodes})"
        )
        key = f"t{sp.tries}" if sp.tries > 1 else ""
        return [RecordNote(EventKind.ELASTIC, a.number, text, key), ReleaseSpare(a.number, lost)]
    if len(sp.nodes) >= sp.count:
        ids = ", ".join(n.node_id for n in sp.nodes)
        return [
            RecordFailure(
                EventKind.GROW,
                _F.ELASTIC_GROW,
                None,
                f"replacement{'s' if sp.count > 1 else ''} {ids} registered: growing from "
                f"{a.num_nodes} to {a.num_nodes + sp.count} nodes at the next step boundary",
            )
        ]
    return []


def _work_left(a: AttemptView) -> tuple[int | None, float | None]:
    """The steps the ranks say are left and the slowest rank's step time (None: not
    said): what the elastic weighings set against a replacement's provisioning."""
    times = [r.step_time for n in a.nodes for r in n.ranks if r.step_time is not None]
    ends = [r.max_steps for n in a.nodes for r in n.ranks if r.max_steps is not None]
    last = a.last_step()
    left = max(0, max(ends) - last) if ends and last is not None else None
    return left, (max(times) if times else None)


def _ask_again(
    s: JobSnapshot, a: AttemptView, sp: SpareView | None, cfg: ReconcileConfig
) -> list[Action]:
    """An attempt that trains on fewer nodes than the spec's, with no replacement
    coming (``sp`` given back or refused, or None: placed on fewer and none asked
    for): ask for them again when ``domain.elastic`` says it is time."""
    training = a.num_nodes
    if training >= s.spec.num_nodes or not s.spec.elastic_nodes or a.placement is None:
        return []
    if a.state != AttemptState.RUNNING:
        return []
    if not s.abilities.keeps_survivors or s.abilities.refills_clusters:
        why = (
            f"training on {training} of {s.spec.num_nodes} nodes: this launcher cannot "
            "launch nodes beside a running group, so the job runs on at this size"
        )
        return [RecordNote(EventKind.ELASTIC, a.number, why, "run-on")]
    tries = sp.tries if sp is not None else 0
    since = sp.released_at if sp is not None else None
    waited = _age(s.now, since or a.up_at or a.started_at)
    steps_left, step_time = _work_left(a)
    choice = el.choose_ask_again(
        s.spec,
        training,
        tries=tries,
        waited_s=waited,
        provision_s=s.provision_s,
        steps_left=steps_left,
        step_time_s=step_time,
        cfg=cfg.elastic,
    )
    if not choice.ask:
        if waited >= choice.wait_s:  # not for a wait: the job ends first (said once)
            return [RecordNote(EventKind.ELASTIC, a.number, choice.reason, "run-on")]
        return []
    count = s.spec.num_nodes - training
    return [LaunchSpare(a.number, count, training + tries * count, tries + 1, choice.reason)]


def _spare_lost(s: JobSnapshot, a: AttemptView, sp: SpareView, cfg: ReconcileConfig) -> str | None:
    """Why the spare is given up, or None while it may still come."""
    if sp.failures:
        f = sp.failures[0]
        return f"{f.node_id or 'a spare'}: {f.failure_class}: {f.message}"[:500]
    if sp.progress is not None and sp.progress.phase is LaunchPhase.FAILED:
        return f"its launch failed: {sp.progress.detail or 'the provider failed it'}"
    waited = _age(s.now, sp.asked_at or a.requested_at)
    limit = s.spec.restarts.provision_timeout_s
    if not sp.up and len(sp.nodes) < sp.count and waited > limit:
        return f"not provisioned after {waited:.0f} s (provision_timeout_s {limit:.0f})"
    if len(sp.nodes) < sp.count and waited > limit + cfg.register_timeout_s:
        return f"up, but not every agent registered in {waited:.0f} s"
    blind = sl.deafness(s.intake, s.now, cfg.silence)
    for n in sp.nodes:
        if n.alive is False:
            return f"{n.node_id} is gone"
        quiet = _silence(s, n.last_heartbeat_at, blind, cfg)
        if quiet > s.heartbeat_timeout_s:
            return f"{n.node_id} silent for {quiet:.0f} s"
    return None


def _fail(a: AttemptView | None, reason: str) -> list[Action]:
    out: list[Action] = [SetStatus(JobStatus.FAILED, reason[:2000])]
    if a is not None and a.state != AttemptState.ENDED:
        out.append(Release(a.number, reason))
    return out


def _knobs_for_memory(spec: JobSpec, p: Placement) -> tuple[Placement, str | None]:
    """Knobs replanned for the GPU memory a placement declares (None: it does not fit,
    with the planner's reason)."""
    if spec.model is None or not p.gpu_memory_gib or p.knobs is not None:
        return p, None
    try:
        plan = plan_memory(spec.model, p.gpu_memory_gib, spec.num_nodes * spec.ranks_per_node)
    except (DoesNotFit, BatchNotDivisible) as e:
        return p, str(e)
    return replace(p, knobs=plan.knobs, reasons=(*p.reasons, *plan.reasons)), None


def _first_launch(s: JobSnapshot) -> list[Action]:
    if s.candidates is None:
        return _fail(None, f"no placement: {s.candidates_error or 'the launcher offered none'}")
    choice = rm.select_placement(s.spec, s.candidates, s.history, s.now)
    if choice.placement is None:
        return _fail(None, f"no placement: {choice.reason}")
    placement, why = _knobs_for_memory(s.spec, choice.placement)
    if why is not None:
        return _fail(None, f"no placement: {why}")
    return [
        SetStatus(JobStatus.PROVISIONING, "launching attempt 1"),
        RecordAttempt(1, None, placement, None, "latest"),
    ]


def _protocol(
    s: JobSnapshot, a: AttemptView, inc: IncidentView, cfg: ReconcileConfig
) -> list[Action]:
    for done_step in ORDER[:-1]:
        done = inc.steps.get(done_step)
        if done is not None and done.outcome is StepOutcome.FAILED:
            # The step said why; the job ends with it (no other step can follow).
            return _fail(a, done.detail or f"{done_step} failed")
    step = next(
        (p for p in ORDER if inc.steps.get(p) is None or inc.steps[p].outcome is None), None
    )
    if step is None:  # gather only passes open incidents; nothing to do
        return []
    i = inc.event_id
    view = inc.steps.get(step)
    if step is _P.SIGNAL and view is None and _awaiting_warm(s, a, inc, cfg):
        return []  # nothing signalled yet: a stop would end ranks that are about to wait
    start: list[Action] = [StartStep(i, step)] if view is None else []
    if step is _P.SIGNAL:
        return start + _signal(s, a, inc, view, cfg)
    if step is _P.CONFIRM_CHECKPOINT:
        return start + _confirm(s, a, inc)
    if step is _P.SELECT_REPLACEMENT:
        return start + _select(s, a, inc, cfg)
    if step is _P.LAUNCH:
        if a.number <= inc.attempt:
            return start + _record_relaunch(s, a, inc)
        return start + _launch(s, a, inc, cfg)
    if step is _P.STAGE:
        return start + _stage(s, a, inc, cfg)
    if step is _P.VALIDATE:
        return start + _validate(s, a, inc, cfg, started=view is not None)
    return []  # DETECT is written when the incident opens


def _signal(
    s: JobSnapshot, a: AttemptView, inc: IncidentView, view: StepView | None, cfg: ReconcileConfig
) -> list[Action]:
    i, step = inc.event_id, _P.SIGNAL
    if view is None:
        warm = warm_survivors(s, a, inc)
        if warm:
            gone = [n.node_id for n in a.nodes if n.node_id not in warm]
            return [
                HoldWarm(inc.attempt, warm),
                FinishStep(
                    i,
                    step,
                    StepOutcome.OK,
                    f"held warm, not stopped: every rank of {', '.join(warm)} left its group "
                    "when a peer was lost and waits for a membership (nothing to save: the "
                    "group is gone); "
                    + (f"{', '.join(gone)}: {stop_evidence(a)}" if gone else "no node lost"),
                ),
            ]
        reason = str(inc.failure_class)
        if inc.failure_class in SAVE_CLASSES:
            args: dict[str, object] = {"reason": reason, "grace_s": s.grace_s}
            return [SendCommand(inc.attempt, CommandType.CHECKPOINT_AND_STOP, args)]
        args = {"reason": reason}
        if inc.failure_class in STACK_CLASSES:
            args["capture_stacks"] = True  # the evidence, before the kill
        if inc.failure_class in rm.ANOMALIES:
            args["save"] = False  # the ranks hold the diverged state: never save it
        return [SendCommand(inc.attempt, CommandType.STOP, args)]
    waited = _age(s.now, view.started_at)
    # A node silent past the heartbeat timeout cannot hear the command (cut off, or
    # gone): waiting out its grace would only idle the others.
    relative = silences(s, a, cfg)
    silent = [
        n.node_id
        for n in a.nodes
        if not (n.exited or n.alive is False) and relative[n.node_id] > s.heartbeat_timeout_s
    ]
    if _all_stopped(a) or (
        silent and all(n.exited or n.alive is False or n.node_id in silent for n in a.nodes)
    ):
        unheard = f"; not waited for, silent past the heartbeat timeout: {', '.join(silent)}"
        return [
            FinishStep(
                i,
                step,
                StepOutcome.OK,
                f"{stop_evidence(a, silent)} ({waited:.1f} s)" + (unheard if silent else ""),
            )
        ]
    if waited > s.grace_s + cfg.signal_slack_s:
        left = [n.node_id for n in a.nodes if not (n.exited or n.alive is False)]
        return [
            FinishStep(
                i,
                step,
                StepOutcome.OK,
                f"grace of {s.grace_s:.0f} s over; still running, released: {', '.join(left)}; "
                f"{stop_evidence(a, left)}",
            )
        ]
    return []


def stop_evidence(a: AttemptView, unheard: list[str] | tuple[str, ...] = ()) -> str:
    """How the attempt's ranks stopped, said only from the nodes' exit reports and the
    ranks' exit codes and signals, never from the failure's class. A save is claimed
    where a node exited 75 (its ranks agreed on a step and committed the save before
    exiting) and its step where a node reported it (``saved_step``: only rank 0 reports
    commits, so the other nodes' exit reports carry none)."""
    said: list[str] = []
    saved: set[int] = set()
    savers = 0
    for n in a.nodes:
        if n.node_id in unheard:
            continue
        if not n.exited:
            if n.alive is False:
                said.append(f"{n.node_id} gone without an exit report")
            continue
        if n.exit_code == int(ExitCode.PREEMPTED_SAVED):
            savers += 1
            if n.saved_step is not None:
                saved.add(n.saved_step)
                said.append(f"{n.node_id} saved step {n.saved_step} and stopped (exit 75)")
            else:
                said.append(f"{n.node_id} saved and stopped (exit 75)")
        elif n.exit_code == 0:
            said.append(f"{n.node_id}: every rank exited 0")
        else:
            what = n.exit_reason or f"exit code {n.exit_code}"
            last = f", its last save step {n.saved_step}" if n.saved_step is not None else ""
            said.append(f"{n.node_id} stopped, no save reported ({what}{last}{_rank_ends(n)})")
    heard = [n for n in a.nodes if n.exited and n.node_id not in unheard]
    if heard and savers == len(heard):
        at = f" at step {min(saved)}" if len(saved) == 1 else " (no node reported the step)"
        head = "every rank saved and stopped" + (at if len(saved) <= 1 else "")
    elif heard and savers == 0:
        head = "every rank stopped; no save reported (each node's exit report: saved_step none)"
    elif heard:
        head = "some ranks saved, some did not"
    else:
        head = "no node sent an exit report"
    return f"{head}: " + "; ".join(said) if said else head


def _rank_ends(n: NodeView) -> str:
    """The ranks' own ends, grouped: ``; ranks 2, 3: SIGTERM``."""
    groups: dict[str, list[int]] = {}
    for r in n.ranks:
        if r.signal:
            groups.setdefault(r.signal, []).append(r.rank)
        elif r.exit_code is not None:
            groups.setdefault(f"exit {r.exit_code}", []).append(r.rank)
    return "".join(f"; {_ranks(ids)}: {how}" for how, ids in groups.items())


#: Remedies that keep the hardware: nothing is wrong with the nodes themselves.
SAME_HARDWARE = frozenset({_A.RESTART_IN_PLACE, _A.REPLAN_MEMORY})


def _in_place(s: JobSnapshot, inc: IncidentView) -> bool:
    return rm.remedy_for(inc.failure_class) in SAME_HARDWARE and s.abilities.restarts_in_place


#: Remedies that replace one node: the others did nothing wrong.
REPLACES_A_NODE = frozenset({_A.REPLACE_NODE_BLOCK_REGION, _A.DRAIN_NODE})
#: Classes whose node is gone already (nothing of it to give back).
NODE_GONE = frozenset({_F.PREEMPTION_NOTICE, _F.NODE_LOST, _F.EXTERNAL_TERMINATION})


def survivors(s: JobSnapshot, a: AttemptView, inc: IncidentView) -> tuple[str, ...]:
    """The failed attempt's nodes that stay for the relaunch, in node-rank order: every
    node but the ones the incident's failures took out, when the remedy replaces one
    node and the launcher can put a replacement beside survivors. Empty: relaunch all.

    A node the launcher can not give back alone (SkyPilot) is kept only when it is
    gone anyway (a preemption), never when it still runs and bills (a slow node)."""
    if (
        rm.remedy_for(inc.failure_class) not in REPLACES_A_NODE
        or inc.node_id is None
        or not s.abilities.keeps_survivors
        or (inc.failure_class not in NODE_GONE and not s.abilities.releases_single_nodes)
    ):
        return ()
    lost = {inc.node_id, *a.vanished}
    # What happened *to* a node, not what its peers' ranks died of: a survivor's rank
    # exits are classed after the cause (node_lost) and must not take it out too.
    lost.update(
        f.node_id
        for f in s.failures
        if f.node_id
        and (
            f.kind in (EventKind.NODE_LOST, EventKind.PREEMPTION_NOTICE)
            # A straggler report counts only as the cause (three of them open the
            # incident); one slow window is noise, and names the reporter's node.
            or (
                f.failure_class in rm.BLAMES_HOST - {_F.SLOW_PEER} and f.kind != EventKind.RANK_EXIT
            )
        )
    )
    lost.update(n.node_id for n in a.nodes if n.alive is False and not n.exited)
    nodes = [n for n in sorted(a.nodes, key=lambda n: n.node_rank) if n.node_id not in lost]
    if nodes and not nodes[0].address and not s.abilities.refills_clusters:
        return ()  # the group's rendezvous would be a kept node nobody can be told of
    kept = tuple(n.node_id for n in nodes)
    return kept if 0 < len(kept) < a.num_nodes else ()


def _warm_candidates(s: JobSnapshot, a: AttemptView, inc: IncidentView) -> list[NodeView]:
    """The survivors of a loss an elastic job may shrink on (``elastic.shrink`` not
    ``never``), each with all its ranks known; empty when there is no such loss."""
    spec = s.spec
    if not spec.elastic_nodes or spec.elastic.shrink == "never":
        return []
    kept = survivors(s, a, inc)
    by_id = {n.node_id: n for n in a.nodes}
    nodes = [by_id[x] for x in kept]
    if not nodes or any(len(n.ranks) != a.ranks_per_node for n in nodes):
        return []
    return nodes


def _awaiting_warm(s: JobSnapshot, a: AttemptView, inc: IncidentView, cfg: ReconcileConfig) -> bool:
    """SIGNAL holds off (``warm_wait_s`` from the detection) while an elastic job's
    survivors may still report waiting warm: none of their ranks exited, and not all
    of them said so yet."""
    nodes = _warm_candidates(s, a, inc)
    if not nodes or all(n.waiting_warm for n in nodes):
        return False
    if any(r.exit_code is not None or r.signal is not None for n in nodes for r in n.ranks):
        return False
    detected = inc.steps.get(_P.DETECT)
    since = detected.finished_at or detected.started_at if detected is not None else None
    return _age(s.now, since) < cfg.warm_wait_s


def warm_survivors(s: JobSnapshot, a: AttemptView, inc: IncidentView) -> tuple[str, ...]:
    """The survivors SIGNAL holds warm instead of stopping: an elastic job that may
    shrink (``elastic.shrink`` not ``never``) lost a node, and every rank of every
    survivor is alive and waiting for a membership (``NodeView.waiting_warm``: they
    left the group when its collectives failed). Empty: signal as for any job.

    Stopping them would only end processes that hold torch, the model and the
    optimizer and can save nothing (a save needs the lost ranks too); held, a warm
    shrink re-forms them in place, and any other remedy restarts them cold as before
    (their ranks also give up on their own after ``REGROUP_TIMEOUT_S``)."""
    nodes = _warm_candidates(s, a, inc)
    if not nodes or not all(n.waiting_warm for n in nodes):
        return ()
    return tuple(n.node_id for n in nodes)


def _kept(s: JobSnapshot, a: AttemptView, inc: IncidentView) -> tuple[str, ...]:
    """The nodes the relaunch keeps: for a grow, every node of the shrunk group and
    its replacements (each restarts in place, in node-rank order); else the survivors."""
    if inc.failure_class is _F.ELASTIC_GROW:
        spare = a.spare.nodes if a.spare is not None else ()
        return tuple(n.node_id for n in sorted((*a.nodes, *spare), key=lambda n: n.node_rank))
    return survivors(s, a, inc)


def _confirm(s: JobSnapshot, a: AttemptView, inc: IncidentView) -> list[Action]:
    i, step = inc.event_id, _P.CONFIRM_CHECKPOINT
    listing = s.listing
    if listing is None:
        return []  # gathered on the next tick
    if listing.error is not None:
        reason = f"checkpoint storage unreadable: {listing.error}"
        return [FinishStep(i, step, StepOutcome.FAILED, reason), *_fail(a, reason)]
    usable = [c for c in listing.complete if (c, listing.digests.get(c, "")) not in s.poisoned]
    choice = rm.choose_checkpoint(usable, inc.failure_class, inc.onset_step)
    # A rollback past an anomaly: what it skipped was saved from the diverged state,
    # and no later incident may resume from it.
    poisoned = (
        {c: listing.digests.get(c, "") for c in usable if c >= inc.onset_step}
        if inc.failure_class in rm.ANOMALIES and inc.onset_step is not None
        else {}
    )
    last = a.last_step()
    if choice.step is None:
        uri = None
        own = s.spec.checkpoint.own
        plain = s.plain or s.spec.task.framework == "plain"
        if plain and own is not None:
            text = (
                f"{choice.reason} under {listing.uri} (a plain script saves its own): the "
                f"relaunch passes {own.resume_arg} {own.path} on each node that has it, and "
                "where none has it the ranks start from scratch"
            )
        else:
            thrown = (
                f"; the {last} steps reported are lost" if isinstance(last, int) and last else ""
            )
            text = (
                f"{choice.reason} under {listing.uri}: restarting from scratch (step 0)"
                + (" (a plain script without checkpoint.own)" if plain else "")
                + thrown
            )
    else:
        uri = f"{listing.uri.rstrip('/')}/step_{choice.step}"
        lost = f"{last - choice.step} steps lost" if isinstance(last, int) else "steps lost: ?"
        text = (
            f"step_{choice.step} complete on all ranks (manifest + COMMIT): {choice.reason}; "
            f"last step seen {last}; {lost}"
        )
    kept = _kept(s, a, inc)
    gone = tuple(n.node_id for n in a.nodes if n.node_id not in kept) if kept else ()
    if kept and a.spare is not None and not a.spare.released:
        # An incident of a shrunk group other than its grow gives the spare back: the
        # relaunch is planned from the survivors as for any job.
        gone += tuple(n.node_id for n in a.spare.nodes if n.node_id not in kept)
    return [
        FinishStep(
            i,
            step,
            StepOutcome.OK,
            text,
            ConfirmedCheckpoint(choice.step, uri, poisoned),
        ),
        # Only now, with the checkpoint confirmed, are the old nodes released (all of
        # them, or the lost ones when the healthy ones stay for the relaunch).
        Release(
            a.number,
            f"incident {i}",
            keep_nodes=_in_place(s, inc) or bool(kept),
            release_nodes=gone,
        ),
    ]


def _select(
    s: JobSnapshot, a: AttemptView, inc: IncidentView, cfg: ReconcileConfig
) -> list[Action]:
    i, step = inc.event_id, _P.SELECT_REPLACEMENT
    spec = s.spec
    r = spec.restarts

    def fail(reason: str) -> list[Action]:
        return [FinishStep(i, step, StepOutcome.FAILED, reason), *_fail(a, reason)]

    refused = rm.refuse_to_continue(
        inc.failure_class,
        inc.signature,
        inc.onset_step,
        s.past_incidents,
        restarts_done=s.restarts_done,
        max_restarts=r.max_restarts,
        max_same_user_error=r.max_same_user_error,
        max_same_anomaly=r.max_same_anomaly,
        on_anomaly=r.on_anomaly,
    )
    if refused is not None:
        return fail(refused)
    action = rm.remedy_for(inc.failure_class)
    failed = a.placement
    if action is _A.GROW_BACK:
        return _select_grow(s, a, inc)
    notes: list[str] = []
    knobs = failed.knobs if failed is not None else None
    if action is _A.REPLAN_MEMORY:
        dp = spec.num_nodes * spec.ranks_per_node
        k = rm.knobs_after_oom(spec, knobs, dp)
        if k.refused:
            return fail(k.reason)
        knobs = k.knobs
        notes.append(k.reason)
    in_place = _in_place(s, inc) and failed is not None
    exclude_hosts = set(s.excluded_hosts)
    if inc.failure_class in rm.BLAMES_HOST and inc.host:
        exclude_hosts.add(inc.host)
        notes.append(f"host {inc.host} excluded for good ({inc.failure_class})")
    kept = survivors(s, a, inc) if not in_place and failed is not None else ()
    verb = LaunchVerb.LAUNCH
    if in_place:
        assert failed is not None
        placement = rm.same_placement(failed, knobs)
        where = f"restart in place on the same {failed.num_nodes} nodes"
        verb = LaunchVerb.RESTART_IN_PLACE
        if a.launches > 1:
            # A group across launches restarts as one: every node kept, in rank order,
            # each launch restarted where it is (nothing new is provisioned).
            kept = tuple(n.node_id for n in sorted(a.nodes, key=lambda n: n.node_rank))
            verb = LaunchVerb.JOIN_SURVIVORS
    elif kept:
        assert failed is not None
        # The replacement joins the survivors: one group, so the same network (cloud,
        # region, instance type); a host blamed for the fault is excluded above.
        placement = rm.same_placement(failed, knobs)
        # One cluster the cloud refills keeps its running nodes itself; otherwise the
        # kept ones restart and the replacements are a launch of their own.
        verb = (
            LaunchVerb.REFILL
            if s.abilities.refills_clusters and a.launches == 1
            else LaunchVerb.JOIN_SURVIVORS
        )
        where = (
            f"keep the {len(kept)} healthy node{'s' if len(kept) > 1 else ''} "
            f"({', '.join(kept)}); replace {failed.num_nodes - len(kept)} beside them in "
            f"{failed.cloud}/{failed.region}"
            + (" (a refill of its cluster)" if verb is LaunchVerb.REFILL else "")
        )
        if spec.elastic_nodes:
            steps_left, step_time = _work_left(a)
            shrink = el.choose_shrink(
                spec,
                len(kept),
                provision_s=s.provision_s,
                startup_s=s.startup_s,
                steps_left=steps_left,
                step_time_s=step_time,
                cfg=cfg.elastic,
            )
            if shrink.shrink and verb is LaunchVerb.JOIN_SURVIVORS:
                said = [shrink.reason, *notes]
                return _select_shrink(s, a, inc, kept, placement, exclude_hosts, said)
            notes.append(
                shrink.reason
                if not shrink.shrink
                else f"not shrinking: a {verb} keeps the group whole ({shrink.reason})"
            )
    elif action in SAME_HARDWARE and failed is not None:
        placement = rm.same_placement(failed, knobs)
        where = f"same placement ({failed.cloud}/{failed.region}), new nodes"
    else:
        if s.candidates is None:
            return fail(f"no replacement: {s.candidates_error or 'the launcher offered none'}")
        avoid = rm.regions_to_avoid(inc.failure_class, failed)
        choice = rm.select_placement(spec, s.candidates, s.history, s.now, exclude_regions=avoid)
        if choice.placement is None:
            return fail(f"no replacement: {choice.reason}")
        placement = choice.placement
        if action is _A.REPLAN_MEMORY:
            placement = replace(placement, knobs=knobs)
        else:
            placement, why = _knobs_for_memory(spec, placement)
            if why is not None:
                return fail(f"no replacement: {why}")
        where = choice.reason
    kn = placement.knobs
    if kn is not None and placement.gpu_memory_gib and action is not _A.REPLAN_MEMORY:
        notes.append(
            f"knobs: micro-batch {kn.micro_batch} x {kn.grad_accum} accumulation, activation "
            f"checkpointing every {kn.activation_checkpoint_every or '-'} for "
            f"{placement.gpu_memory_gib:g} GiB"
        )
    text = "; ".join([f"{action}: {where}", *notes])
    result = Selection(
        remedy=action,
        placement=placement,
        verb=verb,
        exclude_hosts=tuple(sorted(exclude_hosts)),
        keep=kept,
        keep_hosts=tuple(a.host_of(n) or "" for n in kept),
    )
    return [FinishStep(i, step, StepOutcome.OK, text, result)]


def knobs_for_world(spec: JobSpec, knobs: TrainingKnobs | None, nodes: int) -> TrainingKnobs | None:
    """The knobs of a placement recomputed for a group of ``nodes`` (an elastic run's
    shrunk or regrown world): the micro-batch stays, the accumulation makes up the
    per-rank batch (``elastic.batch: keep``: the global batch stays; ``scale``: it
    follows the world). None: no knobs, or a batch that does not split (the spec's
    validation refuses those)."""
    if knobs is None or spec.model is None:
        return knobs
    world = nodes * spec.ranks_per_node
    full = spec.num_nodes * spec.ranks_per_node
    g = spec.model.global_batch
    if spec.elastic.batch == "scale":
        g = g * world // full
    if g % world:
        return knobs
    per_rank = g // world
    micro = min(knobs.micro_batch, per_rank)
    while per_rank % micro:
        micro -= 1
    return replace(knobs, micro_batch=micro, grad_accum=per_rank // micro)


def _select_shrink(
    s: JobSnapshot, a: AttemptView, inc: IncidentView, kept: tuple[str, ...],
    placement: Placement, exclude_hosts: set[str], notes: list[str],
) -> list[Action]:  # fmt: skip
    """SELECT for an elastic shrink: the kept nodes train at once as a group of their
    own; the replacements are launched beside them as standby, for the grow."""
    n, k = s.spec.num_nodes, len(kept)
    placement = replace(placement, num_nodes=n, knobs=knobs_for_world(s.spec, placement.knobs, k))
    where = (
        f"shrink: the {k} healthy node{'s' if k > 1 else ''} ({', '.join(kept)}) train at once "
        f"as a group of {k}; {n - k} replacement{'s' if n - k > 1 else ''} launch beside "
        f"them in {placement.cloud}/{placement.region} as standby, and the group grows back "
        f"to {n} once they are up"
    )
    result = Selection(
        remedy=rm.remedy_for(inc.failure_class),
        placement=placement,
        verb=LaunchVerb.SHRINK,
        exclude_hosts=tuple(sorted(exclude_hosts)),
        keep=kept,
        keep_hosts=tuple(a.host_of(x) or "" for x in kept),
        train_nodes=k,
        warm=_carried_warm(a, inc, kept),
    )
    if result.warm:
        where += "; the kept nodes are carried warm (their ranks re-form the group in place)"
    text = "; ".join([where, *notes])
    return [FinishStep(inc.event_id, _P.SELECT_REPLACEMENT, StepOutcome.OK, text, result)]


def _carried_warm(a: AttemptView, inc: IncidentView, kept: tuple[str, ...]) -> bool:
    """A shrink carries its kept nodes warm when SIGNAL held every one of them and a
    complete checkpoint was confirmed (a re-formed group loads it; it never starts
    fresh)."""
    held = {n.node_id for n in a.nodes if n.held}
    confirmed = inc.confirmed
    return (
        bool(kept)
        and set(kept) <= held
        and confirmed is not None
        and confirmed.step is not None
        and confirmed.uri is not None
    )


def _select_grow(s: JobSnapshot, a: AttemptView, inc: IncidentView) -> list[Action]:
    """SELECT for a grow: every node of the shrunk group and its replacements restart
    in place as one group of the full size (nothing is provisioned)."""
    kept = _kept(s, a, inc)
    failed = a.placement
    if failed is None or len(kept) < (a.full_nodes or 0):
        reason = f"grow: {len(kept)} nodes known, {a.full_nodes} needed"
        return [FinishStep(inc.event_id, _P.SELECT_REPLACEMENT, StepOutcome.FAILED, reason),
                *_fail(a, reason)]  # fmt: skip
    placement = replace(
        failed, num_nodes=len(kept), knobs=knobs_for_world(s.spec, failed.knobs, len(kept))
    )
    result = Selection(
        remedy=_A.GROW_BACK,
        placement=placement,
        verb=LaunchVerb.JOIN_SURVIVORS,
        exclude_hosts=tuple(sorted(s.excluded_hosts)),
        keep=kept,
        keep_hosts=tuple(a.host_of(x) or "" for x in kept),
    )
    text = (
        f"grow_back: {a.num_nodes} training nodes and {len(kept) - a.num_nodes} replacement"
        f"{'s' if len(kept) - a.num_nodes > 1 else ''} restart in place as one group of "
        f"{len(kept)} ({', '.join(kept)})"
    )
    return [FinishStep(inc.event_id, _P.SELECT_REPLACEMENT, StepOutcome.OK, text, result)]


def _stage(s: JobSnapshot, a: AttemptView, inc: IncidentView, cfg: ReconcileConfig) -> list[Action]:
    """The new nodes stage the confirmed checkpoint themselves, before torchrun
    starts (the same code on every launcher): the step ends when every node said."""
    i, step = inc.event_id, _P.STAGE
    confirmed = inc.confirmed
    want = confirmed.step if confirmed is not None else None
    if confirmed is None or want is None:
        return [FinishStep(i, step, StepOutcome.SKIPPED, "fresh start: nothing to stage")]
    if a.number <= inc.attempt:
        return []  # the relaunch is not gathered yet
    reports = {r.node_id: r for r in a.staged}
    bad = next((r for r in reports.values() if not r.ok), None)
    if bad is not None:
        reason = (
            f"node {bad.node_id} could not stage step_{want}: {bad.detail or 'no reason given'}; "
            "refusing to train on it"
        )
        return [FinishStep(i, step, StepOutcome.FAILED, reason), *_fail(a, reason)]
    if len(reports) >= a.num_nodes:
        total = sum(r.bytes for r in reports.values())
        slowest = max(r.seconds for r in reports.values())
        return [
            FinishStep(
                i,
                step,
                StepOutcome.OK,
                f"step_{want} staged and verified (sha256) by each of {len(reports)} nodes "
                f"from {confirmed.uri}: {total} bytes copied, slowest node "
                f"{slowest:.2f} s",
            )
        ]
    # A node lost while staging ends this incident; its failure opens the next one.
    failures = _actionable(s, cfg)
    found = None if failures else detect(s, a, cfg)
    if failures or found is not None:
        cause = primary_cause(failures, _node_ids(a)) if failures else found
        what = cause.failure_class  # type: ignore[union-attr]
        detail = f"attempt {a.number} failed while its nodes staged: {what}"
        return [
            FinishStep(i, step, StepOutcome.SKIPPED, detail),
            FinishStep(i, _P.VALIDATE, StepOutcome.FAILED, detail),
            *([found] if found is not None else []),
        ]
    return []


def _record_relaunch(s: JobSnapshot, a: AttemptView, inc: IncidentView) -> list[Action]:
    confirmed, selected = inc.confirmed, inc.selection
    if selected is None:  # LAUNCH follows a SELECT that finished OK: its result is stored
        return [*_fail(a, f"incident {inc.event_id}: SELECT's result is missing")]
    placement = selected.placement
    want, uri = (confirmed.step, confirmed.uri) if confirmed is not None else (None, None)
    stage_from = None
    if want is None or uri is None:
        resume_step, resume_from = 0, "none"
    else:
        # Never a remote URI as a path: the node stages it, the ranks read the copy.
        resume_step, resume_from = int(want), f"{{node_disk}}/staged/step_{int(want)}"
        stage_from = str(uri)
    skip = None
    if (
        inc.failure_class in rm.ANOMALIES
        and s.spec.restarts.on_anomaly == "rollback_skip"
        and inc.onset_step is not None
    ):
        skip = (resume_step + 1, inc.onset_step + s.spec.restarts.skip_after_onset)
    times = [r.step_time for n in a.nodes for r in n.ranks if r.step_time is not None]
    own = s.spec.checkpoint.own
    plain = s.plain or s.spec.task.framework == "plain"
    start = (
        f"resuming at step_{want}"
        if stage_from is not None
        else f"passing {own.resume_arg} {own.path} where a node has it"
        if plain and own is not None
        else "from scratch"
    )  # the status says where the relaunch starts (CONFIRM's finding)
    return [
        SetStatus(JobStatus.PROVISIONING, f"launching attempt {inc.attempt + 1}, {start}"),
        RecordAttempt(
            inc.attempt + 1,
            inc.event_id,
            placement,
            resume_step,
            resume_from,
            verb=selected.verb,
            exclude_hosts=selected.exclude_hosts,
            skip_steps=skip,
            collective_timeout_s=collective_timeout_s(
                max(times) if times else None, s.blocking_save_s
            ),
            stage_from=stage_from,
            keep=selected.keep,
            keep_hosts=selected.keep_hosts,
            train_nodes=selected.train_nodes,
            warm=selected.warm,
        ),
    ]


def _launch(
    s: JobSnapshot, a: AttemptView, inc: IncidentView | None, cfg: ReconcileConfig
) -> list[Action]:
    """Start the recorded attempt; after a refusal, re-plan (capacity) or stop."""
    i = inc.event_id if inc is not None else None

    def fail(reason: str) -> list[Action]:
        done: list[Action] = []
        if i is not None:
            done.append(FinishStep(i, _P.LAUNCH, StepOutcome.FAILED, reason))
        return done + _fail(a, reason)

    if a.launched:
        return _provisioning(s, a, inc)
    p = a.placement
    last = a.launch_failures[-1] if a.launch_failures else None
    verb = launch_verb(a)
    start = StartNodes(a.number, i, verb, len(a.launch_failures))
    # A refill, restart or join that failed falls back to a fresh launch of the whole
    # group: the nodes the failed attempt kept for it are given back first.
    fallback = last is not None and last.verb is not LaunchVerb.LAUNCH
    give_back: list[Action] = (
        [Release(inc.attempt, f"the {last.verb} failed: a fresh launch replaces it")]
        if fallback and inc is not None and last is not None
        else []
    )
    if (
        p is None
        or last is None
        or (last.cloud, last.region, last.instance_type)
        != (
            p.cloud,
            p.region,
            p.instance_type,
        )
    ):
        # In place after a transport error: wait the backoff before starting again.
        if inc is not None and verb is not LaunchVerb.LAUNCH and _in_place(s, inc):
            tries = 1
            for past in reversed(s.past_incidents):  # consecutive restarts in place
                if rm.remedy_for(past.failure_class) is not _A.RESTART_IN_PLACE:
                    break
                tries += 1
            wait = rm.backoff_s(s.job_id, tries, base_s=cfg.backoff_base_s, cap_s=cfg.backoff_cap_s)
            if _age(s.now, a.started_at) < wait:
                return []
        return [start]
    if not last.capacity:
        if not last.retryable:
            return fail(f"launch failed: {last.message}")
        if fallback:
            # Never the same refill or restart again (its request is failed, and the
            # cluster it needed is not as it must be): a new cluster, at once.
            return [*give_back, start]
        same = [f for f in a.launch_failures if not f.capacity and f.verb is LaunchVerb.LAUNCH]
        if len(same) > cfg.launch_retries:
            return fail(f"launch failed {len(same)} times: {last.message}")
        wait = rm.backoff_s(s.job_id, len(same), base_s=cfg.backoff_base_s, cap_s=cfg.backoff_cap_s)
        if _age(s.now, last.at) < wait:
            return []
        return [start]
    tried = ", ".join(f"{f.cloud}/{f.region}/{f.instance_type}" for f in a.launch_failures)
    if s.candidates is None:
        return fail(f"launch failed: {last.message}; no other placement: {s.candidates_error}")
    choice = rm.select_placement(s.spec, s.candidates, s.history, s.now)
    if choice.placement is None:
        return fail(
            f"no capacity anywhere: tried {tried}; {choice.reason}"
            + (f" ({'; '.join(choice.tried)})" if choice.tried else "")
        )
    wait = rm.backoff_s(
        s.job_id, len(a.launch_failures), base_s=cfg.backoff_base_s, cap_s=cfg.backoff_cap_s
    )
    if _age(s.now, last.at) < wait:
        return []
    placement = replace(choice.placement, knobs=p.knobs)
    return [
        *give_back,
        Replan(
            a.number,
            placement,
            f"{last.region} had no capacity for {last.instance_type} (cooling down); "
            f"waited {wait:.1f} s; now {choice.reason}",
        ),
    ]


def _provisioning(s: JobSnapshot, a: AttemptView, inc: IncidentView | None) -> list[Action]:
    """A launch request is polled, never waited on: up, failed, or still provisioning
    within the spec's timeout (past it, the placement is given up like a stockout)."""
    if a.up_at is not None:
        return []
    p = a.provision
    registered = {n.node_rank for n in a.nodes}
    if (p is not None and p.phase is LaunchPhase.UP) or len(registered) >= a.num_nodes:
        done: list[Action] = [MarkProvisioned(a.number, p.hosts if p is not None else ())]
        if inc is not None:
            waited = _age(s.now, a.requested_at)
            done.append(
                FinishStep(
                    inc.event_id,
                    _P.LAUNCH,
                    StepOutcome.OK,
                    f"attempt {a.number}: {a.num_nodes} nodes x {a.ranks_per_node} ranks up "
                    f"in {waited:.1f} s ({_how_launched(a)})",
                )
            )
        return done
    if p is not None and p.phase is LaunchPhase.FAILED:
        return [
            LaunchRequestFailed(
                a.number, p.detail or "the provider failed it", p.capacity, launch_verb(a)
            )
        ]
    limit = s.spec.restarts.provision_timeout_s
    waited = _age(s.now, a.requested_at)
    if waited > limit:
        return [
            LaunchRequestFailed(
                a.number,
                f"not provisioned after {waited:.0f} s (provision_timeout_s {limit:.0f})"
                + (f"; last seen: {p.phase} {p.detail}".rstrip() if p is not None else ""),
                capacity=True,
                verb=launch_verb(a),
            )
        ]
    return []


def launch_verb(a: AttemptView) -> LaunchVerb:
    """How the attempt's next (or current) request gets its nodes: as SELECT decided,
    until one request of that verb failed; from then on a fresh launch on a new
    cluster. A refill or a restart is never tried twice: the cluster it needs was not
    as it must be (a refill onto a cluster that is not INIT with fewer nodes would
    rerun the doomed node; an exec onto an INIT cluster or with a changed agent wheel
    fails again), and its failed request must never be adopted as the next one."""
    if a.verb is not LaunchVerb.LAUNCH and any(f.verb is a.verb for f in a.launch_failures):
        return LaunchVerb.LAUNCH
    return a.verb


def _how_launched(a: AttemptView) -> str:
    verb, kept, n = launch_verb(a), len(a.keep), a.num_nodes
    if verb is LaunchVerb.SHRINK:
        spare = a.spare.count if a.spare is not None else 0
        return f"{kept} kept, training as a group of {n}; {spare} launching beside as standby"
    if verb is LaunchVerb.RESTART_IN_PLACE or (verb is LaunchVerb.JOIN_SURVIVORS and kept >= n):
        return "restarted in place"
    if verb is LaunchVerb.REFILL:
        return f"its cluster refilled: {kept} kept, {n - kept} provisioned"
    if verb is LaunchVerb.JOIN_SURVIVORS:
        return f"{kept} kept, {n - kept} launched beside them"
    where = a.placement.region if a.placement is not None else "launched"
    if a.verb is not LaunchVerb.LAUNCH:
        return f"{where}: a fresh launch, after the {a.verb} failed"
    return where


def _validate(
    s: JobSnapshot, a: AttemptView, inc: IncidentView, cfg: ReconcileConfig, *, started: bool
) -> list[Action]:
    i, step = inc.event_id, _P.VALIDATE
    out: list[Action] = []
    if not started:
        out.append(SetStatus(JobStatus.PROVISIONING, f"attempt {a.number} launched"))
    if a.number <= inc.attempt:  # launch recorded but attempt not gathered yet
        return out
    failures = _actionable(s, cfg)
    refusal = _refusal(failures)
    if refusal is not None:
        reason = f"ranks refused to resume: {refusal.message or refusal.kind}"
        return [*out, FinishStep(i, step, StepOutcome.FAILED, reason), *_fail(a, reason)]
    resumed = resumed_everywhere(a)
    if resumed is not None:
        return [
            *out,
            FinishStep(
                i,
                step,
                StepOutcome.OK,
                f"all {a.world_size} ranks resumed at step {resumed} (each rank's resume report)",
                ResumeValidated(resumed),  # a measured start-up (validate_timeout_s)
            ),
            MarkValidated(a.number, resumed),
            SetStatus(JobStatus.RUNNING, f"recovered: all ranks at step {resumed}"),
        ]
    if failures:
        f = primary_cause(failures, _node_ids(a))
        detail = f"attempt {a.number} failed before validating: {f.failure_class}"
        return [*out, FinishStep(i, step, StepOutcome.FAILED, detail)]
    found = detect(s, a, cfg)
    if found is not None:
        return [*out, found]
    start = startup(s, a, cfg)
    if isinstance(start, RecordFailure):
        return [*out, FinishStep(i, step, StepOutcome.FAILED, start.message), start]
    if isinstance(start, PlainRun):
        return [
            *out,
            *([] if s.plain else [RecordNote(_PLAIN, a.number, start.notice)]),
            FinishStep(i, step, StepOutcome.OK, start.detail),
            SetStatus(JobStatus.RUNNING, start.status),
        ]
    return out


# --- the truthful loop: a finished run ends, start-up has no fixed timer, claims name
# their evidence ----------------------------------------------------------------------------

_PLAIN = EventKind.PLAIN_SCRIPT


def finished(a: AttemptView) -> bool:
    """Every node of the attempt sent its exit report, each with exit code 0 (the
    agent's word that every one of its ranks exited 0)."""
    return (
        len(a.nodes) == a.num_nodes
        and all(n.exited for n in a.nodes)
        and all(n.exit_code == 0 for n in a.nodes)
    )


def _stopped_by_us(s: JobSnapshot, a: AttemptView) -> bool:
    """The spec reads an all-zero exit after our stop as stopped (a script that exits 0
    on SIGTERM), and the open incident asked this attempt's ranks to stop."""
    inc = s.incident
    return (
        not s.spec.restarts.exit_zero_is_success
        and inc is not None
        and inc.attempt == a.number
        and _P.SIGNAL in inc.steps
    )


def _succeed(s: JobSnapshot, a: AttemptView) -> list[Action]:
    steps = [r.step for n in a.nodes for r in n.ranks if r.step is not None]
    at = f"; last step reported {max(steps)}" if steps else "; no step was reported"
    why = (
        f"training finished: every rank of attempt {a.number} exited 0 (the exit reports "
        f"of its {a.num_nodes} node{'s' if a.num_nodes > 1 else ''}){at}"
    )
    out: list[Action] = []
    inc = s.incident
    if inc is not None:
        # The incident ends with the run: its open step and VALIDATE are closed, so no
        # later tick reads it as a recovery still to finish.
        current = next((p for p in ORDER if p in inc.steps and inc.steps[p].outcome is None), None)
        if current is not None and current is not _P.VALIDATE:
            out.append(FinishStep(inc.event_id, current, StepOutcome.SKIPPED, why))
        if a.number > inc.attempt:
            detail = (
                f"attempt {a.number} ran to completion: every rank exited 0 (each node's exit "
                "report)"
                + (
                    ""
                    if a.validated_step is not None
                    else "; what it resumed from was never reported"
                )
            )
            out.append(FinishStep(inc.event_id, _P.VALIDATE, StepOutcome.OK, detail))
        else:
            out.append(FinishStep(inc.event_id, _P.VALIDATE, StepOutcome.SKIPPED, why))
    if s.status is not JobStatus.RUNNING:  # only RUNNING -> SUCCEEDED is a legal move
        out.append(
            SetStatus(JobStatus.RUNNING, f"every node of attempt {a.number} ran to completion")
        )
    out += [SetStatus(JobStatus.SUCCEEDED, why), Release(a.number, "finished")]
    return out


def validate_timeout_s(s: JobSnapshot, cfg: ReconcileConfig) -> tuple[float, str]:
    """How long the ranks get to report what they resumed from, and whence the figure:
    the spec; else the job's measured start-ups, scaled, with a floor; else a default."""
    given = s.spec.restarts.validate_timeout_s
    if given is not None:
        return given, "restarts.validate_timeout_s"
    if s.startup_s:
        longest = max(s.startup_s)
        limit = max(cfg.validate_floor_s, cfg.validate_factor * longest)
        return limit, (
            f"{cfg.validate_factor:g} x the longest start-up measured ({longest:.0f} s), "
            f"at least {cfg.validate_floor_s:.0f} s"
        )
    return cfg.validate_timeout_s, "the default: no start-up of this job measured yet"


@dataclass(frozen=True)
class PlainRun:
    """The attempt runs under the plain-script contract (README): its ranks send no
    progress reports, so nothing they loaded can be validated, and they are not
    stopped for it."""

    notice: str
    """The one line the ``plain_script`` event says."""
    detail: str
    """VALIDATE's detail: what is known of the start, and from which report."""
    status: str


def _is_working(r: RankView, timeout_s: float) -> bool:
    """The rank shows work: a step report lately, or CPU used lately."""
    reported = r.step is not None and r.report_age_s is not None and r.report_age_s < timeout_s
    busy = r.cpu_idle_s is not None and r.cpu_idle_s < timeout_s
    return reported or busy


def _ranks(ids: list[int]) -> str:
    return ("rank " if len(ids) == 1 else "ranks ") + ", ".join(str(k) for k in sorted(ids))


def _own_start(s: JobSnapshot, a: AttemptView) -> str:
    """What a plain script started from, from its agents' word on ``checkpoint.own``."""
    own = s.spec.checkpoint.own
    if own is None:
        return "from scratch (no checkpoint.own in the spec: the script's own saves are not passed)"
    found = [n.node_id for n in a.nodes if n.own_found]
    looked = [n.node_id for n in a.nodes if n.own_found is not None]
    if found:
        return (
            f"with {own.resume_arg} {own.path} on {', '.join(found)} (its agent found the path"
            f"{'' if len(found) == len(a.nodes) else '; not on the others'}); the step it "
            "resumed at is not reported"
        )
    if looked:
        return f"from scratch: no node had {own.path} (each agent looked before the ranks started)"
    return f"{own.resume_arg} {own.path} where a node had it (no agent said whether one did)"


def startup(
    s: JobSnapshot, a: AttemptView, cfg: ReconcileConfig
) -> RecordFailure | PlainRun | None:
    """An attempt not yet validated: a plain run, a start-up stuck past the timeout, or
    None (wait). Training that shows work is never stopped for a missing report."""
    if a.up_at is None or len(a.nodes) < a.num_nodes:
        return None  # nodes still registering: the register timeout is detect's
    ranks = [(n, r) for n in a.nodes for r in n.ranks]
    heard = any(r.report_age_s is not None for _, r in ranks)
    declared = s.spec.task.framework == "plain" or s.plain
    everyone = len(ranks) >= a.world_size
    if declared and everyone and not heard:
        return _plain(
            s,
            a,
            "the spec says task.framework: plain" if not s.plain else "noticed earlier in this job",
        )
    limit, source = validate_timeout_s(s, cfg)
    waited = _age(s.now, a.up_at)
    if waited <= limit:
        return None
    hb = s.heartbeat_timeout_s
    missing = [(n, r) for n, r in ranks if r.resumed_step is None]
    if any(_is_working(r, hb) for _, r in ranks):
        if not heard and everyone and all(_is_working(r, hb) for _, r in ranks):
            return _plain(s, a, f"no rank sent a report in {waited:.0f} s while all used CPU")
        return None  # some rank works: a slow load, never a reason to stop training
    unknown = [r for _, r in ranks if r.cpu_idle_s is None and r.report_age_s is None]
    if unknown and waited <= limit + hb:
        # Nothing says whether these ranks work: their agent has not measured their CPU
        # yet (ranks found late on a loaded host). Not measured is not idle: wait one
        # heartbeat timeout more for the measure before calling the start stuck.
        return None
    absent: list[str] = []
    for n in a.nodes:
        if len(n.ranks) < a.ranks_per_node:
            absent.append(
                f"{n.node_id}: {a.ranks_per_node - len(n.ranks)} of its {a.ranks_per_node} "
                "ranks have no process its agent found"
            )
    idle = [
        f"{_ranks([r.rank for r in n.ranks])} on {n.node_id}: "
        + (
            "no CPU measured"
            if any(r.cpu_idle_s is None for r in n.ranks)
            else f"no CPU used for {min(r.cpu_idle_s or 0.0 for r in n.ranks):.0f} s"
        )
        for n in a.nodes
        if n.ranks
    ]
    who = _ranks([r.rank for _, r in missing]) or "no rank"
    reason = (
        f"attempt {a.number}: no resume report from {who} in {waited:.0f} s (limit {limit:.0f} s, "
        f"{source}), and none shows work ({'; '.join(absent + idle)}). Each rank's resume "
        "report says which checkpoint and step it loaded: without every rank's, nothing "
        "shows they train from the same state"
    )
    cls = _F.RENDEZVOUS_FAILURE if absent else _F.NCCL_TIMEOUT
    return RecordFailure(EventKind.STUCK, cls, None, reason)


def _plain(s: JobSnapshot, a: AttemptView, why: str) -> PlainRun:
    start = _own_start(s, a)
    return PlainRun(
        notice=(
            f"attempt {a.number}: the ranks send no progress reports ({why}); the job runs "
            "under the plain-script contract: SIGTERM on notices, exit 0 is success, a restart "
            + ("passes checkpoint.own" if s.spec.checkpoint.own else "starts from scratch")
        ),
        detail=f"not validated (plain script: no resume reports); all {a.world_size} ranks "
        f"started {start}",
        status=f"running under the plain-script contract; started {start}"[:500],
    )


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
