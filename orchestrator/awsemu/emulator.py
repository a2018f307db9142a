"""The one entry that starts the emulated AWS: :func:`start` (the CLI's ``up`` calls it).

    moto_server 127.0.0.1:M  <-  fault front 127.0.0.1:F  <-  AWS_ENDPOINT_URL (SkyPilot,
         ^                          (front.py)                the service, tests' boto3)
         |  describe_instances every 0.5 s, straight to moto
    hypervisor (hypervisor.py) -> hosts (hosts.py) on bridge mbr0, 10.213.0.1/16
    metadata simulator 10.213.0.1:S  <-  each host's 169.254.169.254 front

Everything runs in the calling process (threads) except moto's server (a child process)
and the hosts (namespaces). ``<home>/awsemu.json`` says where it all is, so
``python -m orchestrator.awsemu fault|down --home DIR`` and tests find it; ``down``
(:func:`down`) removes every host, bridge, iptables rule and process it made, also
after a crash of ``up``.

``with_hosts=False`` runs moto and the front only (no root needed): the front's faults
and preemption timing can be tested anywhere; a preemption's notice is then on the
simulator's ``/nodes/<instance-id>`` URL on loopback. ``with_sky=True`` also prepares
SkyPilot's side (``skyconf``/``runtime``, part B's) and starts ``sky api start``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from orchestrator.awsemu.ec2 import DEFAULT_REGIONS, Ec2
from orchestrator.awsemu.front import FaultFront
from orchestrator.awsemu.hosts import HostPool, ensure_prerequisites
from orchestrator.awsemu.hypervisor import Hypervisor

STATE_FILE = "awsemu.json"
DEFAULT_BRIDGE = "mbr0"
DEFAULT_CIDR = "10.213.0.0/16"


class EmulatorError(RuntimeError):
    """The emulator could not start or stop; the message says which part and why."""


@dataclass
class EmulatorState:
    """What ``<home>/awsemu.json`` holds: enough for ``fault``, ``down`` and tests."""

    home: str
    pid: int
    endpoint: str
    """The AWS endpoint (the fault front): set AWS_ENDPOINT_URL to it."""
    moto: str
    """moto's own server, behind the front (the emulator's own reads go here)."""
    moto_pid: int
    metadata: str
    """The metadata simulator; a host's IMDS is its ``/nodes/<instance-id>``."""
    regions: list[str]
    bridge: str | None
    cidr: str
    api_server: str | None = None
    started_at: float = field(default_factory=time.time)


def _log(msg: str) -> None:
    print(msg, flush=True)  # `up` runs under a pipe or a file: a line must show at once


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def read_state(home: Path) -> EmulatorState:
    path = Path(home) / STATE_FILE
    if not path.exists():
        raise EmulatorError(f"no emulator state at {path}: is `up --home {home}` running?")
    return EmulatorState(**json.loads(path.read_text()))


def _start_moto(home: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    log = open(home / "moto.log", "ab")  # noqa: SIM115 (moto's lifetime, not this block's)
    # AWS-managed policies (AmazonEC2FullAccess, ...) exist in every real account;
    # moto loads them only when asked, and SkyPilot's bootstrap attaches one by ARN.
    env = {**os.environ, "MOTO_IAM_LOAD_MANAGED_POLICIES": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=env,
    )  # fmt: skip
    log.close()
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = (home / "moto.log").read_text(errors="replace")[-2000:]
            raise EmulatorError(f"moto_server exited ({proc.returncode}):\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return proc, url
        time.sleep(0.1)
    proc.kill()
    raise EmulatorError(f"moto_server did not listen on {url} within 60 s")


class Emulator:
    """A running emulated AWS. Use :func:`start` (or :func:`running` for a with-block)."""

    def __init__(
        self,
        home: Path,
        *,
        regions: tuple[str, ...] = DEFAULT_REGIONS,
        with_hosts: bool = True,
        with_sky: bool = False,
        bridge: str = DEFAULT_BRIDGE,
        cidr: str = DEFAULT_CIDR,
        interval_s: float = 0.5,
        log: Any = _log,
    ) -> None:
        self.home = Path(home).resolve()
        self.regions = tuple(regions)
        self.with_hosts = with_hosts
        self.with_sky = with_sky
        self.bridge, self.cidr = bridge, cidr
        self.interval_s = interval_s
        self.log = log
        self.moto_proc: subprocess.Popen[bytes] | None = None
        self.front: FaultFront | None = None
        self.simulator: Any = None
        self.hypervisor: Hypervisor | None = None
        self.pool: HostPool | None = None
        self.ec2: Ec2 | None = None
        self.state: EmulatorState | None = None
        self._hosts_lock: IO[str] | None = None

    @property
    def endpoint(self) -> str:
        assert self.front is not None, "not started"
        return self.front.url

    def start(self) -> Emulator:
        from orchestrator.awsemu import skyconf
        from orchestrator.cloud.simulator import MetadataSimulator

        self.home.mkdir(parents=True, exist_ok=True)
        if (self.home / STATE_FILE).exists():
            old = read_state(self.home)
            if _alive(old.pid) and old.pid != os.getpid():
                raise EmulatorError(f"an emulator (pid {old.pid}) already runs on {self.home}")
            down(self.home, log=self.log)  # a crashed one's leftovers first
        try:
            self.moto_proc, moto_url = _start_moto(self.home)
            self.ec2 = Ec2(moto_url, self.regions)
            skyconf.seed(moto_url, self.regions)  # IAM profile, then the VPCs
            if self.with_hosts:
                for line in ensure_prerequisites():
                    self.log(f"awsemu: {line}")
                self._hosts_lock = _hold_hosts_lock(self.log)
                self.pool = HostPool(self.home, bridge=self.bridge, cidr=self.cidr)
                self.pool.up()
                self.simulator = MetadataSimulator(self.pool.gateway, 0, ("aws",)).start()
                _hand_template_to_user(self.pool.template, self.log)
                self.pool.metadata_url = self.simulator.url
            else:
                self.simulator = MetadataSimulator("127.0.0.1", 0, ("aws",)).start()
            self.front = FaultFront(moto_url, self.ec2, self.simulator).start()
            if self.pool is not None:
                self.hypervisor = Hypervisor(
                    self.ec2, self.pool, self.simulator, self.interval_s, log=self.log
                ).start()
            api = None
            if self.with_sky:
                skyconf.prepare(self.home, self.front.url)
                if self.pool is not None:
                    _hand_template_to_user(self.pool.template, self.log)
                api = skyconf.start_api_server(self.home)
            self.state = EmulatorState(
                home=str(self.home), pid=os.getpid(), endpoint=self.front.url, moto=moto_url,
                moto_pid=self.moto_proc.pid, metadata=self.simulator.url,
                regions=list(self.regions), bridge=self.bridge if self.pool else None,
                cidr=self.cidr, api_server=api,
            )  # fmt: skip
            tmp = self.home / f".{STATE_FILE}.tmp"
            tmp.write_text(json.dumps(asdict(self.state), indent=2))
            os.replace(tmp, self.home / STATE_FILE)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop everything this emulator started; safe to call twice."""
        if self.hypervisor is not None:
            self.hypervisor.stop()
            self.hypervisor = None
        if self.with_sky:
            from orchestrator.awsemu import skyconf

            with contextlib.suppress(Exception):
                skyconf.stop_api_server(self.home)
        if self.pool is not None:
            self.pool.down()
            self.pool = None
        if self._hosts_lock is not None:
            self._hosts_lock.close()  # closing the file releases its flock
            self._hosts_lock = None
        if self.front is not None:
            self.front.stop()
            self.front = None
        if self.simulator is not None:
            self.simulator.stop()
            self.simulator = None
        if self.moto_proc is not None:
            self.moto_proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.moto_proc.wait(10)
            if self.moto_proc.poll() is None:
                self.moto_proc.kill()
                self.moto_proc.wait(5)
            self.moto_proc = None
        with contextlib.suppress(FileNotFoundError):
            (self.home / STATE_FILE).unlink()

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- for tests and scripts --------------------------------------------------------

    def boto3_client(self, service: str = "ec2", region: str = "us-east-1") -> Any:
        """A boto3 client through the front (what SkyPilot sees), with the fake keys."""
        import boto3

        from orchestrator.awsemu.ec2 import FAKE_KEYS

        session = boto3.session.Session(**FAKE_KEYS, region_name=region)
        return session.client(service, endpoint_url=self.endpoint)

    def wait_host(self, instance_id: str, timeout_s: float = 30.0) -> str:
        """Block until the instance's host accepts ssh; its private IP."""
        assert self.pool is not None, "this emulator makes no hosts (with_hosts=False)"
        end = time.monotonic() + timeout_s
        while instance_id not in self.pool.running():
            if time.monotonic() > end:
                raise EmulatorError(f"no host came up for {instance_id} in {timeout_s:.0f} s")
            time.sleep(0.05)
        self.pool.wait_ssh(instance_id, max(end - time.monotonic(), 1.0))
        return self.pool.running()[instance_id].ip

    def wait_gone(self, instance_id: str, timeout_s: float = 30.0) -> None:
        assert self.pool is not None, "this emulator makes no hosts (with_hosts=False)"
        end = time.monotonic() + timeout_s
        while instance_id in self.pool.running():
            if time.monotonic() > end:
                raise EmulatorError(f"the host of {instance_id} still runs after {timeout_s} s")
            time.sleep(0.05)


#: Held (flock) by every emulator that makes hosts, for its whole life: hosts of two
#: emulators would share one address plan (10.213.0.0/16 on bridges of the same or
#: another name), and one's ``down`` removed the other's bridge (a default-run test's
#: emulator on mbr0 took the whole loop's bridge away mid-run, issue 19). Not
#: /tmp/skyresume-awsemu.lock, which people's ``flock`` wrappers hold around a run.
HOSTS_LOCK = Path("/tmp/skyresume-awsemu-hosts.lock")
#: How long a second emulator with hosts waits for the first to end.
HOSTS_LOCK_WAIT_S = 1800.0


def _hold_hosts_lock(
    log: Any, path: Path = HOSTS_LOCK, wait_s: float = HOSTS_LOCK_WAIT_S
) -> IO[str]:
    """The machine's hosts lock, waited for (EmulatorError after ``wait_s``); the open
    file holds it until closed."""
    import fcntl

    f = open(path, "a+")  # noqa: SIM115 - held until Emulator.stop closes it
    end = time.monotonic() + wait_s
    said = False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > end:
                f.close()
                raise EmulatorError(
                    f"another emulator with hosts still runs after {wait_s:.0f} s ({path})"
                ) from None
            if not said:
                log(f"awsemu: waiting for another emulator with hosts to end ({path})")
                said = True
            time.sleep(1.0)
            continue
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        return f


def _hand_template_to_user(template: Path, log: Any) -> None:
    """The node template, owned by ``ubuntu``: it is the lower layer of every home.

    Overlayfs checks a write against the lower file's owner before copying it up, so a
    root-owned template would leave ``ubuntu`` unable to touch its own venvs. Done once
    per template (its contents are unchanged; it is a cache entry keyed by versions).
    """
    import pwd

    if not template.is_dir():
        return
    real = template.resolve()
    user = pwd.getpwnam("ubuntu")
    if real.stat().st_uid == user.pw_uid:
        return
    log(f"awsemu: handing the node template {real} to ubuntu (once)")
    # The directories above it need not be traversable by ubuntu: the overlay resolves
    # its lower layer once, as root, at mount time.
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(real)], check=True)


def start(home: Path, **kw: Any) -> Emulator:
    """Start the emulator on ``home`` (see :class:`Emulator` for the options)."""
    return Emulator(home, **kw).start()


@contextlib.contextmanager
def running(home: Path, **kw: Any) -> Iterator[Emulator]:
    emu = start(home, **kw)
    try:
        yield emu
    finally:
        emu.stop()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie does not: an `up` that exited stays one until its
    parent (a test, a shell) reaps it, and ``down`` must not wait on that."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in {"Z", "X"}


def down(home: Path, *, log: Any = _log) -> None:
    """Stop the emulator on ``home`` and remove what it made, even after a crash."""
    home = Path(home).resolve()
    path = home / STATE_FILE
    if not path.exists():
        return
    st = read_state(home)
    if st.pid != os.getpid() and _alive(st.pid):
        os.kill(st.pid, signal.SIGTERM)  # `up` stops its own parts on SIGTERM
        end = time.monotonic() + 60
        while _alive(st.pid) and time.monotonic() < end:
            time.sleep(0.2)
    if st.api_server:
        from orchestrator.awsemu import skyconf

        with contextlib.suppress(Exception):
            skyconf.stop_api_server(home)
    if st.bridge:
        HostPool(home, bridge=st.bridge, cidr=st.cidr).down()
    if _alive(st.moto_pid) and _is_moto(st.moto_pid):
        os.kill(st.moto_pid, signal.SIGTERM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    log(f"awsemu: down on {home}")


def _is_moto(pid: int) -> bool:
    try:
        return b"moto.server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
