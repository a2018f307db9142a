"""The front's faults as SkyPilot meets them: a spot refill without capacity (SKYPILOT.md 1.3).

A 2-node spot cluster loses its worker; the refill (``sky launch`` onto the same
cluster) meets ``InsufficientInstanceCapacity``; SkyPilot, the cluster having been UP,
tries to *stop* it rather than terminate it, AWS (the front) refuses to stop spot
instances, and SkyPilot raises ``StopFailoverError`` ("This can cause resource
leakage"), not a capacity error: the case the launcher must read as capacity
(defect 3). Against bare moto the stop would succeed and the case would never show.
About 5 minutes on 2 cores, hence ``long``; root and the prepared node template.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.awsemu import runtime, skyconf
from orchestrator.awsemu.front import CapacityRule

SKY = str(Path(sys.executable).parent / "sky")
TEMPLATE = runtime.default_cache_root() / f"runtime-{runtime.RuntimeSpec().key()}"

pytestmark = [
    pytest.mark.long,
    pytest.mark.skipif(os.geteuid() != 0, reason="hosts need root (namespaces, sshd)"),
    pytest.mark.skipif(
        not (TEMPLATE / runtime.TEMPLATE_DIR / runtime.MANIFEST).exists(),
        reason="the node template is not prepared (scripts/awsemu-prepare needs PyPI)",
    ),
]
LAUNCH = ["launch", "-y", "-c", "t", "--infra", "aws/us-east-1", "--instance-type",
          "m6i.large", "--num-nodes", "2", "--use-spot"]  # fmt: skip


def _sky(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SKY, *args], env=env, cwd=env["HOME"], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip


def _live(emu: Any) -> dict[str, str]:
    """{instance id: ray-node-type} of the pending/running instances in us-east-1."""
    found = emu.boto3_client("ec2", "us-east-1").describe_instances(
        Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
    )
    return {
        i["InstanceId"]: next((t["Value"] for t in i.get("Tags", [])
                               if t["Key"] == "ray-node-type"), "")
        for r in found["Reservations"] for i in r["Instances"]
    }  # fmt: skip


def test_a_spot_refill_without_capacity_ends_in_stop_failover_not_a_capacity_error(
    tmp_path: Path,
) -> None:
    from orchestrator.awsemu import emulator

    with emulator.running(tmp_path / "emu", with_hosts=True, with_sky=True) as emu:
        assert emu.front is not None
        env = skyconf.sky_env(emu.home)
        try:
            first = _sky(env, *LAUNCH, "echo up", timeout=1500)
            assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
            nodes = _live(emu)
            (worker,) = [i for i, kind in nodes.items() if kind == "worker"]
            (head,) = [i for i, kind in nodes.items() if kind == "head"]
            emu.front.terminate(worker)  # lost without notice
            emu.wait_gone(worker)
            emu.front.add_capacity_rule(CapacityRule(region="us-east-1"))
            started = time.monotonic()
            refill = _sky(env, *LAUNCH, "echo refill", timeout=1500)
            print(f"awsemu: the failed refill took {time.monotonic() - started:.1f} s")
            out = refill.stdout + refill.stderr
            assert refill.returncode != 0, out[-5000:]
            assert "InsufficientInstanceCapacity" in out, out[-5000:]
            assert "This can cause resource leakage" in out, out[-5000:]
            assert "UnsupportedOperation" in out, out[-5000:]
            counts = emu.front.snapshot()["counts"]
            assert counts.get("refused:UnsupportedOperation", 0) >= 1
            assert head in _live(emu)  # AWS refused its stop: the head still runs
        finally:
            emu.front.clear_capacity()
            down = _sky(env, "down", "-y", "t", timeout=600)
        assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
        assert _live(emu) == {}
