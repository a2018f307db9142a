"""The Launcher protocol: how the reconciler asks for nodes, whatever provides them.

Implementations: ``skypilot.SkyPilotLauncher`` (real clouds), ``local.LocalLauncher``
(nodes as process groups on this machine), and a fake for unit tests. A launcher
only launches, reports and tears down; it never decides (the reconciler does) and
never retries on its own (recovery is skyresume's, not the provider's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from orchestrator.domain.plan import Placement
from orchestrator.domain.spec import JobSpec, TaskSpec


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


@dataclass(frozen=True)
class LaunchHandle:
    cluster_name: str
    launcher: str
    node_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterStatus:
    state: ClusterState
    nodes_up: tuple[str, ...] = ()
    detail: str = ""


class LaunchError(RuntimeError):
    """The provider refused or failed the launch; the message says which constraint."""


class Launcher(Protocol):
    name: str

    def placement_for(
        self, spec: JobSpec, *, exclude_regions: Sequence[str] = (), replacement: bool = False
    ) -> Placement:
        """Where the job's next attempt runs. ``exclude_regions`` (``cloud/region`` or
        a region name) are those that just preempted or lost a node; ``replacement``
        is true for every relaunch after an incident."""
        ...

    def launch(self, request: LaunchRequest) -> LaunchHandle: ...
    def status(self, handle: LaunchHandle) -> ClusterStatus: ...
    def down(self, handle: LaunchHandle) -> None: ...
