"""The local launcher: a provisioner for this machine that runs the same SkyPilot
task a cloud would.

A launch renders the job's task exactly as the SkyPilot launcher does (the template
or the user's own task YAML: ``setup``, ``run``, ``envs``, ``secrets``), then a boot
process (:mod:`orchestrator.launchers.localboot`) plays the cloud: it waits the
provisioning delay, refuses when the region is stocked out, runs ``setup`` and then
``run`` on every node with the ``SKYPILOT_*`` values SkyPilot sets. The service is
never blocked: ``launch`` returns a request that ``progress`` polls.

Each node is a host of its own where the kernel allows (we are root here and in
CI): a network namespace on a bridge (:mod:`orchestrator.launchers.netns`) with its
own IP, its provider's metadata endpoint at the real link-local address, and its
own home directory as its disk. Its setup installs the agent from the service's own
wheel, as on a cloud. A node kept across attempts (a restart on the same machines,
as ``sky exec``) keeps that disk: the new attempt's node runs on the kept machine's
home, with the script's own files and the package its setup installed. Where
namespaces are unavailable the launcher says so and falls back to shared loopback
(``network="loopback"``), with the metadata URL given to the agent instead.

Every process of a node carries an environment marker (``SKYRESUME_LOCAL_NODE``)
that its agent, torchrun and every rank inherit, so the node can be found and
killed as a whole, the way a cloud takes a VM back: torchrun starts each worker in
a session of its own, and workers outlive a SIGKILLed torchrun (DESIGN.md).

The launcher keeps nothing in memory that it cannot rebuild: requests, pids and
states are files, so a restarted service still sees, stops or kills its nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.cloud.metadata import PROVIDERS, RECLAIM_KIND, Provider
from orchestrator.cloud.simulator import MetadataSimulator
from orchestrator.domain.planner import Candidate
from orchestrator.domain.reconcile import LauncherAbilities
from orchestrator.domain.spec import JobSpec
from orchestrator.launchers.base import (
    CapacityError,
    ClusterState,
    ClusterStatus,
    LaunchError,
    LaunchHandle,
    LaunchPhase,
    LaunchProgress,
    LaunchRequest,
)
from orchestrator.launchers.localboot import NODE_MARKER, read_json

#: Where a node's PATH starts: the image's Python first (the training dependencies
#: are "baked into the image": here, the interpreter the service runs on).
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: What a node's checkpoint store client reads (endpoint and static keys), passed to
#: nodes as task secrets; a cloud node would have an instance role instead.
STORAGE_ENV = (
    "SKYRESUME_S3_ENDPOINT_URL",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "STORAGE_EMULATOR_HOST",
)


def node_id_for(job_id: str, attempt: int, index: int) -> str:
    return f"{job_id}-a{attempt}-n{index}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _marker(job_id: str, node_id: str) -> bytes:
    return f"{NODE_MARKER}={job_id}/{node_id}".encode()


def marked_pids(markers: dict[bytes, str]) -> dict[str, list[int]]:
    """{name: live pids} of every process whose environment holds one of ``markers``
    (``NAME=value`` bytes -> name). Linux /proc; other users' processes are skipped."""
    out: dict[str, list[int]] = {name: [] for name in markers.values()}
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for m, name in markers.items():
            if m in env and _alive(int(entry.name)):
                out[name].append(int(entry.name))
    return out


def release_everything(root: Path, fabric: Any = None) -> int:
    """Give back every host this machine-as-a-cloud holds under ``root``, as deleting an
    account's VMs does: every process of every node (by its marker) and every boot
    process, SIGKILLed, then ``fabric`` (its namespaces and bridge). Returns how many
    processes were killed.

    For a harness that ends a service for good (a test, the demo). A service that
    stops does not do this: its nodes keep running, as a cloud's VMs outlive the
    control plane, and the next service on the same home picks them up."""
    markers: dict[bytes, str] = {}
    boots: list[int] = []
    for job in (d for d in root.glob("*") if d.is_dir() and d.name != "fabric"):
        for node in (d for d in job.iterdir() if d.is_dir()):
            markers[_marker(job.name, node.name)] = f"{job.name}/{node.name}"
        for meta in job.glob("*.json"):
            pid = read_json(meta).get("boot_pid")
            if isinstance(pid, int) and _alive(pid):
                boots.append(pid)
    pids = boots + [p for ps in marked_pids(markers).values() for p in ps]
    _signal_all(pids, signal.SIGKILL)
    if fabric is not None:
        fabric.teardown()
    (root / "hosts.json").unlink(missing_ok=True)
    return len(pids)


def node_pids(job_id: str, node_id: str) -> list[int]:
    return marked_pids({_marker(job_id, node_id): node_id})[node_id]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@dataclass(frozen=True)
class LocalLauncherConfig:
    """How the local launcher plays a cloud: every choice but the service's address,
    its tokens and a caller's own network. The service builds it from its settings in
    one place (``server.local_launcher_config``: the ``SKYRESUME_LOCAL_*`` settings and
    the environment they name); a test sets only what it tests."""

    provider: str = "aws"
    """Whose metadata format the nodes' agents poll (a ``contract.PROVIDERS`` name):
    chaos ``preempt`` can send only that provider's notice."""
    network: str = "loopback"
    """``netns``: each node a network namespace on a bridge, its own IP and metadata
    address (needs root); ``loopback``: nodes share this machine's loopback (no
    partitions, no kept survivors). Never ``auto``: the service resolves that first."""
    network_note: str = ""
    """How the nodes are hosts here (netns, or why not), for the service's banner."""
    regions: tuple[str, ...] = ("local",)
    """The regions a placement may name; ``chaos stockout R`` makes one refuse launches."""
    hosts_per_region: int = 8
    """Hosts in each region; a host blamed for a hardware fault is never reused, so a
    region runs out after this many."""
    provision_delay_s: float = 0.0
    """How long a launch provisions before its setup runs (a cloud VM takes minutes);
    the reconciler polls it, never waits on it."""
    gpu_memory_gib: float | None = None
    """GPU memory the nodes declare; None: CPU only, no memory planning."""
    replacement_gpu_memory_gib: float | None = None
    """GPU memory a replacement node declares (None: ``gpu_memory_gib``): less makes the
    memory planner replan activation checkpointing and micro-batch on this machine."""
    package: str = ""
    """What each node's setup installs the agent from (the service's wheel URL); empty:
    the agent on the image's PATH is used as it is (no setup install)."""
    pip_args: str = "--no-index --no-deps"
    """Extra pip arguments of that install (the nodes have no index here)."""
    template: str = "gpt-cpu"
    """The task template a job without its own task YAML is rendered from."""
    python: str = sys.executable
    """The image's Python: it runs the boot process, the metadata fronts and (its
    directory first on PATH) each node's own environment."""
    poll_s: float = 1.0
    """Seconds between the agents' metadata polls (``SKYRESUME_POLL_S``)."""
    heartbeat_s: float = 1.0
    """Seconds between the agents' heartbeats (``SKYRESUME_HEARTBEAT_S``)."""
    storage_env: Mapping[str, str] = field(default_factory=dict)
    """The checkpoint store's endpoint and keys (``STORAGE_ENV`` names), passed to
    nodes as task secrets."""
    image_env: Mapping[str, str] = field(default_factory=dict)
    """What the nodes' image sets (``SKYRESUME_LOCAL_NODE_ENV``), under the task's envs."""
    keep_survivors: bool = True
    """After a node loss keep the healthy nodes and launch only the replacement (netns
    only: on loopback two launches' ports would collide)."""
    release_single_nodes: bool = True
    """Whether a lost node of a launch can be given back alone (netns only); false
    behaves like SkyPilot: a cluster goes whole."""

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ValueError(
                f"provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}"
            )
        if not self.regions or self.hosts_per_region < 1:
            raise ValueError("the local launcher needs at least one region and one host in each")
        if self.network not in ("netns", "loopback"):
            raise ValueError(f"network must be netns or loopback, got {self.network!r}")
        # Frozen, and the caller's mappings copied: a launch reads these from threads.
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "storage_env", dict(self.storage_env))
        object.__setattr__(self, "image_env", dict(self.image_env))


class LocalLauncher:
    """This machine as a cloud (see the module docstring). ``token_for(job_id, attempt)``
    gives the agent's token for that attempt, which reaches the node as a task secret;
    ``config`` says how the cloud behaves (:class:`LocalLauncherConfig`)."""

    name = "local"
    abilities = LauncherAbilities(restarts_in_place=True, chaos=True)

    def __init__(
        self,
        root: Path,
        service_url: str,
        token_for: Callable[[str, int], str],
        config: LocalLauncherConfig | None = None,
        *,
        fabric: Any = None,
    ) -> None:
        self.root = Path(root)
        self.service_url = service_url.rstrip("/")
        self.token_for = token_for
        self.config = cfg = config if config is not None else LocalLauncherConfig()
        # Nodes of two launches form one group only where each node is a host with
        # an address of its own (on shared loopback, ports would collide).
        self.abilities = LauncherAbilities(
            restarts_in_place=True,
            chaos=True,
            keeps_survivors=cfg.network == "netns" and cfg.keep_survivors,
            releases_single_nodes=cfg.network == "netns" and cfg.release_single_nodes,
        )
        self._fabric: Any = fabric
        """A Fabric made by the caller (its bridge and subnet); else made on first use."""
        self._sim: MetadataSimulator | None = None
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # --- metadata -------------------------------------------------------------------

    @property
    def fabric(self) -> Any:
        """The namespaces-on-a-bridge network (``network="netns"``), made on first use."""
        if self.config.network != "netns":
            return None
        with self._lock:
            if self._fabric is None:
                from orchestrator.launchers.netns import Fabric

                self._fabric = Fabric(self.root / "fabric")
                self._fabric.up()
            return self._fabric

    @property
    def metadata(self) -> MetadataSimulator:
        fabric = self.fabric  # nodes in namespaces reach the simulator on the gateway
        with self._lock:
            if self._sim is None:
                host = fabric.gateway if fabric is not None else "127.0.0.1"
                self._sim = self._start_metadata(host)
            return self._sim

    def _start_metadata(self, host: str) -> MetadataSimulator:
        """The simulator on the port the previous service on this root used, when it
        is free: running nodes' metadata fronts forward to it, so they keep their
        provider's endpoint across a service restart (a cloud's metadata service does
        not go away when the control plane restarts)."""
        port_file = self.root / "metadata.port"
        try:
            saved = int(port_file.read_text())
        except (OSError, ValueError):
            saved = 0
        try:
            sim = MetadataSimulator(host=host, port=saved).start()
        except OSError:  # taken by someone else meanwhile: nodes launched from now on
            sim = MetadataSimulator(host=host).start()
        port_file.parent.mkdir(parents=True, exist_ok=True)
        port_file.write_text(str(urllib.parse.urlsplit(sim.url).port))
        return sim

    def close(self) -> None:
        """Stop the metadata simulator (nodes keep running; ``down`` stops them)."""
        with self._lock:
            if self._sim is not None:
                self._sim.stop()
                self._sim = None

    # --- layout ---------------------------------------------------------------------

    def node_dir(self, job_id: str, node_id: str) -> Path:
        return self.root / job_id / node_id

    def node_home(self, job_id: str, node_id: str) -> Path:
        """The node's home directory: its disk (the template keeps the checkpoint tier
        and what it stages under ``$HOME/skyresume/node``)."""
        return self.node_dir(job_id, node_id) / "home"

    def node_python(self, job_id: str, node_id: str) -> Path:
        """The node's own Python environment, on its disk (``localboot.prepare_python``:
        the image's packages, its own installs)."""
        return self.node_home(job_id, node_id) / "skyresume" / "python"

    def _keep_disk(self, job_id: str, kept: str, node_id: str) -> None:
        """Node ``node_id`` runs on the machine ``kept`` ran on, so it has that machine's
        disk, as a cloud VM that stays keeps its own: the script's own snapshot and the
        agent package its setup installed (a restart runs no setup) are still there.
        Without it the kept node's run found an empty home, and its agent ran from the
        image's (the service's) environment instead of the served package (issue 27).
        Its id (logs, marker) is the new attempt's; its home is the machine's."""
        home = self.node_home(job_id, node_id)
        if home.is_symlink() or home.exists():
            return  # this launch's disk is settled already (a second look at the request)
        disk = self.node_home(job_id, kept).resolve()  # the machine's disk, however kept
        disk.mkdir(parents=True, exist_ok=True)
        # The last run's agent pid is not this node's agent: a kill-agent aimed at it
        # could hit a reused pid. The new run writes its own.
        (disk / "skyresume" / "agent.pid").unlink(missing_ok=True)
        home.symlink_to(disk, target_is_directory=True)

    def _pid(self, job_id: str, node_id: str) -> int | None:
        """The agent's pid: the run section starts it as its child (never exec'd, so
        that the run exits 0, task_templates/*.yaml) and writes it on the node's disk;
        the boot's own file (the run's shell) is the fallback for a run of another kind."""
        for path in (
            self.node_home(job_id, node_id) / "skyresume" / "agent.pid",
            self.node_dir(job_id, node_id) / "agent.pid",
        ):
            try:
                return int(path.read_text())
            except (OSError, ValueError):
                continue
        return None

    # --- Launcher protocol ------------------------------------------------------------

    def candidates(self, spec: JobSpec, *, replacement: bool = False) -> list[Candidate]:
        """One offering per local region: process nodes, no price.

        ``gpu_memory_gib`` (first launch) and ``replacement_gpu_memory_gib`` (every
        relaunch) declare a GPU size the nodes pretend to have, so that a replacement
        with less memory exercises the memory planner's replanning on this machine.
        """
        gib = self.config.replacement_gpu_memory_gib if replacement else self.config.gpu_memory_gib
        gib = gib if gib is not None else self.config.gpu_memory_gib
        return [
            Candidate(
                cloud="local",
                region=r,
                instance_type="cpu-process",
                accelerator=None,
                accelerator_count=0,
                gpu_memory_gib=gib,
                price_per_node_hour=0.0,
                spot_price_per_node_hour=0.0,
            )
            for r in self.config.regions
        ]

    # --- capacity (a stocked-out region refuses launches, like a cloud) -------------------

    def _stockout_file(self) -> Path:
        return self.root / "stockouts.json"

    def stocked_out(self) -> dict[str, float]:
        """region -> until (epoch seconds) for regions that refuse launches now."""
        try:
            doc = json.loads(self._stockout_file().read_text())
        except (OSError, ValueError):
            return {}
        now = time.time()
        return {r: float(t) for r, t in doc.items() if isinstance(t, int | float) and t > now}

    def stockout(self, region: str, *, seconds: float = 600.0) -> None:
        """Chaos: ``region`` has no capacity for ``seconds`` (0 lifts it). Kept in a file,
        so a restarted service still sees it."""
        if region not in self.config.regions:
            raise LaunchError(
                f"no local region {region!r}: this service has {', '.join(self.config.regions)} "
                "(SKYRESUME_LOCAL_REGIONS)"
            )
        doc = self.stocked_out()
        if seconds > 0:
            doc[region] = time.time() + seconds
        else:
            doc.pop(region, None)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self._stockout_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self._stockout_file())

    def _allocation_file(self) -> Path:
        return self.root / "hosts.json"

    def held_hosts(self) -> dict[str, str]:
        """host -> the launch holding it, for every host not given back yet."""
        return self._allocated()

    def _allocated(self) -> dict[str, str]:
        """host -> the launch holding it: a host is taken from launch until it is given
        back (down), whatever runs on it (a cut-off node still holds its machine)."""
        doc = read_json(self._allocation_file())
        return {str(h): str(c) for h, c in doc.items()}

    def _set_allocation(self, hosts: tuple[str, ...], cluster: str | None) -> None:
        with self._lock:
            doc = self._allocated()
            for h in hosts:
                if cluster is None:
                    doc.pop(h, None)
                else:
                    doc[h] = cluster
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self._allocation_file().with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self._allocation_file())

    def _hosts_for(self, region: str, count: int, exclude: tuple[str, ...]) -> tuple[str, ...]:
        taken = self._allocated()
        free = [
            h
            for h in (f"{region}-host{i}" for i in range(self.config.hosts_per_region))
            if h not in exclude and h not in taken
        ]
        if len(free) < count:
            raise CapacityError(
                f"InsufficientInstanceCapacity: local region {region} has {len(free)} free "
                f"hosts for {count} nodes (excluded: {', '.join(exclude) or 'none'}; "
                f"{sum(1 for h in taken if h.startswith(region + '-'))} taken)"
            )
        return tuple(free[:count])

    def restart(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """A new attempt on the previous attempt's hosts, like ``sky exec``: nothing is
        provisioned and setup does not run again; only ``run`` starts."""
        return self._start(request, previous)

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        return self._start(request, None)

    def render(self, request: LaunchRequest) -> tuple[dict[str, Any], dict[str, str]]:
        """(the job's SkyPilot task config, its secrets), rendered exactly as the SkyPilot
        launcher renders them (one code path: ``SkyPilotLauncher.node_config``)."""
        from orchestrator.launchers.skypilot import SkyPilotLauncher

        builder = SkyPilotLauncher(
            token_for=self.token_for, template=self.config.template, package=self.config.package
        )
        return builder.node_config(request, request.task)

    def _node_env(
        self, task: dict[str, Any], secrets: dict[str, str], request: LaunchRequest, k: int,
        node_id: str, ips: list[str],
        host: Any, master_port: int, cluster: str,
    ) -> dict[str, str]:  # fmt: skip
        """A node's whole environment: a clean image's, the task's envs and secrets,
        and what SkyPilot sets; never the service's own environment (its tokens). Its
        ``python3`` and ``pip`` are the node's own venv's (:meth:`node_python`), first
        on PATH: a setup's ``pip install`` lands on the node's disk, not in the
        service's environment."""
        home = self.node_home(request.job_id, node_id)
        venv = self.node_python(request.job_id, node_id)
        image = f"{venv}/bin:{Path(self.config.python).parent}"
        env: dict[str, str] = {
            "PATH": f"{image}:{_SYSTEM_PATH}",
            "VIRTUAL_ENV": str(venv),
            "HOME": str(home),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "OMP_NUM_THREADS": "1",
            **self.config.image_env,
        }
        if "PATH" in self.config.image_env:  # the image's Python stays first on its PATH
            env["PATH"] = f"{image}:{self.config.image_env['PATH']}"
        env.update({str(k_): str(v) for k_, v in (task.get("envs") or {}).items()})
        env.update(secrets)
        env.update(self.config.storage_env)
        env.update(
            {
                "SKYPILOT_NODE_RANK": str(k),
                "SKYPILOT_NODE_IPS": "\n".join(ips),
                "SKYPILOT_NUM_NODES": str(len(ips)),
                "SKYPILOT_NUM_GPUS_PER_NODE": str(request.placement.accelerator_count or 0),
                "SKYPILOT_TASK_ID": f"sky-{time.strftime('%Y-%m-%d-%H-%M-%S')}_{cluster}_1",
                # This machine plays the provider: its metadata format, on the node.
                "SKYRESUME_PROVIDER": self.config.provider,
                "SKYRESUME_METADATA_URL": ""
                if host is not None
                else self.metadata.node_url(node_id),
                "SKYRESUME_MASTER_PORT": str(master_port),
                "SKYRESUME_HEARTBEAT_S": f"{self.config.heartbeat_s:g}",
                "SKYRESUME_POLL_S": f"{self.config.poll_s:g}",
                "SKYRESUME_PIP_ARGS": self.config.pip_args,
                NODE_MARKER: f"{request.job_id}/{node_id}",
            }
        )
        if host is not None:
            env["GLOO_SOCKET_IFNAME"] = host.ifname  # the image's network setting
        return env

    def _start(self, request: LaunchRequest, previous: LaunchHandle | None) -> LaunchHandle:
        job, attempt = request.job_id, request.attempt
        nodes, base = request.placement.num_nodes, request.node_rank_base
        # A launch beside kept nodes is a cluster of its own, its nodes ranked after them.
        cluster = request.launch_key + (f"-b{base}" if base else "")
        node_ids = tuple(node_id_for(job, attempt, base + k) for k in range(nodes))
        meta = self.root / job / f"{cluster}.json"
        (self.root / job).mkdir(parents=True, exist_ok=True)
        # Idempotent per launch key, across processes: whoever creates the claim starts
        # the request; anyone else (a service restarted mid-launch, a new leader while
        # the old one was paused inside this call) is answered with it, never twins.
        claim = self.root / job / f"{cluster}.claim"
        try:
            os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return self._adopt(cluster, node_ids)
        try:
            region = request.placement.region
            if previous is not None and previous.hosts:
                hosts = tuple(previous.hosts)
            else:
                if region not in self.config.regions:
                    raise LaunchError(
                        f"no local region {region!r} ({', '.join(self.config.regions)})"
                    )
                hosts = self._hosts_for(region, nodes, request.exclude_hosts)
            task, secrets = self.render(request)
        except Exception:  # refused before it was accepted: the key may be asked again
            claim.unlink(missing_ok=True)
            raise
        # The machines are this launch's from now on, so that ``down`` finds them even
        # when the service dies before the request's meta is written.
        self._set_allocation(hosts, cluster)
        fabric = self.fabric
        net = [fabric.add_host(h) for h in hosts] if fabric is not None else [None] * nodes
        ips = [h.ip if h is not None else "127.0.0.1" for h in net]
        master_port = free_port() if fabric is None else 29500
        specs = []
        for k, node_id in enumerate(node_ids):
            d = self.node_dir(job, node_id)
            (d / "logs").mkdir(parents=True, exist_ok=True)
            if previous is not None and k < len(previous.node_ids):
                self._keep_disk(job, previous.node_ids[k], node_id)
            self.metadata.node(node_id)  # the endpoint answers from boot
            if net[k] is not None:
                fabric.start_metadata(net[k], self.metadata.node_url(node_id), self.config.python)
            env = self._node_env(
                task, secrets, request, k, node_id, ips, net[k], master_port, cluster
            )
            prefix = fabric.exec_prefix(net[k]) if net[k] is not None else []
            specs.append(
                {"node_id": node_id, "env": env, "exec_prefix": prefix, "log_dir": str(d / "logs"),
                 "venv": str(self.node_python(job, node_id))}
            )  # fmt: skip
        # As ``sky launch``: setup on a fresh launch (it installs the agent, then the
        # user's own setup); as ``sky exec``: a restart in place runs only ``run``.
        setup = task.get("setup") if previous is None else None
        state_file = self.root / job / f"{cluster}.state.json"
        spec_file = self.root / job / f"{cluster}.launch.json"
        spec_doc = {
            "nodes": specs,
            "setup": setup,
            "run": task.get("run") or "",
            "hosts": list(hosts),
            "region": region,
            "instance_type": request.placement.instance_type,
            "delay_s": self.config.provision_delay_s if previous is None else 0.0,
            "check_capacity": previous is None,
            "stockout_file": str(self._stockout_file()),
            "state_file": str(state_file),
        }
        # The request holds the task's secrets (the agent's token): owner-only.
        fd = os.open(spec_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(spec_doc, f)
        log = open(self.root / job / f"{cluster}.boot.log", "ab")  # noqa: SIM115 - the child's
        try:
            boot = subprocess.Popen(
                [self.config.python, "-m", "orchestrator.launchers.localboot", str(spec_file)],
                env={"PATH": os.environ.get("PATH", _SYSTEM_PATH), "HOME": str(self.root)},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            self._set_allocation(hosts, None)
            claim.unlink(missing_ok=True)
            raise LaunchError(f"could not start the provisioner for {cluster}: {e}") from None
        finally:
            log.close()
        with self._lock:
            self._procs[cluster] = boot
        request_id = f"local-{cluster}-{boot.pid}"
        doc = {
            "node_ids": list(node_ids),
            "master_port": master_port,
            "hosts": list(hosts),
            "request_id": request_id,
            "boot_pid": boot.pid,
        }
        tmp = meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, meta)  # a reader never sees half of it
        return LaunchHandle(cluster, self.name, node_ids, hosts, request_id)

    #: How long a claimed launch may go without its meta before it counts as dead (the
    #: claimer died between claiming and starting the provisioner: nothing runs).
    CLAIM_GRACE_S = 30.0

    def _adopt(self, cluster: str, node_ids: tuple[str, ...]) -> LaunchHandle:
        """The handle of a launch another call (maybe another process) claimed."""
        job = cluster.rsplit("-a", 1)[0]
        doc = read_json(self.root / job / f"{cluster}.json")
        if doc.get("node_ids"):
            return LaunchHandle(
                cluster, self.name, tuple(doc["node_ids"]), tuple(doc.get("hosts", ())),
                str(doc.get("request_id") or ""),
            )  # fmt: skip
        hosts = tuple(h for h, c in self._allocated().items() if c == cluster)
        return LaunchHandle(cluster, self.name, node_ids, hosts, f"local-{cluster}")

    def launch_requests(self, job_id: str) -> list[str]:
        """Every launch key this launcher was ever asked to start for ``job_id`` (the
        claims, which outlive the request): what the harnesses count launches by."""
        return sorted(p.stem for p in (self.root / job_id).glob("*.claim"))

    def progress(self, handle: LaunchHandle) -> LaunchProgress:
        """The boot process's state file; a boot that died without one failed."""
        job = handle.cluster_name.rsplit("-a", 1)[0]
        self._reap()
        state = read_json(self.root / job / f"{handle.cluster_name}.state.json")
        phase = state.get("phase")
        if phase == "up":
            return LaunchProgress(LaunchPhase.UP, hosts=tuple(state.get("hosts") or ()))
        if phase == "failed":
            return LaunchProgress(
                LaunchPhase.FAILED, str(state.get("detail") or ""), bool(state.get("capacity"))
            )
        meta = read_json(self.root / job / f"{handle.cluster_name}.json")
        pid = meta.get("boot_pid")
        if isinstance(pid, int) and _alive(pid):
            return LaunchProgress(LaunchPhase.PROVISIONING, "booting")
        claim = self.root / job / f"{handle.cluster_name}.claim"
        with contextlib.suppress(OSError):
            if not meta and time.time() - claim.stat().st_mtime < self.CLAIM_GRACE_S:
                return LaunchProgress(LaunchPhase.PROVISIONING, "being started")
        log = self.root / job / f"{handle.cluster_name}.boot.log"
        return LaunchProgress(
            LaunchPhase.FAILED, f"the provisioner of {handle.cluster_name} died; see {log}"
        )

    def _reap(self) -> None:
        with self._lock:
            for proc in self._procs.values():
                proc.poll()

    def node_alive(self, job_id: str, node_id: str) -> bool:
        """Whether anything of the node is still running (its agent or any rank)."""
        self._reap()
        return bool(node_pids(job_id, node_id))

    def status(self, handle: LaunchHandle) -> ClusterStatus:
        job = handle.cluster_name.rsplit("-a", 1)[0]
        self._reap()
        live = marked_pids({_marker(job, n): n for n in handle.node_ids})
        up = tuple(n for n in handle.node_ids if live[n])
        if len(up) == len(handle.node_ids):
            state = ClusterState.UP
        elif up:
            state = ClusterState.PARTIAL
        else:
            state = ClusterState.DOWN
        return ClusterStatus(state, up)

    def down(self, handle: LaunchHandle, grace_s: float = 5.0) -> None:
        job = handle.cluster_name.rsplit("-a", 1)[0]
        markers = {_marker(job, n): n for n in handle.node_ids}

        def pids() -> list[int]:
            return [p for ps in marked_pids(markers).values() for p in ps]

        _signal_all(pids(), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and pids():
            self._reap()
            time.sleep(0.1)
        _signal_all(pids(), signal.SIGKILL)
        meta = read_json(self.root / job / f"{handle.cluster_name}.json")
        boot = meta.get("boot_pid")
        if isinstance(boot, int) and _alive(boot):
            _signal_all([boot], signal.SIGKILL)  # a launch given up while provisioning
        self._reap()
        # A handle adopted before its meta existed may not know its hosts: the
        # allocation does.
        hosts = tuple(handle.hosts) or tuple(
            h for h, c in self._allocated().items() if c == handle.cluster_name
        )
        fabric = self.fabric
        if fabric is not None:
            for h in hosts:  # the VM is gone: its address and link with it
                with contextlib.suppress(Exception):
                    fabric.remove_host(h)
        self._set_allocation(hosts, None)

    # --- chaos (local only) ------------------------------------------------------------

    def kill_node(self, job_id: str, node_id: str) -> int:
        """SIGKILL everything of the node at once, like a VM taken back without notice.
        Returns how many processes were killed."""
        if self._pid(job_id, node_id) is None:
            raise LaunchError(f"no local node {node_id} for job {job_id}")
        pids = node_pids(job_id, node_id)
        _signal_all(pids, signal.SIGKILL)
        self._reap()
        return len(pids)

    def kill_agent(self, job_id: str, node_id: str) -> None:
        """SIGKILL the agent alone: its ranks live on as orphans (the case DESIGN.md warns of)."""
        pid = self._pid(job_id, node_id)
        if pid is None or not _alive(pid):
            raise LaunchError(f"the agent of {node_id} is not running")
        os.kill(pid, signal.SIGKILL)
        self._reap()

    def preempt(self, node_id: str, *, provider: str | None = None, in_seconds: float = 30) -> None:
        own = self.config.provider
        provider = provider or own
        if provider != own:
            raise LaunchError(
                f"local nodes run as {own}: their agents poll {own} metadata, "
                f"so a {provider} notice would never be read (start the service with "
                f"SKYRESUME_LOCAL_PROVIDER={provider})"
            )
        kind = RECLAIM_KIND[Provider(provider)]
        self.metadata.schedule_notice(node_id, provider, kind.value, in_seconds)

    def signal_pid(self, job_id: str, node_id: str, pid: int, sig: int) -> None:
        """Signal one process of a node, refusing pids that are not in that node's session."""
        if pid not in node_pids(job_id, node_id):
            raise LaunchError(f"pid {pid} is not a process of node {node_id}")
        os.kill(pid, sig)

    def slow_pid(
        self, job_id: str, node_id: str, pid: int, *, duty: float = 0.5, seconds: float = 60.0
    ) -> None:
        """Make one rank a straggler: stopped ``duty`` of every 200 ms for ``seconds``."""
        if not 0 < duty < 1:
            raise ValueError(f"duty must be between 0 and 1, got {duty}")
        self.signal_pid(job_id, node_id, pid, signal.SIGCONT)  # checks the pid belongs

        def cycle() -> None:
            period, end = 0.2, time.monotonic() + seconds
            try:
                while time.monotonic() < end:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(period * duty)
                    os.kill(pid, signal.SIGCONT)
                    time.sleep(period * (1 - duty))
            except ProcessLookupError:
                return
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        threading.Thread(target=cycle, name=f"slow-{pid}", daemon=True).start()

    # --- chaos on the network (netns only): the kernel cuts or slows the node's link ------

    def link_chaos_refusal(self) -> str | None:
        """None when partition and slow-link are real here; else why they are not."""
        if self.config.network != "netns":
            return (
                "partition and slow-link need each node in a network namespace of its own "
                "(root and network namespaces: the local launcher with network=netns); this "
                "service runs its nodes on shared loopback, where cutting one node's link "
                "would cut every node's"
            )
        return None

    def _meta_of_node(self, job_id: str, node_id: str) -> dict[str, Any]:
        """The launch meta holding ``node_id``: its attempt's cluster, or one of the
        attempt's other launches (``-b<rank>``: replacements beside kept nodes)."""
        cluster, sep, _ = node_id.rpartition("-n")
        if not sep:
            return {}
        # A retried launch (``-t<try>``) reuses the node ids: the newest launch wins.
        paths = [self.root / job_id / f"{cluster}.json",
                 *(self.root / job_id).glob(f"{cluster}-*.json")]  # fmt: skip
        for path in sorted(paths, key=_mtime, reverse=True):
            meta = read_json(path)
            if node_id in (meta.get("node_ids") or ()):
                return meta
        return {}

    def _link_host(self, job_id: str, node_id: str) -> tuple[Any, str]:
        """(fabric, host name) of a node, from its cluster's meta file (node order)."""
        refusal = self.link_chaos_refusal()
        if refusal is not None:
            raise LaunchError(refusal)
        meta = self._meta_of_node(job_id, node_id)
        nodes, hosts = list(meta.get("node_ids") or ()), list(meta.get("hosts") or ())
        if node_id not in nodes or len(hosts) != len(nodes):
            raise LaunchError(f"no local node {node_id} for job {job_id}")
        host = hosts[nodes.index(node_id)]
        fabric = self.fabric
        try:
            fabric.host(host)
        except KeyError:
            raise LaunchError(f"node {node_id}'s host {host} is gone (released)") from None
        return fabric, host

    def _link_report(self, fabric: Any, node_id: str, host: str) -> dict[str, Any]:
        h = fabric.host(host)
        shaped = self._tbf_rate(h.veth)
        return {
            "node_id": node_id,
            "host": host,
            "link": h.veth,
            "ip": h.ip,
            "partitioned": fabric.is_partitioned(host),
            "rate": shaped,
        }

    @staticmethod
    def _tbf_rate(dev: str) -> str | None:
        """The tbf rate on ``dev``'s root as tc prints it (``20Mbit``); None: unshaped."""
        p = subprocess.run(
            ["tc", "qdisc", "show", "dev", dev, "root"], capture_output=True, text=True, timeout=10
        )
        words = p.stdout.split()
        return words[words.index("rate") + 1] if "tbf" in words and "rate" in words else None

    def _arm_link_timer(self, host: str, seconds: float | None, undo: Callable[[], None]) -> None:
        """Undo a link fault after ``seconds`` (a timer in the service's process; lost
        on a service restart: the fault then stays until ``chaos heal``). A newer fault
        or a heal on the same host cancels the older timer: it must never undo them."""
        # Created here, not in __init__: the chaos section owns its own state.
        timers: dict[str, threading.Timer] = self.__dict__.setdefault("_link_timers", {})
        with self._lock:
            old = timers.pop(host, None)
            if old is not None:
                old.cancel()
            if seconds is None:
                return

            def fire() -> None:
                with self._lock:
                    if timers.get(host) is not timer:
                        return  # superseded meanwhile
                    del timers[host]
                with contextlib.suppress(Exception):  # the host may be released by now
                    undo()

            timer = threading.Timer(seconds, fire)
            timer.daemon = True
            timer.name = f"heal-{host}"
            timers[host] = timer
            timer.start()

    def partition_node(
        self, job_id: str, node_id: str, *, seconds: float | None = None
    ) -> dict[str, Any]:
        """Take the node's link down: its processes live on and reach nobody (not the
        service, not its peers, not its metadata). ``seconds``: heal after that long."""
        fabric, host = self._link_host(job_id, node_id)
        fabric.partition(host)
        self._arm_link_timer(host, seconds, lambda: fabric.heal(host))
        return {**self._link_report(fabric, node_id, host), "heals_in_s": seconds}

    def slow_link(
        self, job_id: str, node_id: str, rate: str, *, seconds: float | None = None
    ) -> dict[str, Any]:
        """Limit the node's link to ``rate`` both ways (tc tbf); ``"0"`` lifts it.
        ``seconds``: lift it after that long. ValueError for a rate tc would not read."""
        fabric, host = self._link_host(job_id, node_id)
        if rate.strip() == "0":
            fabric.unshape(host)
            self._arm_link_timer(host, None, lambda: None)
            return {**self._link_report(fabric, node_id, host), "heals_in_s": None}
        fabric.shape(host, rate)
        self._arm_link_timer(host, seconds, lambda: fabric.unshape(host))
        return {**self._link_report(fabric, node_id, host), "heals_in_s": seconds}

    def heal_node(self, job_id: str, node_id: str) -> dict[str, Any]:
        """Undo :meth:`partition_node` and :meth:`slow_link` on the node's link."""
        fabric, host = self._link_host(job_id, node_id)
        self._arm_link_timer(host, None, lambda: None)
        fabric.heal(host)
        fabric.unshape(host)
        return {**self._link_report(fabric, node_id, host), "heals_in_s": None}
