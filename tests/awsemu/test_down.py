"""`up` and `down`, the real commands in their own processes: down leaves nothing behind.

A module of its own: `up` takes the emulator's whole address space (10.213.0.0/16), so it
cannot run beside test_hosts.py's emulator; pytest ends that one with its module.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_hosts import REASON, launch_via, prerequisites_or_skip, ssh

from orchestrator.awsemu import emulator
from orchestrator.awsemu.hosts import HostPool


@pytest.mark.skipif(REASON is not None, reason=f"no hosts here: {REASON}")
@pytest.mark.e2e
def test_down_removes_every_host_the_bridge_and_the_processes_of_up(tmp_path: Path) -> None:
    prerequisites_or_skip()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "id")],
                   check=True)  # fmt: skip
    home = tmp_path / "emu"
    up = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.awsemu", "up", "--home", str(home)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        while "AWS endpoint" not in line:
            if not line:
                pytest.fail(f"up ended before it served (exit {up.wait()})")
            line = up.stdout.readline()
        st = emulator.read_state(home)
        assert st.bridge is not None
        (iid,) = launch_via(st.endpoint, (tmp_path / "id.pub").read_text().strip())
        pool = HostPool(home, bridge=st.bridge)
        end = time.monotonic() + 30
        while iid not in pool.running() and time.monotonic() < end:
            time.sleep(0.1)
        spec = pool.running()[iid]
        pool.wait_ssh(iid)
        assert ssh(tmp_path / "id", spec.ip, "hostname") == spec.hostname
        down = [sys.executable, "-m", "orchestrator.awsemu", "down", "--home", str(home)]
        subprocess.run(down, check=True, timeout=120)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert spec.netns not in ns
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f" {st.bridge}:" not in links and spec.veth not in links
    procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(home) not in procs  # no host init, no metadata front
    assert f"-p {st.moto.rsplit(':', 1)[1]}" not in procs  # no moto
    assert not (home / emulator.STATE_FILE).exists()
