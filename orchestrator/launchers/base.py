"""The Launcher protocol: how the reconciler asks for nodes, whatever provides them.

Implementations: ``skypilot.SkyPilotLauncher`` (real clouds), ``local.LocalLauncher``
(nodes as process groups on this machine), and a fake for unit tests. A launcher
only launches, reports and tears down; it never decides (the reconciler does) and
never retries on its own (recovery is skyresume's, not the provider's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from orchestrator.domain.plan import Placement
from orchestrator.domain.planner import Candidate
from orchestrator.domain.reconcile import LauncherAbilities, LaunchPhase, LaunchProgress
from orchestrator.domain.spec import JobSpec, TaskSpec

__all__ = ["Candidate", "LaunchPhase", "LaunchProgress", "LauncherAbilities"]


class ClusterState(StrEnum):
    LAUNCHING = "launching"  # asked for, not all nodes up yet
    UP = "up"  # every node is up and its agent started
    PARTIAL = "partial"  # some nodes are gone (preempted, killed)
    DOWN = "down"  # torn down or never came up
    UNKNOWN = "unknown"  # the provider could not be read: never treat as healthy or dead


@dataclass(frozen=True)
class LaunchRequest:
    job_id: str
    attempt: int
    placement: Placement
    command: str
    """The user's training command (run by the agent under torchrun)."""
    env: dict[str, str] = field(default_factory=dict)
    """The run's context (``orchestrator.contract.Env`` names) for every rank. A value
    may hold ``{node_disk}``, which the launcher replaces with each node's local disk
    path (where a checkpoint was staged for that node)."""
    ranks_per_node: int = 1
    grace_s: float = 90.0
    """How long ranks get to save after SIGTERM (the agent's grace, not torchrun's 30 s)."""
    task: TaskSpec | None = None
    """The job's task (template or the user's SkyPilot YAML), for launchers that build
    a provider task from it; the local launcher runs ``command`` directly."""
    node_rank_base: int = 0
    """The first node rank of this launch in the group (``Env.NODE_RANK_BASE``): a
    launch of replacements beside kept nodes starts after them. Node ids follow."""
    exclude_hosts: tuple[str, ...] = ()
    """Hosts never to place a node on (a hardware fault or a slow node was blamed on
    them). A cloud gives a fresh VM on every launch; a launcher that picks hosts
    itself must skip these."""
    launch_try: int = 0
    """How many launch requests of this attempt failed before this one. A launch is
    keyed by (job, attempt, try): asked again for a key it already holds, a launcher
    answers with that request and starts nothing (a leader that crashed or lost its
    lease after the request was accepted, before recording it, is adopted by the
    next); a failed request's successor has a key, and so a request, of its own."""

    @property
    def launch_key(self) -> str:
        """``<job>-a<attempt>`` on the first try, ``<job>-a<attempt>-t<try>`` after."""
        suffix = f"-t{self.launch_try}" if self.launch_try else ""
        return f"{self.job_id}-a{self.attempt}{suffix}"


@dataclass(frozen=True)
class LaunchHandle:
    cluster_name: str
    launcher: str
    node_ids: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    """The host of each node, in node order, where the launcher knows it."""
    request_id: str = ""
    """The provider's id for the launch request (SkyPilot's request id; the local
    provisioner's own), which :meth:`Launcher.progress` polls."""


@dataclass(frozen=True)
class ClusterStatus:
    state: ClusterState
    nodes_up: tuple[str, ...] = ()
    detail: str = ""


class LaunchError(RuntimeError):
    """The provider refused or failed the launch; the message says which constraint."""


class TaskRejected(LaunchError):
    """The task itself was refused (bad YAML, unknown field, invalid resources): the
    same task would be refused again, so it is never retried."""


class CapacityError(LaunchError):
    """The provider had no capacity or quota for this placement (a stockout): another
    region or instance type may well work, so the job re-plans instead of failing."""


class VerbRefused(LaunchError):
    """The launcher will not carry out this verb on that cluster now (refill, restart in
    place), and asking again will not change that: nothing was submitted, and nothing
    is wrong with the placement. The reconciler's next try is a fresh launch on a new
    cluster (``decide()`` chooses it; no region is cooled down)."""


class RefillRefused(VerbRefused):
    """A refill was refused before it was submitted: the cluster is not one that has
    lost nodes (SkyPilot would rerun everything on the same, possibly doomed, VMs), or
    its old jobs could not be cancelled first."""


class RestartRefused(VerbRefused):
    """A restart in place (``sky.exec``: no setup) was refused: the cluster is not UP,
    or its nodes hold another agent package than the one this service serves."""


class SubmitUncertain(LaunchError):
    """A submission did not answer within its bound: the provider may have accepted
    it. The same key must be asked again (it adopts what was accepted) until the
    provider proves nothing was: never a new key, never counted as a failed launch."""


@dataclass(frozen=True)
class DownResult:
    """What :meth:`Launcher.confirm_down` found: ``gone`` only when the provider lists
    nothing of the cluster any more (the attempt may be recorded ``downed``)."""

    gone: bool
    detail: str = ""


@runtime_checkable
class Launcher(Protocol):
    """What the reconciler asks of whatever provides nodes."""

    name: str
    abilities: LauncherAbilities

    def candidates(self, spec: JobSpec, *, replacement: bool = False) -> list[Candidate]:
        """Everything the job could run on (the planner in ``domain`` ranks them).
        ``replacement`` is true for every relaunch after an incident. LaunchError
        when the offerings cannot be read."""
        ...

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        """Ask for the nodes and return at once with the request's handle (idempotent
        per :attr:`LaunchRequest.launch_key`): provisioning is polled with :meth:`progress`, never
        waited on. CapacityError or LaunchError only when the request itself is
        refused before it is accepted (a bad task, a stocked-out region known now)."""
        ...

    def progress(self, handle: LaunchHandle) -> LaunchProgress:
        """Where the launch (or restart) request of ``handle`` is. Never raises: a
        provider that cannot be read now is UNKNOWN."""
        ...

    def restart(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """Start ``request`` on the nodes of ``previous`` (``abilities.restarts_in_place``);
        like :meth:`launch`, a request that is polled."""
        ...

    def status(self, handle: LaunchHandle) -> ClusterStatus: ...
    def down(self, handle: LaunchHandle) -> None:
        """Ask for the teardown (idempotent) and return. A launcher whose teardown
        finishes later also implements :class:`ConfirmsDown`. LaunchError when it could
        not be asked."""
        ...


@runtime_checkable
class ConfirmsDown(Protocol):
    """A launcher whose :meth:`Launcher.down` only asks (SkyPilot's teardown takes
    minutes): an attempt is ``downed`` once :meth:`confirm_down` says so, and until
    then its down is asked again on later ticks. (Kept out of :class:`Launcher` until
    every launcher has it: the local one's down is finished when it returns.)"""

    def confirm_down(self, handle: LaunchHandle) -> DownResult:
        """Whether the cluster is gone (never raises: a provider that cannot be read
        is ``gone=False``)."""
        ...


@runtime_checkable
class RefillingLauncher(Launcher, Protocol):
    """A launcher whose clusters can be refilled (``abilities.refills_clusters``)."""

    def refill(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """Launch ``request`` onto the cluster of ``previous``: the nodes still running
        stay (the healthy ones), only the missing ones are provisioned; a request,
        polled like a launch."""
        ...


@runtime_checkable
class ChaosLauncher(Launcher, Protocol):
    """A launcher that can break its own nodes on request (``abilities.chaos``)."""

    def preempt(
        self, node_id: str, *, provider: str | None = None, in_seconds: float = 30
    ) -> None: ...
    def kill_node(self, job_id: str, node_id: str) -> int: ...
    def kill_agent(self, job_id: str, node_id: str) -> None: ...
    def signal_pid(self, job_id: str, node_id: str, pid: int, sig: int) -> None: ...
    def slow_pid(
        self, job_id: str, node_id: str, pid: int, *, duty: float, seconds: float
    ) -> None: ...
    def stockout(self, region: str, *, seconds: float) -> None: ...
    def link_chaos_refusal(self) -> str | None:
        """None when :meth:`partition_node` and :meth:`slow_link` act on a real link of
        each node's own; else why not (nodes that share one network stack)."""
        ...

    def partition_node(
        self, job_id: str, node_id: str, *, seconds: float | None = None
    ) -> dict[str, Any]:
        """Take the node's link down (its processes live on); heal after ``seconds``
        when given. What was done: node_id, host, link, partitioned, rate, heals_in_s."""
        ...

    def slow_link(
        self, job_id: str, node_id: str, rate: str, *, seconds: float | None = None
    ) -> dict[str, Any]:
        """Limit the node's link to ``rate`` (tc syntax; ``"0"`` lifts it), for
        ``seconds`` when given. ValueError for a rate that is not one."""
        ...

    def heal_node(self, job_id: str, node_id: str) -> dict[str, Any]:
        """Undo :meth:`partition_node` and :meth:`slow_link` on the node's link."""
        ...
