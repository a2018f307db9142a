"""The contract between the orchestrator (service, agent) and the in-job ``training`` library.

This module is the only part of ``orchestrator`` that ``training`` imports (besides the
torch-free object stores in ``orchestrator.cloud.storage``), so it must stay stdlib-only
and cheap to import: a rank imports it on every start. It runs on the node's own
Python, 3.9 and up (SkyPilot's default images have 3.10): nothing newer than 3.9 at
run time (``scripts/test`` checks it with vermin, tests/agent/test_node_python.py with
``ast``), and :class:`StrEnum` comes from here on every side.

Three things live here:

* **Environment variables** the node agent sets for every rank (the run's context).
* **Exit codes** a rank uses to tell the agent and the service *why* it stopped.
  The agent reads them; the classifier maps them to failure classes. Codes are in
  the 64-113 range that shells and torchrun leave alone (sysexits.h territory),
  so they never collide with signals (128+N) or Python's own 1/2.
* **The checkpoint layout and manifest schema.** A checkpoint is a directory
  ``step_<N>`` holding the DCP shards, ``.metadata``, ``manifest.json`` and, written
  last, ``COMMIT``. Only a directory whose COMMIT names the digest of its manifest
  counts; everything else is partial and is never resumed.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal, get_args


class StrEnum39(str, enum.Enum):
    """``enum.StrEnum`` of 3.11, for the node Pythons before it (3.9, 3.10): members
    are str, and ``str()``/``format()`` give the value (a plain ``(str, Enum)`` gives
    ``CommandType.STOP``, a command type no agent knows). Defined on every Python so a
    test on this machine's 3.11 can hold it to the real one."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last: list[Any]) -> str:
        return name.lower()


if sys.version_info >= (3, 11):
    from enum import StrEnum  # novermin: 3.11+ takes the real one
else:  # pragma: no cover - node images with Python 3.9/3.10
    StrEnum = StrEnum39


class Env:
    """Names of the environment variables the agent gives each rank."""

    SERVICE_URL = "SKYRESUME_RUN_SERVICE_URL"
    #: PEM certificates the agent verifies an ``https://`` service URL against (the
    #: operator's ``SKYRESUME_CA_BUNDLE``, carried to the node as text); unset: the
    #: node's own trust store. Public, not a secret.
    CA_PEM = "SKYRESUME_RUN_CA_PEM"
    JOB_ID = "SKYRESUME_RUN_JOB_ID"
    JOB_TOKEN = "SKYRESUME_RUN_JOB_TOKEN"
    ATTEMPT = "SKYRESUME_RUN_ATTEMPT"
    NODE_ID = "SKYRESUME_RUN_NODE_ID"
    #: Where checkpoints live durably (file://, s3://, gs://).
    CHECKPOINT_URI = "SKYRESUME_RUN_CHECKPOINT_URI"
    #: Fast node-local tier; saves land here first and are then uploaded.
    LOCAL_CHECKPOINT_DIR = "SKYRESUME_RUN_LOCAL_CHECKPOINT_DIR"
    #: ``latest`` | ``none`` | a path or URI of one ``step_<N>`` directory.
    RESUME_FROM = "SKYRESUME_RUN_RESUME_FROM"
    #: Expected resume step, set by the reconciler after staging; ranks refuse to
    #: train when what they loaded differs.
    EXPECTED_STEP = "SKYRESUME_RUN_EXPECTED_STEP"
    #: URI (s3://, gs://, file://) of the one confirmed ``step_<N>`` directory the agent
    #: stages onto ``<node disk>/staged/`` before torchrun starts; ranks never see it.
    #: RESUME_FROM then names the staged copy and EXPECTED_STEP its step.
    STAGE_FROM = "SKYRESUME_RUN_STAGE_FROM"
    CHECKPOINT_EVERY = "SKYRESUME_RUN_CHECKPOINT_EVERY"
    #: A plain script's own checkpoint (``checkpoint.own``): the path (``{node_disk}``
    #: allowed) and the option the agent appends it with, as ``<arg> <path>``, to the
    #: command when the path exists on the node.
    OWN_CHECKPOINT = "SKYRESUME_RUN_OWN_CHECKPOINT"
    OWN_RESUME_ARG = "SKYRESUME_RUN_OWN_RESUME_ARG"
    #: The service assigns the group when a launch holds only part of it (healthy
    #: nodes kept, replacements launched beside them): this launch's first node rank
    #: (the agent adds SkyPilot's node rank within the launch), the group's node count
    #: and the rendezvous address (a kept node's); unset, the launch is the group.
    NODE_RANK_BASE = "SKYRESUME_RUN_NODE_RANK_BASE"
    NNODES = "SKYRESUME_RUN_NNODES"
    MASTER_ADDR = "SKYRESUME_RUN_MASTER_ADDR"
    #: ``FIRST-LAST``: after a rollback past an anomaly (``on_anomaly: rollback_skip``),
    #: the batches of these steps are skipped (the data position moves past them when
    #: the run reaches FIRST), so the data that preceded it is not replayed; the step
    #: counter does not move.
    SKIP_STEPS = "SKYRESUME_RUN_SKIP_STEPS"
    #: Seconds a collective may wait before the watchdog fails it (the process group's
    #: timeout), derived by the service from the job's measured step and save times
    #: instead of torch's 10-minute default; unset on a first launch (nothing measured).
    COLLECTIVE_TIMEOUT_S = "SKYRESUME_RUN_COLLECTIVE_TIMEOUT_S"
    #: Complete checkpoints kept (locally and in the store); at least 2.
    CHECKPOINT_KEEP = "SKYRESUME_RUN_CHECKPOINT_KEEP"
    #: ``host:port`` of the agent's UDP progress listener on loopback.
    PROGRESS_ADDR = "SKYRESUME_RUN_PROGRESS_ADDR"
    #: Training knobs chosen by the memory planner.
    ACTIVATION_CHECKPOINT_EVERY = "SKYRESUME_RUN_ACTIVATION_CHECKPOINT_EVERY"
    MICRO_BATCH = "SKYRESUME_RUN_MICRO_BATCH"
    GRAD_ACCUM = "SKYRESUME_RUN_GRAD_ACCUM"
    GLOBAL_BATCH = "SKYRESUME_RUN_GLOBAL_BATCH"
    #: Elastic runs (a spec with ``min_nodes`` below ``num_nodes``): the world size the
    #: spec's global batch and learning rate are for (``num_nodes * ranks_per_node``), so
    #: a rank on a shrunk group knows how its world differs from the full one.
    FULL_WORLD_SIZE = "SKYRESUME_RUN_FULL_WORLD_SIZE"
    #: ``keep`` (the default: the global batch stays, each rank accumulates more) or
    #: ``scale`` (the global batch follows the world size, the learning rate follows
    #: ``ELASTIC_LR``).
    ELASTIC_BATCH = "SKYRESUME_RUN_ELASTIC_BATCH"
    #: ``linear`` or ``sqrt``: how the learning rate follows a scaled global batch.
    ELASTIC_LR = "SKYRESUME_RUN_ELASTIC_LR"
    #: ``1``: the node is a replacement held ready beside a shrunk group. Its agent
    #: registers, heartbeats and runs its health checks, and starts no ranks: the
    #: group grows onto it in a later attempt, which restarts it in place.
    STANDBY = "SKYRESUME_RUN_STANDBY"
    #: A JSON file the agent rewrites when the service pushes a new setting while the
    #: job runs (``{"checkpoint_every": N}``; for chaos ``"inject_fault": {"kind":
    #: FaultKind, "token": str, "rank": int | None}``, acted on once per token by the
    #: named global rank, or by every rank of the node when rank is None); the training library
    #: re-reads it. On an elastic run it also carries the group's membership under
    #: :data:`MEMBERSHIP_KEY` (see :class:`Membership`).
    CONTROL_FILE = "SKYRESUME_RUN_CONTROL_FILE"
    #: Elastic runs whose agent re-forms process groups warm (writes a
    #: :class:`Membership` into the control file when the group changes): seconds a rank
    #: that left its group (a lost peer, or a newer membership) waits for a membership
    #: newer than the one it left before it exits ``REGROUP_FAILED`` for a cold restart.
    #: Unset or 0: warm regroup is off, and a lost peer's collective error ends the
    #: process as it always did (an agent that restarts survivors cold sets nothing).
    REGROUP_TIMEOUT_S = "SKYRESUME_RUN_REGROUP_TIMEOUT_S"


#: The control file's key for an elastic group's membership: the object
#: :meth:`Membership.to_doc` writes, for example
#: ``{"generation": 2, "world_size": 2, "node_rank": 1, "nnodes": 2, "nproc_per_node": 1,
#: "master_addr": "10.0.0.4", "master_port": 29411, "resume_step": 40,
#: "resume_from": "latest"}``. The agent writes it into each member node's control file
#: (the same object on every node but ``node_rank``), atomically, as it writes the rest.
MEMBERSHIP_KEY = "membership"


@dataclass(frozen=True)
class Membership:
    """One generation of an elastic group: who is in it and where it resumes.

    A rank whose group ended (``RegroupReason``) re-forms on the first membership whose
    ``generation`` is newer than the one it left: ``init_process_group`` with
    ``tcp://master_addr:master_port``, rank ``node_rank * nproc_per_node + LOCAL_RANK``
    and ``world_size``, then loads ``resume_from``. A rank that starts cold adopts the
    generation its control file names when it starts (the agent writes the membership
    before it starts the ranks, and sets their torchrun/env rendezvous from it)."""

    generation: int
    """Increases by one or more with every change of the group; >= 1 (0 is the first
    launch's own group, for which nothing need be written)."""
    world_size: int
    """Ranks in the group: ``nnodes * nproc_per_node``."""
    node_rank: int
    """This node's rank in the group, 0 .. nnodes - 1 (the one field that differs
    between the members' control files)."""
    nnodes: int
    nproc_per_node: int
    master_addr: str
    """Where global rank 0 of the new group listens (its process hosts the TCP store)."""
    master_port: int
    """A port free on ``master_addr``; a new one per generation, since the previous
    group's store may still hold it."""
    resume_step: int | None
    """The step every rank must resume at (the last confirmed checkpoint after a lost
    node); None: the newest complete checkpoint every rank has (a planned grow: the
    ranks save at the boundary where they leave, after the membership was written)."""
    resume_from: str = "latest"
    """``latest`` or a local ``step_<N>`` directory path on the node's disk (never an
    s3:// or gs:// URI: the agent stages those first)."""

    def __post_init__(self) -> None:
        for name in ("generation", "world_size", "node_rank", "nnodes", "nproc_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"membership: {name} must be an integer, got {v!r}")
        if self.generation < 1:
            raise ValueError(f"membership: generation must be >= 1, got {self.generation}")
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(
                f"membership: nnodes ({self.nnodes}) and nproc_per_node "
                f"({self.nproc_per_node}) must be positive"
            )
        if self.world_size != self.nnodes * self.nproc_per_node:
            raise ValueError(
                f"membership: world_size {self.world_size} is not nnodes {self.nnodes} "
                f"x nproc_per_node {self.nproc_per_node}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"membership: node_rank {self.node_rank} is outside 0..{self.nnodes - 1}"
            )
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"membership: master_addr must be a host, got {self.master_addr!r}")
        port = self.master_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"membership: master_port must be 1..65535, got {port!r}")
        step = self.resume_step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"membership: resume_step must be a step number or null, got {step!r}")
        if not isinstance(self.resume_from, str) or self.resume_from in ("", "none"):
            raise ValueError(
                f"membership: resume_from must be 'latest' or a step directory, got "
                f"{self.resume_from!r} (a re-formed group never starts fresh)"
            )

    def global_rank(self, local_rank: int) -> int:
        """The rank of a node's ``local_rank`` in this group; ValueError when the
        membership gives the node fewer ranks than that."""
        if not 0 <= local_rank < self.nproc_per_node:
            raise ValueError(
                f"local rank {local_rank} is not in generation {self.generation} "
                f"({self.nproc_per_node} rank(s) per node)"
            )
        return self.node_rank * self.nproc_per_node + local_rank

    @property
    def init_method(self) -> str:
        """``tcp://host:port`` for ``init_process_group`` (an IPv6 host in brackets)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    def to_doc(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "world_size": self.world_size,
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "resume_step": self.resume_step,
            "resume_from": self.resume_from,
        }

    @classmethod
    def from_doc(cls, doc: Any) -> Membership:
        """ValueError naming the field when ``doc`` is not a valid membership."""
        if not isinstance(doc, dict):
            raise ValueError(f"membership: expected an object, got {type(doc).__name__}")
        names = (
            "generation", "world_size", "node_rank", "nnodes", "nproc_per_node",
            "master_addr", "master_port", "resume_step", "resume_from",
        )  # fmt: skip
        missing = [n for n in names if n not in doc]
        if missing:
            raise ValueError(f"membership: missing {', '.join(missing)}")
        return cls(**{n: doc[n] for n in names})


#: The agent <-> service protocol (the agent routes' bodies and their meaning). An
#: agent registers with it and ``orchestrator.__version__``; the service refuses (409)
#: an agent whose protocol or version differs from its own, so a node never runs
#: half-working against a service that reads its reports differently.
AGENT_PROTOCOL = 1


class ExitCode(IntEnum):
    """Why a rank exited. Anything not listed is a crash the classifier reads from logs."""

    OK = 0
    #: SIGTERM/SIGUSR1 received, all ranks agreed, emergency checkpoint committed.
    PREEMPTED_SAVED = 75
    #: NaN/Inf in loss or gradients; no optimizer step was applied.
    NAN_DETECTED = 76
    #: Ranks loaded different steps or manifests; training refused to start.
    RESUME_MISMATCH = 77
    #: The checkpoint asked for is partial, corrupt or unusable.
    CHECKPOINT_INVALID = 78
    #: The reference forward pass drifted: silent data corruption suspected.
    SILENT_CORRUPTION = 79
    #: Elastic, warm regroup on: the rank left its process group (a lost peer, or a
    #: newer membership, then it had saved) and did not re-form: no newer membership
    #: within ``REGROUP_TIMEOUT_S``, a stop while it waited, a membership without this
    #: rank, or a model sharded on the old group (FSDP). Its memory is of no use: the
    #: agent restarts it cold, from a checkpoint.
    REGROUP_FAILED = 80


# --- the shared vocabulary (service, reconciler, agent, training) -----------------------
#
# One StrEnum per word list, imported by every side: a value spelled differently on
# two sides would be a report the service refuses or a command the agent ignores.


class CommandType(StrEnum):
    """What the service asks an agent to do (``node_commands.type``)."""

    CHECKPOINT_AND_STOP = "checkpoint_and_stop"  # SIGTERM every rank: save, then exit 75
    STOP = "stop"  # stop every rank now (args may ask for stacks first)
    SET_CHECKPOINT_EVERY = "set_checkpoint_every"  # push a new interval to the ranks
    INJECT_FAULT = "inject_fault"  # chaos: a rank fails the way ``FaultKind`` says
    UPLOAD_LOGS = "upload_logs"  # send the agent's, torchrun's and each rank's log tail now
    #: Elastic warm shrink: the node, held at SIGNAL with its ranks waiting warm, is
    #: carried into attempt ``args["attempt"]``: its agent moves there (the commands
    #: route adds ``agent_token``, the new attempt's token for this node), stages
    #: ``args.get("stage_from")``, and writes ``args["membership"]`` (a
    #: :class:`Membership` doc) into the control file, where its ranks re-form.
    REGROUP = "regroup"


class ReportKind(StrEnum):
    """What an agent reports (``POST .../reports``); each becomes one event row."""

    PREEMPTION_NOTICE = "preemption_notice"  # the cloud's metadata announced a reclaim
    RANK_EXIT = "rank_exit"  # one rank's process ended (code, signal, log tail)
    ANOMALY = "anomaly"  # a rank's monitor found NaN, a spike, a straggler...
    CHECKPOINT = "checkpoint"  # rank 0 committed a checkpoint
    NODE_EXIT = "node_exit"  # torchrun ended; the node's outcome
    EVIDENCE = "evidence"  # stacks (and collective traces) taken before a kill
    HEALTH_CHECK = "health_check"  # the node's checks before torchrun started
    STAGED = "staged"  # the agent staged (or failed to stage) STAGE_FROM before torchrun


class EventKind(StrEnum):
    """``failure_events.kind``: every report kind, and what the service records itself."""

    PREEMPTION_NOTICE = "preemption_notice"
    RANK_EXIT = "rank_exit"
    ANOMALY = "anomaly"
    CHECKPOINT = "checkpoint"
    NODE_EXIT = "node_exit"
    EVIDENCE = "evidence"
    HEALTH_CHECK = "health_check"
    STAGED = "staged"
    NODE_LOST = "node_lost"  # the reconciler: a node vanished, went silent, never came up
    RANK_HANG = "rank_hang"  # the reconciler: ranks made no progress for the timeout
    STUCK = "stuck"  # the reconciler: an attempt never validated
    LAUNCH_FAILED = "launch_failed"  # the launcher refused or failed a launch
    REPLANNED = "replanned"  # a refused launch's attempt moved to the next placement
    INCIDENT = "incident"  # one per failed attempt; its protocol steps hang off it
    CHECKPOINT_CONFIRMED = "checkpoint_confirmed"  # CONFIRM's finding
    # The reconciler, elastic runs: a shrunk group's replacement is up, and the group
    # grows back onto it at the next step boundary (opens a planned incident: the
    # ranks save, and every node restarts in place at the full size).
    GROW = "grow"
    ELASTIC = "elastic"  # the reconciler: a shrink, wait or grow decision, or a spare lost
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # a new interval pushed to the ranks
    CHAOS = "chaos"  # an operator injected a fault
    PLAIN_SCRIPT = "plain_script"  # the reconciler: the ranks send no progress reports
    CONTROL_PLANE_DEGRADED = "control_plane_degraded"  # the reconciler: the service was deaf
    TASK_NOTE = "task_note"  # at submit: which of spec and YAML decided, what is not run


class AttemptState(StrEnum):
    """``attempts.state``: one attempt is one launch of the job's nodes."""

    LAUNCHING = "launching"  # recorded; its nodes are being started
    RUNNING = "running"  # the launcher started every node
    STOPPING = "stopping"  # an incident opened: its ranks are being stopped
    ENDED = "ended"  # torn down (or never started); final


class NodeState(StrEnum):
    """What an agent says its node is doing (``nodes.state``)."""

    REGISTERED = "registered"  # until the first heartbeat
    STARTING = "starting"  # torchrun is starting the ranks
    RUNNING = "running"
    STOPPING = "stopping"
    EXITED = "exited"


class RegroupReason(StrEnum):
    """Why an elastic rank's process group ended while the process lives on (the
    ``regroup`` datagram's ``reason``)."""

    PEER_LOST = "peer_lost"  # a collective failed: a peer's connection closed or reset
    PEER_TIMEOUT = "peer_timeout"  # a collective waited past the group's timeout: a peer
    # hung, or its host vanished without closing its sockets
    MEMBERSHIP = "membership"  # planned: the control file named a newer generation; the
    # ranks saved at that step boundary first
    FORM_FAILED = "form_failed"  # the newer membership's group did not form in time


class FaultKind(StrEnum):
    """Chaos a rank injects into itself at its next step (``inject_fault``)."""

    NAN = "nan"  # the reported loss becomes NaN once
    SPIKE = "spike"  # the loss jumps far above its trend for a while
    OOM = "oom"  # the rank raises torch.OutOfMemoryError
    XID = "xid"  # the rank writes a real Xid line to its log and dies
    TRANSPORT = "transport"  # the rank's collective fails with a transport error
    USER_ERROR = "user_error"  # the rank raises KeyError from its own frame


class AnomalyKind(StrEnum):
    """What a rank's monitor found: the ``anomaly`` datagram's ``kind`` (training/run.py
    sends it, the agent reads it)."""

    NAN = "nan"  # a non-finite loss or gradient; every rank skipped the update
    SPIKE = "spike"  # the loss jumped far above its trend and stayed there
    STRAGGLER = "straggler"  # one rank's steps hold every rank back
    SLOW_LINK = "slow_link"  # one rank's checkpoint uploads crawl: its node's own link
    SILENT_CORRUPTION = "silent_corruption"  # the reference forward pass drifted


class AnomalyFinding(StrEnum):
    """What an anomaly report says was found (``AnomalyReport.finding``): the failure
    class its event is recorded under, so each value is a ``FailureClass`` value too (a
    test holds them so; the contract imports nothing of the service's)."""

    NAN_DIVERGENCE = "nan_divergence"
    LOSS_SPIKE = "loss_spike"
    SLOW_PEER = "slow_peer"
    SILENT_CORRUPTION = "silent_corruption"


#: The finding each datagram kind is reported as (the agent's one translation).
ANOMALY_FINDINGS: dict[AnomalyKind, AnomalyFinding] = {
    AnomalyKind.NAN: AnomalyFinding.NAN_DIVERGENCE,
    AnomalyKind.SPIKE: AnomalyFinding.LOSS_SPIKE,
    AnomalyKind.STRAGGLER: AnomalyFinding.SLOW_PEER,
    AnomalyKind.SLOW_LINK: AnomalyFinding.SLOW_PEER,  # the service drains the node either way
    AnomalyKind.SILENT_CORRUPTION: AnomalyFinding.SILENT_CORRUPTION,
}


class Provider(StrEnum):
    """The clouds whose metadata notices the agent reads (``orchestrator.cloud.metadata``
    parses each one's format). The one list of them: the settings, the agent's and the
    CLI's flags, the simulator, chaos and the launchers take it from here, and the
    per-provider tables in ``cloud/metadata.py`` are held to it by a test. Each is also
    a :data:`Cloud` a spec may name."""

    aws = "aws"
    gcp = "gcp"
    azure = "azure"


#: :class:`Provider`'s values, in order, for flags and messages.
PROVIDERS: tuple[str, ...] = tuple(p.value for p in Provider)

#: The clouds a job spec may name (``resources.clouds``): SkyPilot's names, and
#: ``local`` for the local launcher. A Literal, so pydantic refuses any other name and
#: mypy checks every table keyed by it (the planner's catalog clouds are a subset).
Cloud = Literal["aws", "gcp", "azure", "kubernetes", "lambda", "runpod", "local"]
#: :data:`Cloud`'s names, in order.
CLOUDS: tuple[str, ...] = get_args(Cloud)


# --- checkpoint layout ---------------------------------------------------------------

MANIFEST_NAME = "manifest.json"
COMMIT_NAME = "COMMIT"
MANIFEST_FORMAT = "skyresume-checkpoint/1"
STEP_DIR_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step_<N>`` directory name, or None for any other name."""
    m = STEP_DIR_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


class ManifestError(ValueError):
    """A manifest or COMMIT marker that cannot be trusted; the message names why."""


@dataclass(frozen=True)
class ManifestFile:
    path: str
    """Relative to the step directory, ``/``-separated."""
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    created: str
    """ISO 8601 UTC."""
    files: tuple[ManifestFile, ...]
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form: global batch, knobs, torch version... never needed to load."""

    def to_json(self) -> bytes:
        doc = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
            "extra": self.extra,
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "manifest.json") -> Manifest:
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{source}: not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ManifestError(f"{source}: expected a JSON object")
        if doc.get("format") != MANIFEST_FORMAT:
            raise ManifestError(
                f"{source}: format is {doc.get('format')!r}, want {MANIFEST_FORMAT!r}"
            )
        try:
            step = doc["step"]
            world = doc["world_size"]
            files_doc = doc["files"]
            created = doc["created"]
        except KeyError as e:
            raise ManifestError(f"{source}: missing field {e.args[0]!r}") from None
        if not isinstance(step, int) or step < 0:
            raise ManifestError(f"{source}: step must be a non-negative integer, got {step!r}")
        if not isinstance(world, int) or world < 1:
            raise ManifestError(f"{source}: world_size must be a positive integer, got {world!r}")
        if not isinstance(files_doc, list) or not files_doc:
            raise ManifestError(f"{source}: files must be a non-empty list")
        files = []
        for i, f in enumerate(files_doc):
            try:
                path, size, digest = f["path"], f["size"], f["sha256"]
            except (KeyError, TypeError):
                raise ManifestError(f"{source}: files[{i}] needs path, size and sha256") from None
            if (
                not isinstance(path, str)
                or path.startswith("/")
                or ".." in path.split("/")
                or path in (MANIFEST_NAME, COMMIT_NAME)
            ):
                raise ManifestError(
                    f"{source}: files[{i}].path {path!r} is not a safe relative path"
                )
            if not isinstance(size, int) or size < 0:
                raise ManifestError(f"{source}: files[{i}].size must be >= 0, got {size!r}")
            if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ManifestError(f"{source}: files[{i}].sha256 is not a sha256 hex digest")
            files.append(ManifestFile(path, size, digest))
        return cls(step, world, str(created), tuple(files), dict(doc.get("extra") or {}))


def manifest_digest(manifest_bytes: bytes) -> str:
    """The digest a COMMIT marker must carry, and the one ranks compare on resume."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def commit_marker(manifest_bytes: bytes) -> bytes:
    return f"sha256:{manifest_digest(manifest_bytes)}\n".encode()


def check_commit(commit_bytes: bytes, manifest_bytes: bytes, *, source: str = "COMMIT") -> None:
    """Raise ManifestError unless the COMMIT marker names exactly this manifest."""
    want = commit_marker(manifest_bytes)
    if commit_bytes != want:
        raise ManifestError(
            f"{source}: does not match the manifest's digest (torn or foreign commit)"
        )


# --- progress channel (rank -> agent, UDP datagrams on loopback) ---------------------

#: Every datagram is one JSON object with a "type" of these, plus "rank" and "ts":
#:
#: * ``progress``: step, step_time, loss, grad_norm, samples_per_s (every step)
#: * ``resumed``: step, manifest_digest (once, after every rank agreed on what it
#:   loaded and before the first optimizer step; step 0 / digest None = fresh start)
#: * ``checkpoint``: step, path, uploaded_uri, world_size, blocking_s (rank 0, after a
#:   commit; blocking_s = how long training waited for the save)
#: * ``anomaly``: kind (an :class:`AnomalyKind`), step, detail
#: * ``exit``: code, reason (best effort, just before a deliberate exit)
#: * ``regroup``: generation (the one left), reason (``RegroupReason``), error (the
#:   collective's error text, or null), step (steps done in memory), saved_step (the step
#:   saved before a planned leave, else null), pid: an elastic rank left its process
#:   group and now waits for a newer ``Membership`` in its control file; once it re-forms,
#:   its ``resumed`` datagram (with ``generation``) follows again
PROGRESS_TYPES = frozenset({"progress", "resumed", "anomaly", "checkpoint", "exit", "regroup"})
MAX_DATAGRAM = 8192
