"""Chaos on a node's link, on the real kernel: the local launcher's partition,
slow-link and heal act on the node's veth (its Fabric), and the chaos route refuses
what it cannot do for real, through the real app on a real database.

Each test builds its own fabric on a private bridge and /24 (never the demo's
``srbr0`` / 10.213.0.0/16) and tears it down. No cluster is booted: the node's
cluster meta file and hosts are made exactly as a launch makes them, which is all
these methods read."""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from testkit import job_spec

from orchestrator.launchers.base import ChaosLauncher, LaunchError
from orchestrator.launchers.local import LocalLauncher, LocalLauncherConfig, node_id_for
from orchestrator.launchers.netns import Fabric

REASON = Fabric.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network fabric: {REASON}")

JOB = "job-link"


def _cluster(launcher: LocalLauncher, job: str, nodes: int = 2) -> tuple[list[str], list[str]]:
    """Attempt 1 of ``job`` as a launch leaves it: meta file, and hosts on the fabric."""
    node_ids = [node_id_for(job, 1, k) for k in range(nodes)]
    hosts = [f"local-host{k}" for k in range(nodes)]
    (launcher.root / job).mkdir(parents=True, exist_ok=True)
    meta = {"node_ids": node_ids, "hosts": hosts, "request_id": "r", "boot_pid": 0}
    (launcher.root / job / f"{job}-a1.json").write_text(json.dumps(meta))
    if launcher.fabric is not None:
        for h in hosts:
            launcher.fabric.add_host(h)
    return node_ids, hosts


def _wait(what: str, cond: Any, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
def netns_launcher(tmp_path: Path) -> Iterator[LocalLauncher]:
    if REASON is not None:
        pytest.skip(f"no network fabric: {REASON}")
    launcher = LocalLauncher(
        tmp_path / "nodes", "http://10.255.255.1:9", lambda j, a: "t",
        LocalLauncherConfig(network="netns"),
    )  # fmt: skip
    bridge = f"srbrc{secrets.token_hex(2)}"
    fabric = Fabric(
        tmp_path / "nodes" / "fabric", bridge=bridge, subnet=f"10.216.{random.randrange(256)}.0/24"
    )
    fabric.up()
    # The launcher makes its fabric on first use with the demo's bridge; a test must
    # never touch that one, so it is handed a private one before any use.
    launcher._fabric = fabric
    yield launcher
    launcher.close()
    fabric.teardown()


def test_the_local_launcher_declares_link_chaos(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path, "http://127.0.0.1:9", lambda j, a: "t")
    assert isinstance(launcher, ChaosLauncher)


def test_on_loopback_link_chaos_is_refused_saying_it_needs_namespaces(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path, "http://127.0.0.1:9", lambda j, a: "t")
    (node, _), _ = _cluster(launcher, JOB)
    refusal = launcher.link_chaos_refusal()
    assert refusal is not None and "root" in refusal and "network namespace" in refusal
    with pytest.raises(LaunchError, match="network namespace"):
        launcher.partition_node(JOB, node)


@needs_netns
def test_partition_takes_the_nodes_link_down_and_heal_brings_it_back(
    netns_launcher: LocalLauncher,
) -> None:
    (_, n1), (h0, h1) = _cluster(netns_launcher, JOB)
    fabric = netns_launcher.fabric
    done = netns_launcher.partition_node(JOB, n1)
    assert done["node_id"] == n1 and done["host"] == h1 and done["partitioned"] is True
    assert done["link"] == fabric.host(h1).veth and done["heals_in_s"] is None
    assert fabric.is_partitioned(h1) and not fabric.is_partitioned(h0)
    healed = netns_launcher.heal_node(JOB, n1)
    assert healed["partitioned"] is False and not fabric.is_partitioned(h1)


@needs_netns
def test_a_partition_with_seconds_heals_by_itself(netns_launcher: LocalLauncher) -> None:
    (_, n1), (_, h1) = _cluster(netns_launcher, JOB)
    done = netns_launcher.partition_node(JOB, n1, seconds=0.5)
    assert done["partitioned"] is True and done["heals_in_s"] == 0.5
    _wait("the link came back up", lambda: not netns_launcher.fabric.is_partitioned(h1))


@needs_netns
def test_a_heal_cancels_the_timer_of_an_earlier_fault(netns_launcher: LocalLauncher) -> None:
    """The old timer must never undo a later fault: partition for 0.2 s, heal, then
    partition for good; the first timer, had it survived, would have healed it."""
    (_, n1), (_, h1) = _cluster(netns_launcher, JOB)
    netns_launcher.partition_node(JOB, n1, seconds=0.2)
    netns_launcher.heal_node(JOB, n1)
    netns_launcher.partition_node(JOB, n1)
    timers = netns_launcher.__dict__["_link_timers"]
    assert h1 not in timers  # nothing is armed to heal the standing partition
    assert netns_launcher.fabric.is_partitioned(h1)


@needs_netns
def test_slow_link_shapes_both_ends_and_rate_zero_lifts_it(netns_launcher: LocalLauncher) -> None:
    import subprocess

    (_, n1), (_, h1) = _cluster(netns_launcher, JOB)
    host = netns_launcher.fabric.host(h1)
    done = netns_launcher.slow_link(JOB, n1, "20mbit")
    assert done["rate"] == "20Mbit" and done["partitioned"] is False

    def inside() -> str:
        cmd = ["tc", "-n", host.netns, "qdisc", "show", "dev", host.ifname, "root"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

    assert "tbf" in inside() and "20Mbit" in inside()
    lifted = netns_launcher.slow_link(JOB, n1, "0")
    assert lifted["rate"] is None and "tbf" not in inside()


@needs_netns
def test_a_bad_rate_is_refused_before_the_link_is_touched(netns_launcher: LocalLauncher) -> None:
    (_, n1), _ = _cluster(netns_launcher, JOB)
    with pytest.raises(ValueError, match="'20m'"):
        netns_launcher.slow_link(JOB, n1, "20m")
    assert netns_launcher.heal_node(JOB, n1)["rate"] is None


@needs_netns
def test_an_unknown_or_released_node_is_a_launch_error(netns_launcher: LocalLauncher) -> None:
    (_, n1), (_, h1) = _cluster(netns_launcher, JOB)
    with pytest.raises(LaunchError, match="no local node"):
        netns_launcher.partition_node(JOB, node_id_for(JOB, 1, 7))
    netns_launcher.fabric.remove_host(h1)
    with pytest.raises(LaunchError, match="released"):
        netns_launcher.heal_node(JOB, n1)


# --- the chaos route, through the real app ------------------------------------------------


def _running_job(client: Any, app: Any, launcher: LocalLauncher) -> str:
    from orchestrator.store.models import Attempt

    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code in (200, 201), r.text
    job = str(r.json()["id"])
    node_ids, hosts = _cluster(launcher, job)
    with app.state.sessionmaker() as s, s.begin():
        s.add(
            Attempt(
                job_id=job, number=1, cloud="local", region="local", instance_type="cpu",
                num_nodes=2, spot=True, knobs={}, started_at=datetime.now(UTC),
                state="running", launcher="local",
                handle={"cluster_name": f"{job}-a1", "node_ids": node_ids, "hosts": hosts},
            )
        )  # fmt: skip
    app.state.launcher = launcher
    return job


def test_the_route_refuses_link_chaos_on_loopback_with_409(client, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    launcher = LocalLauncher(tmp_path / "nodes", "http://127.0.0.1:9", lambda j, a: "t")
    job = _running_job(client, app, launcher)
    for body in (
        {"action": "partition", "node": 0},
        {"action": "slow-link", "node": 0, "rate": "20mbit"},
        {"action": "heal", "node": 0},
    ):
        r = client.post(f"/v1/jobs/{job}/chaos", json=body)
        assert r.status_code == 409, r.text
        assert "root and network namespaces" in r.json()["detail"]


@needs_netns
@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"action": "partition", "node": 5}, 404, "no node 5"),
        ({"action": "slow-link", "node": 1, "rate": "20m"}, 422, "'20m'"),
        ({"action": "slow-link", "node": 1, "rate": "-3mbit"}, 422, "'-3mbit'"),
        ({"action": "slow-link", "node": 1}, 422, "needs a rate"),
        ({"action": "partition", "node": 1, "rate": "1mbit"}, 422, "rate is for slow-link"),
    ],
    ids=["unknown-node", "bad-unit", "negative", "no-rate", "rate-on-partition"],
)
def test_the_route_refuses_what_it_cannot_do(  # type: ignore[no-untyped-def]
    client, app, netns_launcher: LocalLauncher, body, status, says
) -> None:
    job = _running_job(client, app, netns_launcher)
    r = client.post(f"/v1/jobs/{job}/chaos", json=body)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]  # a 422's is a list of {loc, msg, type} (#24)
    assert says in (detail if isinstance(detail, str) else " ".join(e["msg"] for e in detail))
    assert not any(
        netns_launcher.fabric.is_partitioned(h.name) for h in netns_launcher.fabric.hosts()
    )


@needs_netns
def test_the_route_says_what_it_did_to_which_link(  # type: ignore[no-untyped-def]
    client, app, netns_launcher: LocalLauncher
) -> None:
    job = _running_job(client, app, netns_launcher)
    fabric = netns_launcher.fabric
    r = client.post(f"/v1/jobs/{job}/chaos", json={"action": "partition", "node": 1})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["action"] == "partition" and doc["node_id"] == node_id_for(job, 1, 1)
    assert doc["host"] == "local-host1" and doc["link"] == fabric.host("local-host1").veth
    assert doc["partitioned"] is True and fabric.is_partitioned("local-host1")
    r = client.post(
        f"/v1/jobs/{job}/chaos", json={"action": "slow-link", "node": 0, "rate": "5mbit"}
    )
    assert r.status_code == 200 and r.json()["rate"] == "5Mbit", r.text
    r = client.post(f"/v1/jobs/{job}/chaos", json={"action": "heal", "node": 1})
    assert r.status_code == 200 and r.json()["partitioned"] is False
    assert not fabric.is_partitioned("local-host1")
    r = client.post(f"/v1/jobs/{job}/chaos", json={"action": "heal", "node": 0})
    assert r.json()["rate"] is None
