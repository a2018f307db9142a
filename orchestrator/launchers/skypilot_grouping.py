"""How the SkyPilot launcher groups a job's nodes into clusters (issue 19 item 4).

``SKYRESUME_SKYPILOT_GROUPING`` (``Settings.skypilot_grouping``):

- ``attempt``: one SkyPilot cluster per attempt, all its nodes in it, refilled after a
  lost node (:class:`~orchestrator.launchers.skypilot.SkyPilotLauncher`). SkyPilot
  treats those nodes as one unit: one node's failed run cancels the others', a
  relaunch re-runs every node, and a single node cannot be given back.
- ``node``: one single-node cluster per node (:class:`SkyPilotNodeLauncher`), all in
  one region and zone, ranks and the rendezvous address (``SKYRESUME_RUN_NODE_RANK_BASE``,
  ``SKYRESUME_RUN_NNODES``, ``SKYRESUME_RUN_MASTER_ADDR``) set by the service. A
  node's loss touches nothing else: the reconciler's own verbs (``decide()``:
  ``JOIN_SURVIVORS`` with the lost node released, never a refill) down only the lost
  node's cluster, restart the survivors where they are (``sky.exec``), and launch one
  new single-node cluster beside them.

Which one is the default, and the figures it was chosen by: docs/skypilot-grouping.md
(bench/skypilot_grouping.py measures both on the emulated AWS).

A launch handle of the node grouping stands for several clusters. Its ``request_id``
holds them as JSON, ``[[node id, cluster, request id], ...]`` in node order (opaque to
the rest of the service, which stores and hands it back); its ``cluster_name`` names
the first cluster and how many more (``sr-job-a1-n0+1``: display only). A handle the
reconciler cut down to some of its nodes (the kept ones for a restart, the lost ones
for a release) still carries every entry, and the node ids pick them.

A fresh launch of N nodes knows no rendezvous address: node 0's cluster is launched
first, and the others once its request succeeded and its internal IP is known
(:meth:`SkyPilotNodeLauncher.progress` submits them, keyed per cluster like any
launch). Those later submissions need the launch request, which lives in this
process: a service that restarts before they went out finds node 0's request
(adopted) and reports the launch FAILED, which the reconciler answers with a new try
(node 0's cluster is given back with the rest). A launch beside survivors (a join)
is told the address and submits every node at once.

The zone: a node launched beside another is pinned to that node's zone (read from
its launch result or its cluster record); the shared security group is SkyPilot's
``aws.security_group_name`` in the API server's config (docs/skypilot-grouping.md).

:class:`CountingSDK` counts every SkyPilot SDK call the launcher makes, one JSON line
per call in ``SKYRESUME_SKYPILOT_CALL_LOG`` when set (what the benchmark reads).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.contract import Env
from orchestrator.domain.reconcile import LauncherAbilities, LaunchPhase, LaunchProgress
from orchestrator.launchers.base import (
    ClusterState,
    ClusterStatus,
    DownResult,
    LaunchError,
    LaunchHandle,
    LaunchRequest,
)
from orchestrator.launchers.skypilot import (
    _CLUSTER_NAME_MAX,
    SkyPilotLauncher,
    _field,
    status_from_records,
)

GROUPINGS = ("attempt", "node")
DEFAULT_GROUPING = "attempt"
CALL_LOG_ENV = "SKYRESUME_SKYPILOT_CALL_LOG"


def node_cluster_name(job_id: str, attempt: int, launch_try: int, rank: int) -> str:
    """``sr-<job>-a<attempt>[-t<try>]-n<rank>``: the single-node cluster of one node
    (lower case, letters first, under 35 characters, like ``cluster_name_for``)."""
    base = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-") or "job"
    suffix = f"-a{attempt}" + (f"-t{launch_try}" if launch_try else "") + f"-n{rank}"
    return ("sr-" + base)[: _CLUSTER_NAME_MAX - len(suffix)].rstrip("-") + suffix


Entry = tuple[str, str, str]
"""(node id, cluster, request id): one node of a handle, request id "" before it was
submitted (a peer waiting for the rendezvous node)."""


def encode(entries: list[Entry]) -> str:
    return json.dumps([list(e) for e in entries])


def decode(handle: LaunchHandle) -> list[Entry]:
    """The entries of ``handle`` for its node ids (every entry when it names none).
    A handle of the attempt grouping (one cluster, a plain request id) is one entry
    per node id, all on its cluster."""
    try:
        raw = json.loads(handle.request_id) if handle.request_id.startswith("[") else None
    except ValueError:
        raw = None
    if not isinstance(raw, list):
        ids = handle.node_ids or ("",)
        return [(n, handle.cluster_name, handle.request_id) for n in ids]
    entries = [
        (str(e[0]), str(e[1]), str(e[2])) for e in raw if isinstance(e, list) and len(e) == 3
    ]
    if not handle.node_ids:
        return entries
    wanted = set(handle.node_ids)
    return [e for e in entries if e[0] in wanted]


def display_name(entries: list[Entry]) -> str:
    if not entries:
        return ""
    return entries[0][1] + (f"+{len(entries) - 1}" if len(entries) > 1 else "")


def group_handle(name: str, entries: list[Entry], hosts: tuple[str, ...] = ()) -> LaunchHandle:
    return LaunchHandle(
        display_name(entries), name, tuple(e[0] for e in entries), hosts, encode(entries)
    )


def _internal_ips(result: Any) -> tuple[str, ...]:
    """Internal IPs (head first) of a finished launch's result ``(job id, handle)``."""
    handle = result[1] if isinstance(result, (tuple, list)) and len(result) == 2 else result
    pairs = getattr(handle, "stable_internal_external_ips", None) or ()
    return tuple(str(pair[0]) for pair in map(tuple, pairs) if pair and pair[0])


def _zone_of(handle: Any) -> str | None:
    res = getattr(handle, "launched_resources", None)
    zone = getattr(res, "zone", None)
    return str(zone) if zone else None


class CountingSDK:
    """``sky`` with every call counted: ``counts`` by name, and one JSON line
    (``{"t": unix time, "call": "sky.launch"}``) appended to ``log_path`` per call."""

    def __init__(self, sdk: Any = None, log_path: Path | str | None = None) -> None:
        self._sdk = sdk
        self.log_path = Path(log_path) if log_path else None
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def _real(self) -> Any:
        if self._sdk is None:
            import sky

            self._sdk = sky
        return self._sdk

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real(), name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def counted(*args: Any, **kw: Any) -> Any:
            self._count(f"sky.{name}")
            return attr(*args, **kw)

        return counted

    def _count(self, call: str) -> None:
        with self._lock:
            self.counts[call] = self.counts.get(call, 0) + 1
            if self.log_path is not None:
                with self.log_path.open("a") as f:
                    f.write(json.dumps({"t": time.time(), "call": call}) + "\n")


def read_call_log(
    path: Path | str, since: float = 0.0, until: float | None = None
) -> dict[str, int]:
    """The calls a :class:`CountingSDK` logged in ``[since, until)``, by name."""
    out: dict[str, int] = {}
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        t = float(rec.get("t", 0))
        if t >= since and (until is None or t < until):
            out[str(rec["call"])] = out.get(str(rec["call"]), 0) + 1
    return out


class SkyPilotNodeLauncher(SkyPilotLauncher):
    """The SkyPilot launcher with one single-node cluster per node (the module
    docstring). It declares what that allows: survivors are kept beside replacements
    and a single node is given back (its cluster downed); a cluster is never refilled."""

    abilities = LauncherAbilities(
        restarts_in_place=True,
        keeps_survivors=True,
        releases_single_nodes=True,
        refills_clusters=False,
        confirms_down=True,
    )
    grouping = "node"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        #: cluster -> the request a peer's launch waits to submit (this process only).
        self._deferred: dict[str, LaunchRequest] = {}
        #: cluster -> its launch request id, once submitted here (or adopted).
        self._submitted: dict[str, str] = {}
        #: internal IP -> zone of a node whose launch result this process read.
        self._zones: dict[str, str] = {}

    # --- naming --------------------------------------------------------------

    def cluster_for(self, request: LaunchRequest) -> str:
        return node_cluster_name(
            request.job_id, request.attempt, request.launch_try, request.node_rank_base
        )

    def _node_request(
        self, request: LaunchRequest, index: int, master: str | None, zone: str | None
    ) -> LaunchRequest:
        """Node ``index`` of ``request`` as a single-node request of its own: rank
        ``node_rank_base + index`` of ``num_nodes`` (the group's size), rendezvous at
        ``master`` (None: this node is the rendezvous)."""
        base = request.node_rank_base + index
        nnodes = request.env.get(Env.NNODES) or str(request.placement.num_nodes)
        env = {**request.env, Env.NODE_RANK_BASE: str(base), Env.NNODES: nnodes}
        if master:
            env[Env.MASTER_ADDR] = master
        else:
            env.pop(Env.MASTER_ADDR, None)
        placement = replace(request.placement, num_nodes=1, zone=zone or request.placement.zone)
        return replace(request, placement=placement, env=env, node_rank_base=base)

    @staticmethod
    def _node_id(request: LaunchRequest, index: int) -> str:
        return f"{request.job_id}-a{request.attempt}-n{request.node_rank_base + index}"

    # --- the Launcher protocol ---------------------------------------------------

    def launch(self, request: LaunchRequest, task: Any = None) -> LaunchHandle:
        """One single-node cluster per node. Told the rendezvous (a join beside
        survivors): every node is submitted now, pinned to the rendezvous node's zone
        where it is known. Not told (a fresh launch): node 0 now, the others from
        :meth:`progress` once node 0's internal IP is known."""
        n = request.placement.num_nodes
        master = request.env.get(Env.MASTER_ADDR) or None
        zone = request.placement.zone or (self._zone_of_ip(master) if master else None)
        entries: list[Entry] = []
        for i in range(n):
            sub = self._node_request(request, i, master, zone)
            cluster = self.cluster_for(sub)
            node = self._node_id(request, i)
            if master is None and i > 0:
                self._deferred[cluster] = sub
                entries.append((node, cluster, self._submitted.get(cluster, "")))
                continue
            h = super().launch(sub, task)
            self._submitted[cluster] = h.request_id
            entries.append((node, cluster, h.request_id))
        return group_handle(self.name, entries)

    def restart(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """``sky.exec`` of the new attempt on each node's own cluster (its old job
        cancelled first): node ``i`` of ``previous`` becomes rank
        ``node_rank_base + i``; the rendezvous is the one the request names, else the
        first node's address."""
        old = decode(previous)
        told = request.env.get(Env.MASTER_ADDR) or None
        first = previous.hosts[0] if previous.hosts else None
        entries: list[Entry] = []
        for i, (node, cluster, _rid) in enumerate(old):
            # Told (a join): everyone meets there. Not told: node 0 is the rendezvous.
            master = told or (first if i else None)
            sub = self._node_request(request, i, master, None)
            host = previous.hosts[i] if i < len(previous.hosts) else ""
            prev = LaunchHandle(cluster, self.name, (node,), (host,) if host else ())
            h = SkyPilotLauncher.restart(self, prev, sub)
            entries.append((self._node_id(request, i), cluster, h.request_id))
        return group_handle(self.name, entries, previous.hosts)

    def refill(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        raise LaunchError("the node grouping never refills a cluster (refills_clusters is off)")

    def progress(self, handle: LaunchHandle) -> LaunchProgress:
        """Every node's request as one (up when all are, failed when one is), hosts in
        node order; a peer waiting for the rendezvous node is submitted once that
        node's launch succeeded. Never raises."""
        try:
            return self._group_progress(handle)
        except (Exception, SystemExit) as e:  # a provider that cannot be read is not dead
            return LaunchProgress(LaunchPhase.UNKNOWN, f"SkyPilot: {type(e).__name__}: {e}")

    def _group_progress(self, handle: LaunchHandle) -> LaunchProgress:
        entries = decode(handle)
        views: list[LaunchProgress] = []
        master: str | None = None
        for i, (node, cluster, rid) in enumerate(entries):
            rid = rid or self._submitted.get(cluster, "")
            if not rid:
                if master is None:
                    views.append(
                        LaunchProgress(
                            LaunchPhase.PROVISIONING, f"{cluster}: waiting for the rendezvous node"
                        )
                    )
                    continue
                rid = self._submit_peer(cluster, master)
                if not rid:
                    views.append(
                        LaunchProgress(
                            LaunchPhase.FAILED,
                            f"{cluster} was never submitted: the service restarted before "
                            "the rendezvous node was up (a new try launches the group again)",
                        )
                    )
                    continue
            one = LaunchHandle(cluster, self.name, (node,), request_id=rid)
            p = SkyPilotLauncher.progress(self, one)
            if p.phase is LaunchPhase.UP or rid in self._results:
                # The internal IP: peers reach each other inside the VPC. Known once the
                # launch request succeeded, whatever its job's status read says (a
                # slow API server answers job_status late: the peers need not wait).
                ip = self._master_of(rid, p)
                if p.phase is LaunchPhase.UP:
                    p = replace(p, hosts=(ip,) if ip else p.hosts[:1])
                if i == 0:
                    master = ip
            views.append(p)
        failed = next((v for v in views if v.phase is LaunchPhase.FAILED), None)
        if failed is not None:
            return failed
        if views and all(v.phase is LaunchPhase.UP for v in views):
            return LaunchProgress(
                LaunchPhase.UP, f"{len(views)} single-node clusters up",
                hosts=tuple(h for v in views for h in v.hosts),
            )  # fmt: skip
        waiting = [v for v in views if v.phase is not LaunchPhase.UP]
        return waiting[0] if waiting else LaunchProgress(LaunchPhase.UNKNOWN, "no node")

    def _master_of(self, rid: str, p: LaunchProgress) -> str | None:
        result = self._results.get(rid)
        ips = _internal_ips(result) if result is not None else ()
        if ips and result is not None:
            zone = _zone_of(result[1] if isinstance(result, (tuple, list)) else result)
            if zone:
                self._zones[ips[0]] = zone
        return ips[0] if ips else (p.hosts[0] if p.hosts else None)

    def _submit_peer(self, cluster: str, master: str) -> str:
        """Submit the launch of a peer that waited for the rendezvous node (or adopt
        the request SkyPilot already holds for its cluster); "" when this process
        never had its request (a restart: the launch is then failed)."""
        earlier = self._earlier_request(cluster, "sky.launch", task_name=None)
        if earlier:
            self._submitted[cluster] = earlier
            return earlier
        sub = self._deferred.get(cluster)
        if sub is None:
            return ""
        zone = sub.placement.zone or self._zones.get(master)
        env = {**sub.env, Env.MASTER_ADDR: master}
        sub = replace(sub, env=env, placement=replace(sub.placement, zone=zone))
        h = SkyPilotLauncher.launch(self, sub)
        self._submitted[cluster] = h.request_id
        self._deferred.pop(cluster, None)
        return h.request_id

    def _zone_of_ip(self, ip: str) -> str | None:
        if ip in self._zones:
            return self._zones[ip]
        records, _ = self._cluster_records()
        for rec in (records or {}).values():
            handle = _field(rec, "handle")
            pairs = map(tuple, getattr(handle, "stable_internal_external_ips", None) or ())
            if any(ip in (str(x) for x in pair) for pair in pairs):
                zone = _zone_of(handle)
                if zone:
                    self._zones[ip] = zone
                return zone
        return None

    def status(self, handle: LaunchHandle) -> ClusterStatus:
        """UP when every node's cluster is UP; otherwise UNKNOWN naming the nodes that
        are (a cluster INIT or not listed says nothing about its node)."""
        records, error = self._cluster_records()
        if records is None:
            return ClusterStatus(ClusterState.UNKNOWN, detail=f"sky.status: {error}")
        up: list[str] = []
        details = []
        for node, cluster, _rid in decode(handle):
            st = status_from_records(
                LaunchHandle(cluster, self.name, (node,)), list(records.values())
            )
            if st.state is ClusterState.UP:
                up.append(node)
            else:
                details.append(f"{cluster}: {st.detail}")
        if details:
            return ClusterStatus(ClusterState.UNKNOWN, tuple(up), "; ".join(details))
        return ClusterStatus(ClusterState.UP, tuple(up), "UP")

    def down(self, handle: LaunchHandle) -> None:
        """``down`` of each node's cluster the handle names (the lost ones only, for a
        release); a peer never submitted (and not held by SkyPilot) has nothing to
        give back. LaunchError naming every cluster that could not be asked."""
        errors = []
        for node, cluster, rid in decode(handle):
            self._deferred.pop(cluster, None)
            if not (rid or self._submitted.get(cluster)) and not self._known(cluster):
                continue
            try:
                SkyPilotLauncher.down(self, LaunchHandle(cluster, self.name, (node,)))
            except LaunchError as e:
                errors.append(str(e))
        if errors:
            raise LaunchError("; ".join(errors))

    def _known(self, cluster: str) -> bool:
        records, _ = self._cluster_records()
        if records is None or cluster in records:
            return True
        try:
            return bool(self._earlier_request(cluster, "sky.launch", task_name=None))
        except LaunchError:
            return True

    def confirm_down(self, handle: LaunchHandle) -> DownResult:
        left = []
        for node, cluster, _rid in decode(handle):
            found = SkyPilotLauncher.confirm_down(self, LaunchHandle(cluster, self.name, (node,)))
            if not found.gone:
                left.append(found.detail)
        if left:
            return DownResult(False, "; ".join(left))
        return DownResult(True, f"{display_name(decode(handle))} gone")


def launcher_for(settings: Any, **kw: Any) -> SkyPilotLauncher:
    """The SkyPilot launcher of ``settings.skypilot_grouping`` (``attempt`` or
    ``node``), its SDK calls counted into ``$SKYRESUME_SKYPILOT_CALL_LOG`` when set."""
    grouping = str(getattr(settings, "skypilot_grouping", "") or DEFAULT_GROUPING)
    if grouping not in GROUPINGS:
        raise ValueError(
            f"skypilot_grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}"
        )
    log = os.environ.get(CALL_LOG_ENV)
    if log and "sdk" not in kw:
        kw["sdk"] = CountingSDK(log_path=log)
    cls = SkyPilotNodeLauncher if grouping == "node" else SkyPilotLauncher
    return cls(settings, **kw)
