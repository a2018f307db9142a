"""The network fabric that makes every local node a host of its own.

Each node is a network namespace joined to one bridge by a veth pair:

    host (default ns)                          node namespace ``sr-<bridge>-<i>``
    bridge <bridge>  gateway, e.g. 10.213.0.1   eth0  <subnet>.<i+2>, default via gateway
      └─ <bridge>v<i>  ── veth ──────────────── lo    127.0.0.1, 169.254.169.254/32

The service, the S3 server and the shared metadata simulator listen on the gateway
address; nodes reach one another over the bridge. Inside each namespace the
metadata address 169.254.169.254 sits on ``lo`` and a small front
(``python -m orchestrator.cloud.simulator front``) listens there, forwarding to the
shared simulator's ``/nodes/<node>`` URL, and ``/etc/netns/<ns>/hosts`` (which
``ip netns exec`` bind-mounts over ``/etc/hosts``) names ``metadata.google.internal``:
an agent inside uses the providers' real default URLs unchanged.

Chaos is done by the kernel, not by pretending: :meth:`Fabric.partition` takes the
node's link down (its processes live on and reach nobody, the metadata front's
upstream included, so a partitioned node's pollers read *unknown*, never *none*);
:meth:`Fabric.shape` puts a ``tbf`` qdisc on both ends of the link. This kernel has
``tbf`` and ``htb`` but no ``netem``/``fq``/``sfq``/``fq_codel``/``prio``: a slow link,
no added latency or loss.

Ownership and state. Everything a fabric creates carries its bridge's name
(namespaces ``sr-<bridge>-<i>``, host-side veths ``<bridge>v<i>``), so cleaning up
after a crashed run can never touch a namespace or link that is not this fabric's.
IP allocation lives in ``<state_dir>/fabric.json``, written under an ``flock`` and
replaced atomically: a restarted service finds its hosts again and never hands an IP
out twice. Interface names are derived from the host's index, never its node name,
because the kernel caps them at 15 characters.

Every method that changes the kernel is idempotent: calling it again after a crash
half-way through completes the work instead of failing on what already exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Every namespace a fabric owns starts with this; nothing else is ever deleted.
NS_PREFIX = "sr-"
#: The link-local metadata address the providers' agents use by default.
METADATA_IP = "169.254.169.254"
#: The interface name inside every namespace (what GLOO_SOCKET_IFNAME names).
NODE_IFNAME = "eth0"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
#: Bridge names leave room for ``v`` plus a five-digit index within IFNAMSIZ (15).
_BRIDGE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,8}$")
_RATE_UNITS = {
    "bit": 1,
    "kbit": 1_000,
    "mbit": 1_000_000,
    "gbit": 1_000_000_000,
    "bps": 8,
    "kbps": 8_000,
    "mbps": 8_000_000,
    "gbps": 8_000_000_000,
}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(" + "|".join(_RATE_UNITS) + r")$")
_STATE_FILE = "fabric.json"


class FabricError(RuntimeError):
    """A kernel operation failed; the message carries the command and its stderr."""


@dataclass(frozen=True)
class Host:
    """One node's network identity."""

    name: str
    """The node's name (its hostname inside the namespace)."""
    index: int
    """Allocation slot; the IP and both interface names derive from it."""
    netns: str
    """Namespace name, ``sr-<bridge>-<index>``."""
    ip: str
    """The node's address on the bridge."""
    ifname: str
    """The interface inside the namespace (``eth0``): set GLOO_SOCKET_IFNAME to it."""
    veth: str
    """The peer on the host side, enslaved to the bridge; partition and shape act on it."""


def parse_rate(rate: str) -> int:
    """A tc rate such as ``20mbit`` or ``2mbps``, in bits per second.

    Refused (ValueError naming it) unless it is a positive number with one of tc's
    units: a typo (``20m``, ``20 mbits``) must be an error, never a link of some
    other speed than the one the caller meant.
    """
    m = _RATE_RE.match(rate.strip().lower()) if isinstance(rate, str) else None
    bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2)]) if m else 0
    if bits <= 0:
        units = ", ".join(_RATE_UNITS)
        raise ValueError(f"rate {rate!r} is not a positive tc rate like '20mbit' (units: {units})")
    return bits


def bridge_mac(gateway: str) -> str:
    """A fixed, locally administered MAC for a bridge whose address is ``gateway``.

    A Linux bridge otherwise takes its lowest port's MAC, so it changes when a node's
    veth comes or goes, and every other node's ARP entry for the gateway points at a
    MAC nobody answers for ~30 s (measured: a kept node's setup timed out twice
    reaching the service after a replacement joined; on the emulated AWS, an instance
    terminated cut its peers off from the service for as long)."""
    packed = ipaddress.IPv4Address(gateway).packed
    return "02:53:52:" + ":".join(f"{b:02x}" for b in packed[1:])


def _run(
    *cmd: str, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=30)
    if check and p.returncode != 0:
        raise FabricError(f"`{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _link_exists(dev: str, netns: str | None = None) -> bool:
    ns = ["-n", netns] if netns else []
    return _run("ip", *ns, "link", "show", "dev", dev, check=False).returncode == 0


def _namespaces() -> set[str]:
    out = _run("ip", "netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _is_front(pid: int) -> bool:
    """Whether ``pid`` is a metadata front (pids are reused: never kill a stranger)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"orchestrator.cloud.simulator" in argv and b"front" in argv


class Fabric:
    """Namespaces on one bridge, with their IPs persisted in ``state_dir``."""

    def __init__(
        self, state_dir: Path, *, bridge: str = "srbr0", subnet: str = "10.213.0.0/16"
    ) -> None:
        if not _BRIDGE_RE.match(bridge):
            raise ValueError(
                f"bridge {bridge!r} must be a letter then up to 8 letters or digits "
                "(its veths are named <bridge>v<index> within the kernel's 15 characters)"
            )
        net = ipaddress.ip_network(subnet, strict=True)
        if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 29:
            raise ValueError(f"subnet {subnet!r} must be an IPv4 network of /29 or larger")
        self.state_dir = Path(state_dir)
        self.bridge = bridge
        self.subnet = net
        self._ns_prefix = f"{NS_PREFIX}{bridge}-"
        # Children this process started (metadata fronts), kept so they are reaped.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # --- environment ----------------------------------------------------------------

    @staticmethod
    def unavailable_reason() -> str | None:
        """None when namespaces, veths and a bridge can be made here; else why not.

        The caller falls back to shared loopback and says so out loud: nodes that
        silently share one host would make partition and per-node metadata lies.
        """
        if os.geteuid() != 0:
            return "network namespaces need root (this process is not root)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"`{tool}` (iproute2) is not installed"
        if _run("ip", "netns", "list", check=False).returncode != 0:
            return "`ip netns list` fails: this kernel or container has no network namespaces"
        probe = f"srprobe{os.getpid() % 100_000}"
        for kind, extra in (("bridge", ()), ("veth", ("peer", "name", probe + "p"))):
            p = _run("ip", "link", "add", probe, "type", kind, *extra, check=False)
            if p.returncode != 0:
                return f"cannot make a {kind} here: {p.stderr.strip()}"
            _run("ip", "link", "del", probe, check=False)
        return None

    @property
    def gateway(self) -> str:
        """The host's address on the bridge: where nodes reach the service, S3, metadata."""
        return str(self.subnet.network_address + 1)

    @property
    def prefixlen(self) -> int:
        return self.subnet.prefixlen

    # --- state ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The state, read and written under an exclusive lock (service and CLI may race)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "fabric.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self._read()
            before = json.dumps(state, sort_keys=True)
            yield state
            if json.dumps(state, sort_keys=True) != before:
                tmp = self.state_dir / f".{_STATE_FILE}.tmp"
                tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
                os.replace(tmp, self.state_dir / _STATE_FILE)

    def _read(self) -> dict[str, Any]:
        path = self.state_dir / _STATE_FILE
        if not path.exists():
            return {"bridge": self.bridge, "subnet": str(self.subnet), "hosts": {}}
        state: dict[str, Any] = json.loads(path.read_text())
        if (state.get("bridge"), state.get("subnet")) != (self.bridge, str(self.subnet)):
            # One state dir, one fabric: reading another's IPs would hand them out twice.
            raise ValueError(
                f"{path} belongs to bridge {state.get('bridge')!r} subnet "
                f"{state.get('subnet')!r}, not {self.bridge!r} {str(self.subnet)!r}"
            )
        return state

    def _host(self, name: str, rec: dict[str, Any]) -> Host:
        i = int(rec["index"])
        return Host(
            name=name,
            index=i,
            netns=f"{self._ns_prefix}{i}",
            ip=str(self.subnet.network_address + 2 + i),
            ifname=NODE_IFNAME,
            veth=f"{self.bridge}v{i}",
        )

    def hosts(self) -> list[Host]:
        """Every host this fabric has allocated, in index order.

        Read from state, not the kernel: a host whose namespace is gone (the machine
        rebooted) is still listed, and :meth:`add_host` makes it again, same IP.
        """
        with self._locked() as state:
            found = [self._host(n, r) for n, r in state["hosts"].items()]
        return sorted(found, key=lambda h: h.index)

    def host(self, name: str) -> Host:
        """The host allocated to ``name`` (KeyError if none)."""
        with self._locked() as state:
            if name not in state["hosts"]:
                raise KeyError(f"no host {name!r} in fabric {self.bridge}")
            return self._host(name, state["hosts"][name])

    def _resolve(self, host: Host | str) -> Host:
        return host if isinstance(host, Host) else self.host(host)

    # --- the bridge -----------------------------------------------------------------

    def up(self) -> None:
        """Make the bridge exist with the gateway address, link up; clear stale leftovers.

        Leftovers are namespaces named like this fabric's that state does not know
        (a crash between ``ip netns add`` and the state write) and veths on this
        bridge whose host is gone; nothing outside this fabric's names is touched.
        """
        gw = f"{self.gateway}/{self.prefixlen}"
        # Checked before anything is made: two links on one subnet would route a
        # node's packets out of the wrong one, and the failure would look like chaos.
        for dev, addr in self._addresses():
            if dev != self.bridge and addr.network.overlaps(self.subnet):
                raise FabricError(
                    f"subnet {self.subnet} overlaps {addr} on {dev} (another fabric or a "
                    f"real network): pick another subnet for bridge {self.bridge}"
                )
        if not _link_exists(self.bridge):
            mac = bridge_mac(self.gateway)
            _run("ip", "link", "add", self.bridge, "address", mac, "type", "bridge")
        if (self.bridge, ipaddress.ip_interface(gw)) not in self._addresses():
            _run("ip", "addr", "replace", gw, "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        with self._locked() as state:
            known = {self._host(n, r).netns for n, r in state["hosts"].items()}
            veths = {self._host(n, r).veth for n, r in state["hosts"].items()}
            for ns in _namespaces():
                if ns.startswith(self._ns_prefix) and ns not in known:
                    self._delete_namespace(ns)
            for dev in self._bridge_ports():
                if dev not in veths and re.fullmatch(rf"{self.bridge}v\d+", dev):
                    _run("ip", "link", "del", dev, check=False)

    @staticmethod
    def _addresses() -> list[tuple[str, ipaddress.IPv4Interface]]:
        """Every IPv4 address on the host's links, with its link's name."""
        out = []
        for link in json.loads(_run("ip", "-j", "-4", "addr", "show").stdout or "[]"):
            for a in link.get("addr_info", []):
                iface = ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}")
                out.append((str(link["ifname"]), iface))
        return out

    def _bridge_ports(self) -> list[str]:
        p = _run("ip", "-j", "link", "show", "master", self.bridge, check=False)
        if p.returncode != 0 or not p.stdout.strip():
            return []
        return [str(link["ifname"]) for link in json.loads(p.stdout)]

    # --- hosts ----------------------------------------------------------------------

    def add_host(self, name: str) -> Host:
        """The host for node ``name``, made (or repaired) if needed; same IP every time.

        Repairing an existing host never changes its link state: a partitioned node
        stays partitioned when a restarted service calls this again.
        """
        if not _NAME_RE.match(name):
            raise ValueError(f"node name {name!r} must be letters, digits, '.', '_' or '-'")
        with self._locked() as state:
            recs = state["hosts"]
            if name not in recs:
                used = {int(r["index"]) for r in recs.values()}
                free = next(i for i in range(len(used) + 1) if i not in used)
                if free + 2 >= self.subnet.num_addresses - 1:
                    raise FabricError(f"subnet {self.subnet} is full ({len(used)} hosts)")
                recs[name] = {"index": free}
            host = self._host(name, recs[name])
            self._make(host)
        return host

    def _make(self, h: Host) -> None:
        if h.netns not in _namespaces():
            _run("ip", "netns", "add", h.netns)
        created = False
        if not _link_exists(h.veth):
            if _link_exists(h.ifname, h.netns):  # a stale half of some earlier pair
                _run("ip", "-n", h.netns, "link", "del", h.ifname)
            _run("ip", "link", "add", h.veth, "type", "veth", "peer", "name", h.ifname,
                 "netns", h.netns)  # fmt: skip
            created = True
        _run("ip", "link", "set", h.veth, "master", self.bridge)
        if created:
            _run("ip", "link", "set", h.veth, "up")
        _run(
            "ip", "-n", h.netns, "-batch", "-",
            input="\n".join([
                "link set lo up",
                f"addr replace {METADATA_IP}/32 dev lo",
                f"addr replace {h.ip}/{self.prefixlen} dev {h.ifname}",
                f"link set {h.ifname} up",
                f"route replace default via {self.gateway} dev {h.ifname}",
            ]) + "\n",
        )  # fmt: skip
        etc = Path("/etc/netns") / h.netns
        etc.mkdir(parents=True, exist_ok=True)
        # The machine's hostname (shared: no UTS namespace) names this node's own IP,
        # and there is no DNS server: without both, torchrun's getfqdn() and gloo's
        # hostname lookups wait out resolver timeouts (measured: ~20 s per torchrun).
        (etc / "resolv.conf").write_text(
            "# no DNS on the nodes' bridge\noptions timeout:1 attempts:1\n"
        )
        (etc / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n{h.ip}\t{h.name} {socket.gethostname()}\n"
            f"{METADATA_IP}\tmetadata.google.internal\n"
        )

    def remove_host(self, name: str) -> None:
        """End node ``name``: its metadata front and every process inside, then its ns.

        Like a terminated VM: what ran inside dies with it. No-op for an unknown name.
        """
        with self._locked() as state:
            rec = state["hosts"].get(name)
            if rec is None:
                return
            h = self._host(name, rec)
            self._stop_front(rec)
            self._delete_namespace(h.netns)
            if _link_exists(h.veth):  # a process stuck inside keeps the pair alive
                _run("ip", "link", "del", h.veth, check=False)
            del state["hosts"][name]

    def _delete_namespace(self, ns: str) -> None:
        if not ns.startswith(self._ns_prefix):  # never anyone else's
            raise FabricError(f"refusing to delete namespace {ns!r}: not this fabric's")
        if ns in _namespaces():
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            for pid in pids:
                self._reap(int(pid))
            _run("ip", "netns", "del", ns, check=False)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    def teardown(self) -> None:
        """Remove every host of this fabric, its leftovers, the bridge and the state."""
        for h in self.hosts():
            self.remove_host(h.name)
        for ns in _namespaces():
            if ns.startswith(self._ns_prefix):
                self._delete_namespace(ns)
        for dev in self._bridge_ports():
            if re.fullmatch(rf"{self.bridge}v\d+", dev):
                _run("ip", "link", "del", dev, check=False)
        if _link_exists(self.bridge):
            _run("ip", "link", "del", self.bridge)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / _STATE_FILE).unlink()

    def exec_prefix(self, host: Host | str) -> list[str]:
        """Prepend to a command to run it on the node (``ip netns exec NS``)."""
        return ["ip", "netns", "exec", self._resolve(host).netns]

    # --- chaos ----------------------------------------------------------------------

    def partition(self, name: str) -> None:
        """Cut the node off: its link goes down, its processes live on and reach nobody."""
        _run("ip", "link", "set", self.host(name).veth, "down")

    def heal(self, name: str) -> None:
        """Undo :meth:`partition`."""
        _run("ip", "link", "set", self.host(name).veth, "up")

    def is_partitioned(self, name: str) -> bool:
        flags = Path(f"/sys/class/net/{self.host(name).veth}/flags").read_text()
        return not int(flags, 16) & 0x1  # IFF_UP

    def shape(self, name: str, rate: str) -> None:
        """Limit the node's link to ``rate`` (tc syntax, e.g. ``20mbit``) both ways.

        A token bucket on each end: the host-side veth's egress is traffic *to* the
        node, the node's ``eth0`` egress is traffic *from* it.
        """
        bits = parse_rate(rate)
        # 10 ms worth of tokens, at least two full frames: a bucket smaller than one
        # frame drops every packet instead of slowing them, and a bigger one lets a
        # short transfer run faster than the rate (50 ms read 25% over at 80mbit).
        burst = max(bits // 8 // 100, 3_028)
        h = self.host(name)
        tbf = ("root", "tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "100ms")
        _run("tc", "qdisc", "replace", "dev", h.veth, *tbf)
        _run("tc", "-n", h.netns, "qdisc", "replace", "dev", h.ifname, *tbf)

    def unshape(self, name: str) -> None:
        """Remove :meth:`shape`'s limits (no-op when unshaped)."""
        h = self.host(name)
        for ns, dev in ((None, h.veth), (h.netns, h.ifname)):
            nsarg = ["-n", ns] if ns else []
            shown = _run("tc", *nsarg, "qdisc", "show", "dev", dev, "root").stdout
            if "tbf" in shown:
                _run("tc", *nsarg, "qdisc", "del", "dev", dev, "root")

    # --- metadata -------------------------------------------------------------------

    def start_metadata(
        self,
        host: Host | str,
        upstream_url: str,
        python: str = sys.executable,
        *,
        ready_timeout_s: float = 15.0,
    ) -> int:
        """Start the node's metadata front at 169.254.169.254:80; its pid.

        ``upstream_url`` is the shared simulator's ``/nodes/<node>`` URL on the
        gateway. Returns once the front is listening. Idempotent: a front already
        serving the same upstream is kept; one serving another is replaced.
        """
        h = self._resolve(host)
        with self._locked() as state:
            rec = state["hosts"][h.name]
            pid = rec.get("metadata_pid")
            if pid and _is_front(pid) and rec.get("metadata_upstream") == upstream_url:
                return int(pid)
            self._stop_front(rec)
            log_dir = self.state_dir / "hosts" / h.name
            log_dir.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ)
            # The front imports orchestrator: find it even from a python without it.
            root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            cmd = [*self.exec_prefix(h), python, "-m", "orchestrator.cloud.simulator", "front",
                   "--listen", f"{METADATA_IP}:80", "--upstream", upstream_url]  # fmt: skip
            with open(log_dir / "metadata.log", "ab") as log:
                proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env,
                    start_new_session=True,  # a ^C to the service must not kill the nodes' fronts
                )  # fmt: skip
            self._children[proc.pid] = proc
            assert proc.stdout is not None
            # The front prints one line once bound; nothing else ever goes to stdout.
            ready, _, _ = select.select([proc.stdout], [], [], ready_timeout_s)
            line = proc.stdout.readline() if ready else b""
            proc.stdout.close()
            if not line:
                proc.kill()
                self._reap(proc.pid)
                tail = (log_dir / "metadata.log").read_text(errors="replace")[-2000:]
                raise FabricError(f"metadata front for {h.name} did not start:\n{tail}")
            rec["metadata_pid"], rec["metadata_upstream"] = proc.pid, upstream_url
            return proc.pid

    def stop_metadata(self, host: Host | str) -> None:
        """Stop the node's metadata front (no-op when none runs)."""
        h = self._resolve(host)
        with self._locked() as state:
            self._stop_front(state["hosts"][h.name])

    def _stop_front(self, rec: dict[str, Any]) -> None:
        pid = rec.pop("metadata_pid", None)
        rec.pop("metadata_upstream", None)
        if not pid or not _is_front(pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 2.0
        while _is_front(pid) and time.monotonic() < end:
            self._reap(pid, block=False)
            time.sleep(0.01)
        if _is_front(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._reap(pid)

    def _reap(self, pid: int, *, block: bool = True) -> None:
        proc = self._children.get(pid)
        if proc is None:
            return  # not our child: init reaps it
        if block:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        elif proc.poll() is None:
            return
        if proc.returncode is not None:
            del self._children[pid]
