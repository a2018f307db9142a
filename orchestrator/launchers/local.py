"""The local launcher: every node is its own process session on this machine.

A node is ``skyresume-agent`` started in a session of its own, with an environment
marker (``SKYRESUME_LOCAL_NODE``) that its torchrun and every rank inherit, so the
node can be found and killed as a whole, the way a cloud takes a VM back. Neither a
pid, a process group, a session nor the process tree would do: torchrun starts each
worker in a session of its own, and workers outlive a SIGKILLed torchrun (DESIGN.md).

Each node has its own directory ``<root>/<job>/<node>/`` with ``disk/`` (its local
disk: the checkpoint tier and anything staged for it) and ``logs/``, and its own
metadata endpoint on one shared :class:`MetadataSimulator` (``/nodes/<node>``),
which the chaos commands flip.

The launcher keeps nothing in memory that it cannot rebuild: pids are in files, so
a restarted service can still see, stop or kill the nodes of a running attempt.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

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
    LaunchRequest,
)

PROVIDERS = ("aws", "gcp", "azure")


def node_id_for(job_id: str, attempt: int, index: int) -> str:
    return f"{job_id}-a{attempt}-n{index}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Every process of a local node carries this variable (the agent, torchrun, each
#: rank inherit it). torchrun puts each worker in a session of its own and orphans
#: outlive a killed parent, so neither the session nor the process tree finds them
#: all; the marker does, like a cgroup would on a real machine.
NODE_MARKER = "SKYRESUME_LOCAL_NODE"


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


def node_pids(job_id: str, node_id: str) -> list[int]:
    return marked_pids({_marker(job_id, node_id): node_id})[node_id]


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


class LocalLauncher:
    """Nodes as process sessions. ``token_for(job_id)`` gives the agent's job token."""

    name = "local"
    abilities = LauncherAbilities(stages_node_disk=True, restarts_in_place=True, chaos=True)

    def __init__(
        self,
        root: Path,
        service_url: str,
        token_for: Callable[[str], str],
        *,
        provider: str = "aws",
        python: str = sys.executable,
        poll_s: float = 1.0,
        heartbeat_s: float = 1.0,
        gpu_memory_gib: float | None = None,
        replacement_gpu_memory_gib: float | None = None,
        regions: tuple[str, ...] = ("local",),
        hosts_per_region: int = 8,
    ) -> None:
        if provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
        self.root = Path(root)
        self.service_url = service_url.rstrip("/")
        self.token_for = token_for
        self.provider = provider
        self.python = python
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.gpu_memory_gib = gpu_memory_gib
        self.replacement_gpu_memory_gib = replacement_gpu_memory_gib
        if not regions or hosts_per_region < 1:
            raise ValueError("the local launcher needs at least one region and one host in each")
        self.regions = tuple(regions)
        self.hosts_per_region = hosts_per_region
        self._sim: MetadataSimulator | None = None
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # --- metadata -------------------------------------------------------------------

    @property
    def metadata(self) -> MetadataSimulator:
        with self._lock:
            if self._sim is None:
                self._sim = MetadataSimulator().start()
            return self._sim

    def close(self) -> None:
        """Stop the metadata simulator (nodes keep running; ``down`` stops them)."""
        with self._lock:
            if self._sim is not None:
                self._sim.stop()
                self._sim = None

    # --- layout ---------------------------------------------------------------------

    def node_dir(self, job_id: str, node_id: str) -> Path:
        return self.root / job_id / node_id

    def node_disk(self, job_id: str, attempt: int, index: int) -> Path:
        """The local disk of a node, which exists before the node starts so that the
        restart protocol can stage a checkpoint onto it."""
        d = self.node_dir(job_id, node_id_for(job_id, attempt, index)) / "disk"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _pid(self, job_id: str, node_id: str) -> int | None:
        try:
            return int((self.node_dir(job_id, node_id) / "agent.pid").read_text())
        except (OSError, ValueError):
            return None

    # --- Launcher protocol ------------------------------------------------------------

    def candidates(self, spec: JobSpec, *, replacement: bool = False) -> list[Candidate]:
        """One offering per local region: process nodes, no price.

        ``gpu_memory_gib`` (first launch) and ``replacement_gpu_memory_gib`` (every
        relaunch) declare a GPU size the nodes pretend to have, so that a replacement
        with less memory exercises the memory planner's replanning on this machine.
        """
        gib = self.replacement_gpu_memory_gib if replacement else self.gpu_memory_gib
        gib = gib if gib is not None else self.gpu_memory_gib
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
            for r in self.regions
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
        if region not in self.regions:
            raise LaunchError(
                f"no local region {region!r}: this service has {', '.join(self.regions)} "
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

    def _hosts_for(self, region: str, count: int, exclude: tuple[str, ...]) -> tuple[str, ...]:
        free = [
            h
            for h in (f"{region}-host{i}" for i in range(self.hosts_per_region))
            if h not in exclude
        ]
        if len(free) < count:
            raise CapacityError(
                f"InsufficientInstanceCapacity: local region {region} has {len(free)} usable "
                f"hosts for {count} nodes (excluded: {', '.join(exclude) or 'none'})"
            )
        return tuple(free[:count])

    def restart(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """A new attempt on the previous attempt's hosts: nothing is provisioned."""
        return self._start(request, previous.hosts or None)

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        return self._start(request, None)

    def _start(self, request: LaunchRequest, hosts: tuple[str, ...] | None) -> LaunchHandle:
        job, attempt = request.job_id, request.attempt
        nodes = request.placement.num_nodes
        cluster = f"{job}-a{attempt}"
        node_ids = tuple(node_id_for(job, attempt, k) for k in range(nodes))
        meta = self.root / job / f"{cluster}.json"
        if meta.exists():
            # Idempotent: a service that restarted mid-launch must not start twins.
            doc = json.loads(meta.read_text())
            return LaunchHandle(
                cluster, self.name, tuple(doc["node_ids"]), tuple(doc.get("hosts", ()))
            )
        if not request.command.strip():
            raise LaunchError("the job has no command to run")
        region = request.placement.region
        if hosts is None:
            if region not in self.regions:
                raise LaunchError(f"no local region {region!r} ({', '.join(self.regions)})")
            if region in self.stocked_out():
                raise CapacityError(
                    f"InsufficientInstanceCapacity: local region {region} has no capacity "
                    f"for {request.placement.instance_type} (skyresume chaos stockout)"
                )
            hosts = self._hosts_for(region, nodes, request.exclude_hosts)
        master_port = free_port()
        user_cmd = shlex.split(request.command)
        token = self.token_for(job)
        for k, node_id in enumerate(node_ids):
            d = self.node_dir(job, node_id)
            (d / "logs").mkdir(parents=True, exist_ok=True)
            disk = self.node_disk(job, attempt, k)
            self.metadata.node(node_id)  # the endpoint answers from boot
            argv = [
                self.python,
                "-m",
                "orchestrator.agent",
                "--service-url", self.service_url,
                "--job-id", job,
                "--attempt", str(attempt),
                "--node-id", node_id,
                "--node-rank", str(k),
                "--nnodes", str(nodes),
                "--nproc-per-node", str(request.ranks_per_node),
                "--master-addr", "127.0.0.1",
                "--master-port", str(master_port),
                "--provider", self.provider,
                "--metadata-url", self.metadata.node_url(node_id),
                "--local-dir", str(disk),
                "--log-dir", str(d / "logs"),
                "--grace-s", str(request.grace_s),
                "--heartbeat-s", str(self.heartbeat_s),
                "--poll-s", str(self.poll_s),
                "--",
                *user_cmd,
            ]  # fmt: skip
            env = {
                **os.environ,
                **{k: v.replace("{node_disk}", str(disk)) for k, v in request.env.items()},
                "SKYRESUME_AGENT_TOKEN": token,
                NODE_MARKER: f"{job}/{node_id}",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            }
            log = open(d / "logs" / "agent.log", "ab")  # noqa: SIM115 - handed to the child
            try:
                proc = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as e:
                raise LaunchError(f"could not start the agent for {node_id}: {e}") from None
            finally:
                log.close()
            (d / "agent.pid").write_text(str(proc.pid))
            with self._lock:
                self._procs[node_id] = proc
        meta.write_text(
            json.dumps(
                {"node_ids": list(node_ids), "master_port": master_port, "hosts": list(hosts)}
            )
        )
        return LaunchHandle(cluster, self.name, node_ids, hosts)

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
        self._reap()

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
        provider = provider or self.provider
        if provider != self.provider:
            raise LaunchError(
                f"local nodes run as {self.provider}: their agents poll {self.provider} metadata, "
                f"so a {provider} notice would never be read (start the service with "
                f"SKYRESUME_LOCAL_PROVIDER={provider})"
            )
        kind = {"aws": "terminate", "gcp": "preempt", "azure": "preempt"}[provider]
        self.metadata.schedule_notice(node_id, provider, kind, in_seconds)

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
