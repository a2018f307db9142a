"""The hypervisor: moto's instances become hosts, and hosts end with their instances.

Every ``interval_s`` (0.5 s) it reads ``describe_instances`` in every watched region,
straight from moto, and makes the hosts agree with it:

- a ``pending`` or ``running`` instance with a private IP and no host gets one
  (:class:`~orchestrator.awsemu.hosts.HostPool`), with the ssh keys of its UserData
  and its own identity on its metadata (instance-id, type, zone, private IP);
- a host whose instance is ``stopping``/``stopped`` ends and keeps its disk;
  ``shutting-down``/``terminated``, or gone from moto, ends and loses it;
- a host whose init died (sshd crashed, someone killed it) is made again, as a VM
  that rebooted, and the restart is logged.

A region moto cannot answer is *unknown*, never *empty*: its hosts are left alone
until it answers again (a moto hiccup must not kill every host of a region).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.awsemu.ec2 import Ec2, Instance
from orchestrator.awsemu.hosts import HostPool

_UP = {"pending", "running"}
_KEEP_DISK = {"stopping", "stopped"}


class Identity(Protocol):
    def set_aws_metadata(self, node: str, values: dict[str, str]) -> None: ...


@dataclass
class Hypervisor:
    ec2: Ec2
    pool: HostPool
    identity: Identity | None = None
    interval_s: float = 0.5
    log: Callable[[str], None] = lambda m: print(m, flush=True)
    events: list[tuple[float, str, str]] = field(default_factory=list)
    """(time, instance id, what happened): started, stopped, terminated, restarted."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _failed: dict[str, str] = field(default_factory=dict)

    def start(self) -> Hypervisor:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="awsemu-hyp")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # one bad pass must not end every later one
                self.log(f"awsemu hypervisor: poll failed: {e!r}")
            self._stop.wait(self.interval_s)

    def _note(self, iid: str, what: str) -> None:
        self.events.append((time.time(), iid, what))
        self.log(f"awsemu hypervisor: {iid} {what}")

    def poll_once(self) -> None:
        seen: dict[str, Instance] = {}
        blind: set[str] = set()
        for region in self.ec2.regions:
            try:
                for found in self.ec2.instances(region):
                    seen[found.instance_id] = found
            except Exception as e:
                blind.add(region)
                self.log(f"awsemu hypervisor: {region} unreadable ({e!r}); its hosts stay")
        hosts = self.pool.running()
        for iid, spec in hosts.items():
            inst = seen.get(iid)
            if inst is None:
                if not blind:
                    self.pool.stop(iid, keep_disk=False)
                    self._note(iid, "gone from moto: host removed")
                continue
            if inst.state in _KEEP_DISK:
                self.pool.stop(iid, keep_disk=True)
                self._note(iid, f"{inst.state}: host ended, disk kept")
            elif inst.state not in _UP:
                self.pool.stop(iid, keep_disk=False)
                self._note(iid, f"{inst.state}: host removed")
            elif not self.pool.alive(iid, spec):
                self.pool.stop(iid, keep_disk=True)
                self._note(iid, "init died: host restarted (like a VM reboot)")
        hosts = self.pool.running()
        for iid, inst in seen.items():
            if inst.state not in _UP or iid in hosts or not inst.private_ip:
                continue
            try:
                keys = self.ec2.authorized_keys(inst.region, iid)
                if self.identity is not None:
                    self.identity.set_aws_metadata(iid, _identity(inst))
                self.pool.start(iid, inst.private_ip, keys)
            except Exception as e:
                # Logged once per cause; retried every pass (moto may just be slow).
                if self._failed.get(iid) != repr(e):
                    self._failed[iid] = repr(e)
                    self.log(f"awsemu hypervisor: cannot make host {iid}: {e!r}")
                continue
            self._failed.pop(iid, None)
            market = "spot" if inst.spot else "on-demand"
            self._note(
                iid, f"started at {inst.private_ip} ({inst.zone}, {market}, {len(keys)} key(s))"
            )


def _identity(inst: Instance) -> dict[str, str]:
    """The instance's own IMDS ``meta-data`` leaves that tools on a VM read."""
    return {
        "instance-id": inst.instance_id,
        "instance-type": inst.instance_type,
        "local-ipv4": inst.private_ip or "",
        "placement/availability-zone": inst.zone,
        "placement/region": inst.region,
        "instance-life-cycle": "spot" if inst.spot else "on-demand",
        "hostname": "ip-" + (inst.private_ip or "").replace(".", "-"),
    }
