"""Hosts: each moto instance as a machine of its own on this one.

One host is a network namespace joined to the emulator's bridge, holding the
instance's private IP, and inside it mount, PID and UTS namespaces whose init (PID 1,
:func:`init_main`) runs the instance's sshd and its metadata service:

    host (default ns)                  netns ``ae<bridge>-<instance-id>``
    bridge mbr0 10.213.0.1/16          eth0 <private ip>/16, default via 10.213.0.1
      └─ <bridge>v<9 hex> ── veth ──── lo   127.0.0.1, 169.254.169.254/32
                                       PID 1  init (this module): mounts, then
                                         metadata front 169.254.169.254:80 -> simulator
                                         sshd -D on <private ip>:22

Inside the mount namespace (private propagation: nothing leaks to the machine):

- ``/home/ubuntu`` is an overlay: the node template home (``<emu-home>/node-template``,
  part B's offline SkyPilot runtime) below, the instance's own upper directory above.
  That upper directory is the instance's disk: kept across stop and start, deleted
  when the instance terminates.
- ``/etc`` is an overlay over the machine's ``/etc`` (SkyPilot's setup edits
  ``limits.conf``, ``sshd_config``, ``fuse.conf`` with sudo; none of it reaches the
  machine), with the instance's own ``hostname`` and ``hosts``.
- ``/tmp``, ``/dev/shm`` and ``/run`` are fresh tmpfs: Ray's sockets, session dirs and
  plasma store are per host, as on a VM.
- ``/proc`` is the PID namespace's own, so ``ray stop`` (which kills by process name)
  and ``pkill`` see only this host's processes.

Ending a host kills every process in its network namespace (the PID namespace's init
among them, which takes every process of that namespace with it: the kernel's rule),
then deletes the namespace and the veth. Every name a pool makes carries its bridge's
name, so ``down`` after a crash removes exactly what this emulator made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.launchers.netns import bridge_mac

#: The link-local metadata address; the netns helpers use the same.
METADATA_IP = "169.254.169.254"
NODE_IFNAME = "eth0"
SSH_USER = "ubuntu"
#: Bridge names leave room for ``v`` and nine hex digits within IFNAMSIZ (15).
_BRIDGE_RE = re.compile(r"^[a-z][a-z0-9]{0,4}$")
_IID_RE = re.compile(r"^i-[0-9a-f]{8,17}$")
_STATE = "hosts.json"


class HostError(RuntimeError):
    """A kernel operation failed; the message carries the command and its stderr."""


def _run(
    *cmd: str, check: bool = True, input: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
    if check and p.returncode != 0:
        raise HostError(f"`{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _namespaces() -> set[str]:
    out = _run("ip", "netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _link_exists(dev: str) -> bool:
    return _run("ip", "link", "show", "dev", dev, check=False).returncode == 0


def unavailable_reason(*, sshd: bool = True) -> str | None:
    """None when hosts can be made here; else why not (tests skip with it).

    ``sshd=False`` leaves out what :func:`ensure_prerequisites` can install.
    """
    if os.geteuid() != 0:
        return "hosts need root (network, mount and PID namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if _run("ip", "netns", "list", check=False).returncode != 0:
        return "`ip netns list` fails: no network namespaces in this kernel or container"
    if sshd and not Path("/usr/sbin/sshd").exists():
        return "sshd is not installed (ensure_prerequisites() installs openssh-server)"
    return None


def ensure_prerequisites(*, install: bool = True) -> list[str]:
    """sshd, sudo and user ``ubuntu`` with passwordless sudo; what was done, in words.

    Debian's ``openssh-server`` and ``sudo`` come from apt when missing (root here and
    in CI). ``ubuntu``'s password is ``*`` rather than useradd's ``!``: sshd without
    PAM refuses a locked account even for a key, and ``*`` locks passwords only.
    """
    done = []
    wanted = (("openssh-server", "/usr/sbin/sshd"), ("sudo", "/usr/bin/sudo"))
    missing = [pkg for pkg, path in wanted if not Path(path).exists()]
    if missing:
        if not install:
            raise HostError(
                f"missing {', '.join(missing)} (apt-get install -y {' '.join(missing)})"
            )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", *missing]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:  # a stale package index: refresh once, as scripts/test does
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:
            raise HostError(f"`{' '.join(cmd)}` failed: {p.stderr.strip()[-800:]}")
        done.append(f"installed {', '.join(missing)}")
    if not list(Path("/etc/ssh").glob("ssh_host_*_key")):
        _run("ssh-keygen", "-A")
        done.append("generated sshd host keys")
    try:
        pwd.getpwnam(SSH_USER)
    except KeyError:
        _run("useradd", "--create-home", "--shell", "/bin/bash", SSH_USER)
        done.append(f"created user {SSH_USER}")
    shadow = Path("/etc/shadow").read_text()
    if re.search(rf"^{SSH_USER}:!", shadow, re.M):
        _run("usermod", "-p", "*", SSH_USER)
    sudoers = Path("/etc/sudoers.d/90-awsemu-ubuntu")
    if not sudoers.exists():
        sudoers.write_text(f"{SSH_USER} ALL=(ALL) NOPASSWD:ALL\n")
        sudoers.chmod(0o440)
        done.append(f"gave {SSH_USER} passwordless sudo")
    Path(f"/home/{SSH_USER}").mkdir(exist_ok=True)  # the overlay's mount point
    return done


@dataclass(frozen=True)
class HostSpec:
    """Everything a host's init needs, written to ``spec.json`` in its directory."""

    instance_id: str
    ip: str
    prefixlen: int
    gateway: str
    netns: str
    veth: str
    dir: str
    """The instance's directory: its disk (home and /etc upper layers) and logs."""
    template: str
    """The lower layer of /home/ubuntu."""
    metadata_upstream: str
    """The simulator's ``/nodes/<instance-id>`` URL on the gateway."""
    python: str
    """The interpreter that runs init and the metadata front (this project's)."""

    @property
    def hostname(self) -> str:
        return "ip-" + self.ip.replace(".", "-")  # AWS's own private DNS name


class HostPool:
    """The hosts of one emulator: a bridge, and a namespace per running instance."""

    def __init__(
        self,
        home: Path,
        *,
        bridge: str = "mbr0",
        cidr: str = "10.213.0.0/16",
        template: Path | None = None,
        metadata_url: str = "",
        python: str = sys.executable,
    ) -> None:
        if not _BRIDGE_RE.match(bridge):
            raise ValueError(
                f"bridge {bridge!r} must be a lowercase letter then up to 4 letters or digits "
                "(its veths are <bridge>v<9 hex> within the kernel's 15 characters)"
            )
        net = ipaddress.ip_network(cidr, strict=True)
        if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 24:
            raise ValueError(f"cidr {cidr!r} must be an IPv4 network of /24 or larger")
        self.home = Path(home)
        self.dir = self.home / "hosts"
        self.bridge = bridge
        self.net = net
        self.gateway = str(net.network_address + 1)
        self.template = Path(template) if template else self.home / "node-template"
        self.metadata_url = metadata_url.rstrip("/")
        self.python = python
        self.prefix = f"ae{bridge}-"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # --- the bridge -----------------------------------------------------------------

    def up(self) -> None:
        """The bridge with the gateway address, and FORWARD accepted on it; idempotent."""
        gw = ipaddress.ip_interface(f"{self.gateway}/{self.net.prefixlen}")
        for link in json.loads(_run("ip", "-j", "-4", "addr", "show").stdout or "[]"):
            for a in link.get("addr_info", []):
                other = ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}")
                if link["ifname"] != self.bridge and other.network.overlaps(self.net):
                    raise HostError(
                        f"{self.net} overlaps {other} on {link['ifname']}: give the emulator "
                        "another cidr (its VPC is seeded with the same)"
                    )
        if not _link_exists(self.bridge):
            _run("ip", "link", "add", self.bridge, "type", "bridge")
        # A fixed MAC (bridge_mac says why): a host terminated must not cut the others
        # off from the gateway, where the service, S3 and metadata are.
        _run("ip", "link", "set", self.bridge, "address", bridge_mac(self.gateway))
        _run("ip", "addr", "replace", str(gw), "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        # docker sets FORWARD to DROP, which (with br_netfilter) silently cuts traffic
        # between hosts on the bridge: accept ours, and only ours (DESIGN.md).
        if shutil.which("iptables"):
            for rule in self._iptables_rules():
                if _run("iptables", "-C", *rule, check=False).returncode != 0:
                    _run("iptables", "-I", *rule, check=False)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _iptables_rules(self) -> list[list[str]]:
        return [["FORWARD", "-i", self.bridge, "-j", "ACCEPT"],
                ["FORWARD", "-o", self.bridge, "-j", "ACCEPT"]]  # fmt: skip

    def down(self) -> None:
        """Remove every host, leftover namespace, veth, iptables rule and the bridge."""
        for iid in list(self.running()):
            self.stop(iid, keep_disk=False)
        for ns in _namespaces():
            if ns.startswith(self.prefix):
                self._kill_namespace(ns)
        p = _run("ip", "-j", "link", "show", "master", self.bridge, check=False)
        for link in json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip() else []:
            _run("ip", "link", "del", str(link["ifname"]), check=False)
        if _link_exists(self.bridge):
            _run("ip", "link", "del", self.bridge, check=False)
        if shutil.which("iptables"):
            for rule in self._iptables_rules():
                while _run("iptables", "-C", *rule, check=False).returncode == 0:
                    _run("iptables", "-D", *rule, check=False)
        with contextlib.suppress(FileNotFoundError):
            (self.home / _STATE).unlink()

    # --- hosts ----------------------------------------------------------------------

    def spec(self, instance_id: str, ip: str) -> HostSpec:
        if not _IID_RE.match(instance_id):
            raise ValueError(f"instance id {instance_id!r} is not an EC2 instance id")
        addr = ipaddress.ip_address(ip)
        if addr not in self.net or str(addr) == self.gateway:
            raise ValueError(f"private IP {ip} is outside {self.net} or is its gateway")
        template = self.template
        if not template.is_dir():
            template = self.home / "empty-home"  # plain ssh still works; SkyPilot would not
            template.mkdir(parents=True, exist_ok=True)
        return HostSpec(
            instance_id=instance_id,
            ip=ip,
            prefixlen=self.net.prefixlen,
            gateway=self.gateway,
            netns=self.prefix + instance_id,
            veth=f"{self.bridge}v{instance_id[-9:]}",
            dir=str(self.dir / instance_id),
            template=str(template),
            metadata_upstream=f"{self.metadata_url}/nodes/{instance_id}",
            python=self.python,
        )

    def running(self) -> dict[str, HostSpec]:
        """The hosts this pool believes up, from its state file (survives a restart)."""
        path = self.home / _STATE
        if not path.exists():
            return {}
        return {k: HostSpec(**v) for k, v in json.loads(path.read_text()).items()}

    def _write(self, hosts: dict[str, HostSpec]) -> None:
        tmp = self.home / f".{_STATE}.tmp"
        tmp.write_text(json.dumps({k: asdict(v) for k, v in hosts.items()}, indent=2))
        os.replace(tmp, self.home / _STATE)

    def start(self, instance_id: str, ip: str, authorized_keys: list[str]) -> HostSpec:
        """Make the host of ``instance_id`` at ``ip`` and start its init; its spec.

        The instance's disk (an earlier stop's) is kept; everything else is made fresh.
        """
        spec = self.spec(instance_id, ip)
        self._kill_namespace(spec.netns)  # a half-made one from a crash: start clean
        d = Path(spec.dir)
        user = pwd.getpwnam(SSH_USER)
        for sub in ("home/upper", "home/work", "etc/upper", "etc/work"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        upper = d / "home" / "upper"
        os.chown(upper, user.pw_uid, user.pw_gid)
        ssh = upper / ".ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        (ssh / "authorized_keys").write_text("".join(k + "\n" for k in authorized_keys))
        for p in (ssh, ssh / "authorized_keys"):
            os.chown(p, user.pw_uid, user.pw_gid)
        (ssh / "authorized_keys").chmod(0o600)
        etc = d / "etc" / "upper"
        (etc / "hostname").write_text(spec.hostname + "\n")
        (etc / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n{spec.ip}\t{spec.hostname}\n{spec.gateway}\tawsemu-gateway\n"
        )
        # No DNS server on the bridge: fail lookups at once instead of after timeouts.
        (etc / "resolv.conf").write_text(
            "# no DNS on the emulator's bridge\noptions timeout:1 attempts:1\n"
        )
        (d / "spec.json").write_text(json.dumps(asdict(spec), indent=2))

        _run("ip", "netns", "add", spec.netns)
        if _link_exists(spec.veth):
            _run("ip", "link", "del", spec.veth)
        _run("ip", "link", "add", spec.veth, "type", "veth", "peer", "name", NODE_IFNAME,
             "netns", spec.netns)  # fmt: skip
        _run("ip", "link", "set", spec.veth, "master", self.bridge)
        _run("ip", "link", "set", spec.veth, "up")
        _run(
            "ip", "-n", spec.netns, "-batch", "-",
            input="\n".join([
                "link set lo up",
                f"addr replace {METADATA_IP}/32 dev lo",
                f"addr replace {spec.ip}/{spec.prefixlen} dev {NODE_IFNAME}",
                f"link set {NODE_IFNAME} up",
                f"route replace default via {spec.gateway} dev {NODE_IFNAME}",
            ]) + "\n",
        )  # fmt: skip
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        cmd = [
            "ip", "netns", "exec", spec.netns,
            "unshare", "--mount", "--pid", "--uts", "--fork", "--mount-proc",
            "--propagation", "private", "--kill-child",
            spec.python, "-m", "orchestrator.awsemu.hosts", "init", str(d / "spec.json"),
        ]  # fmt: skip
        with open(d / "init.log", "ab") as log:
            self._procs[instance_id] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True,  # a ^C to `up` must not reach the hosts' processes
            )  # fmt: skip
        hosts = self.running()
        hosts[instance_id] = spec
        self._write(hosts)
        return spec

    def stop(self, instance_id: str, *, keep_disk: bool) -> None:
        """End the host: every process inside, its namespace, its veth; its disk unless
        ``keep_disk`` (a stopped instance keeps its EBS volume, a terminated one not)."""
        hosts = self.running()
        spec = hosts.pop(instance_id, None)
        if spec is None:
            return
        self._kill_namespace(spec.netns)
        if _link_exists(spec.veth):
            _run("ip", "link", "del", spec.veth, check=False)
        proc = self._procs.pop(instance_id, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if not keep_disk:
            shutil.rmtree(spec.dir, ignore_errors=True)
        self._write(hosts)

    def _kill_namespace(self, ns: str) -> None:
        if not ns.startswith(self.prefix):  # never anyone else's
            raise HostError(f"refusing to delete namespace {ns!r}: not this emulator's")
        if ns not in _namespaces():
            return
        # Several rounds: a process forking while we kill can leave a child behind once.
        for _ in range(20):
            pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        _run("ip", "netns", "del", ns, check=False)

    def alive(self, instance_id: str, spec: HostSpec) -> bool:
        """Whether the host's init still runs. Its own child is polled (no fork: this
        runs for every host twice a second); a host an earlier `up` made is looked up."""
        proc = self._procs.get(instance_id)
        if proc is not None:
            return proc.poll() is None
        return init_pid(spec) is not None

    def exec_prefix(self, instance_id: str) -> list[str]:
        """Run a command on the host, as root, inside its mount/PID namespaces too."""
        spec = self.running()[instance_id]
        init = init_pid(spec)
        if init is None:
            raise HostError(f"host {instance_id} has no running init")
        return ["nsenter", "-t", str(init), "-n", "-m", "-p", "-u", "--"]

    def wait_ssh(self, instance_id: str, timeout_s: float = 30.0) -> None:
        """Return once the host's sshd accepts connections; HostError with its log if not."""
        spec = self.running()[instance_id]
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with contextlib.suppress(OSError), socket.create_connection((spec.ip, 22), 0.5):
                return
            proc = self._procs.get(instance_id)
            if proc is not None and proc.poll() is not None:
                break
            time.sleep(0.1)
        log = Path(spec.dir, "init.log").read_text(errors="replace")[-2000:]
        raise HostError(f"sshd on {instance_id} ({spec.ip}) is not up:\n{log}")


def init_pid(spec: HostSpec) -> int | None:
    """The host's PID-namespace init, found in its network namespace by its argv."""
    pids = _run("ip", "netns", "pids", spec.netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"orchestrator.awsemu.hosts" in argv and b"init" in argv:
                status = Path(f"/proc/{pid}/status").read_text()
                # NSpid lists the pid in each namespace; "1" last is the namespace's init.
                nspid = next(ln for ln in status.splitlines() if ln.startswith("NSpid:"))
                if nspid.split()[-1] == "1":
                    return int(pid)
    return None


# --- inside the host: PID 1 ------------------------------------------------------------


def _mount(*args: str) -> None:
    _run("mount", *args)


def init_main(spec_path: str) -> None:
    """PID 1 of a host: its mounts, then its metadata front and sshd, reaping orphans.

    It exits when sshd does (the host is then unreachable, which must be visible, not
    a host that looks up and answers nothing); its exit ends every process inside.
    """
    spec = HostSpec(**json.loads(Path(spec_path).read_text()))
    d = Path(spec.dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1 ignores it otherwise
    socket.sethostname(spec.hostname)
    _mount("-t", "overlay", "overlay", "-o",
           f"lowerdir=/etc,upperdir={d}/etc/upper,workdir={d}/etc/work", "/etc")  # fmt: skip
    _mount("-t", "overlay", "overlay", "-o",
           f"lowerdir={spec.template},upperdir={d}/home/upper,workdir={d}/home/work",
           f"/home/{SSH_USER}")  # fmt: skip
    # The metadata front first: it is this project's python, which may live under /tmp.
    front = subprocess.Popen(
        [spec.python, "-m", "orchestrator.cloud.simulator", "front",
         "--listen", f"{METADATA_IP}:80", "--upstream", spec.metadata_upstream],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert front.stdout is not None
    print(front.stdout.readline().decode().strip() or "metadata front did not start", flush=True)
    front.stdout.close()
    for target, mode in (("/tmp", "1777"), ("/dev/shm", "1777"), ("/run", "755")):
        _mount("-t", "tmpfs", "-o", f"mode={mode}", "tmpfs", target)
    Path("/run/sshd").mkdir(mode=0o755)
    Path("/run/lock").mkdir(mode=0o1777)
    sshd = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e",
         "-o", f"ListenAddress={spec.ip}:22",
         "-o", "UsePAM=no",  # no PAM session stack in a namespace (loginuid, systemd)
         "-o", "PidFile=/run/sshd.pid",
         # SkyPilot multiplexes many commands over a few connections, in parallel.
         "-o", "MaxSessions=100", "-o", "MaxStartups=100:30:200"],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    print(f"host {spec.instance_id} ({spec.hostname}) at {spec.ip}: sshd pid {sshd.pid}",
          flush=True)  # fmt: skip
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == sshd.pid:
            print(f"sshd exited ({status}): the host ends", flush=True)
            break
        if pid == front.pid:
            print(f"metadata front exited ({status})", flush=True)
    sys.exit(1)


def _main(argv: list[str]) -> None:
    if argv[:1] == ["init"] and len(argv) == 2:
        init_main(argv[1])
        return
    raise SystemExit("usage: python -m orchestrator.awsemu.hosts init SPEC.json")


if __name__ == "__main__":
    _main(sys.argv[1:])
