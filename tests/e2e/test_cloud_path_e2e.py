"""The cloud path, end to end on this machine: ``skyresume serve`` with the local
provisioner running the rendered SkyPilot task on nodes that are hosts of their own
(network namespaces), launches that take time and fail, checkpoints in object
storage staged by each node itself, and healthy nodes kept through an incident.

Real processes throughout: the service, the boot process, each node's setup (the
agent installed from the service's own wheel), agents, torchrun, gloo ranks, a real
S3 server (SeaweedFS) and a real GCS emulator."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.demo import DemoService, api_get, api_post, job_spec, wait_for
from orchestrator.launchers.netns import Fabric

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(Fabric.unavailable_reason() is not None, reason="needs network namespaces"),
]


@contextlib.contextmanager
def serving(home: Path, *, s3: bool = False, **env: str) -> Iterator[tuple[Any, DemoService]]:
    svc = DemoService(home, env={"SKYRESUME_LOCAL_NETWORK": "netns", **env}, s3=s3)
    try:
        yield svc.wait_ready(), svc
    finally:
        svc.stop()


def submit(http: Any, home: Path, steps: int, uri: str | None = None, **restarts: Any) -> str:
    spec = job_spec(home, steps, uri)
    spec["restarts"].update(restarts)
    return str(api_post(http, "/v1/jobs", spec)["id"])


def events(http: Any, job: str) -> list[dict[str, Any]]:
    return list(api_get(http, f"/v1/jobs/{job}/events")["items"])


def incidents(http: Any, job: str) -> list[dict[str, Any]]:
    return list(api_get(http, f"/v1/jobs/{job}/incidents")["items"])


def step_detail(inc: dict[str, Any], step: str) -> str:
    return str(next(s for s in inc["steps"] if s["step"] == step)["detail"])


@pytest.mark.long  # CI runs it as a step of its own (.ci/run): the default run stays under 30 min
def test_a_provisioning_longer_than_the_register_timeout_succeeds(tmp_path):
    """A launch that takes 12 s with a 4 s register timeout: the clock for a node to
    register starts when the launch is up, so nothing is declared lost."""
    env = {"SKYRESUME_LOCAL_PROVISION_DELAY_S": "12", "SKYRESUME_REGISTER_TIMEOUT_S": "4"}
    with serving(tmp_path, **env) as (http, _svc):
        job = submit(http, tmp_path, 20)
        end = time.monotonic() + 240
        st = wait_for(http, job, "the end", lambda st, n, v, step: st == "SUCCEEDED", end)
        assert st[0] == "SUCCEEDED", api_get(http, f"/v1/jobs/{job}")
        assert incidents(http, job) == []
        assert not [e for e in events(http, job) if e["kind"] == "node_lost"]


def test_a_stockout_while_provisioning_is_replanned_into_another_region(tmp_path):
    """The region runs out of capacity after the launch was accepted: the request
    fails inside the provider, the region cools down, the job moves to the other."""
    env = {"SKYRESUME_LOCAL_REGIONS": "r-a,r-b", "SKYRESUME_LOCAL_PROVISION_DELAY_S": "4"}
    with serving(tmp_path, **env) as (http, _svc):
        job = submit(http, tmp_path, 20)
        end = time.monotonic() + 240
        wait_for(http, job, "attempt 1", lambda st, n, v, step: n >= 1, end)
        region = api_get(http, f"/v1/jobs/{job}/attempts")["items"][0]["region"]
        api_post(http, "/v1/chaos/stockout", {"region": region, "seconds": 600})
        wait_for(http, job, "the end", lambda st, n, v, step: st == "SUCCEEDED", end)
        kinds = [e["kind"] for e in events(http, job)]
        assert "launch_failed" in kinds and "replanned" in kinds
        failed = next(e for e in events(http, job) if e["kind"] == "launch_failed")
        assert "InsufficientInstanceCapacity" in failed["message"]
        (a,) = api_get(http, f"/v1/jobs/{job}/attempts")["items"]
        assert a["region"] != region


def _kill_and_recover(tmp_path: Path, uri_of: Any, **env: str) -> None:
    with serving(tmp_path, s3=uri_of is None, **env) as (http, svc):
        uri = svc.checkpoint_uri if uri_of is None else uri_of(svc)
        job = submit(http, tmp_path, 60, uri, heartbeat_timeout_s=15)
        end = time.monotonic() + 420
        s = wait_for(http, job, "step 25", lambda st, n, v, step: v is not None and step >= 25, end)
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "kill-node", "node": 1})
        wait_for(http, job, "the end", lambda st, n, v, step: st == "SUCCEEDED", end)
        (inc,) = incidents(http, job)
        assert inc["failure_class"] == "node_lost" and inc["resumed_step"] >= 20
        assert "keep the 1 healthy node" in step_detail(inc, "select_replacement")
        assert f"from {uri}/step_{inc['resumed_step']}" in step_detail(inc, "stage")
        assert s[1] == 1


@pytest.mark.long  # CI runs it as a step of its own (.ci/run): the default run stays under 30 min
def test_a_node_kill_recovers_from_s3_keeping_the_healthy_node(tmp_path):
    _kill_and_recover(tmp_path, None)


@pytest.mark.long
def test_a_node_kill_recovers_from_gcs(tmp_path):
    from gcp_storage_emulator.server import create_server
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from orchestrator.demo import node_gateway
    from orchestrator.launchers.local import free_port

    port = free_port()
    gateway, _ = node_gateway(tmp_path)
    endpoint = f"http://{gateway}:{port}"
    server: Any = None

    def uri_of(svc: DemoService) -> str:  # the bridge is up once the service is
        nonlocal server
        server = create_server(gateway, port, in_memory=True)
        server.start()
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint
        storage.Client(project="t", credentials=AnonymousCredentials()).create_bucket("ckpt")
        return "gs://ckpt/job"

    try:
        _kill_and_recover(tmp_path, uri_of, STORAGE_EMULATOR_HOST=endpoint)
    finally:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
        if server is not None:
            server.stop()


@pytest.mark.long
def test_a_partitioned_node_that_comes_back_after_the_job_moved_on_is_refused(tmp_path):
    """A launcher that cannot give back one node (as on SkyPilot) keeps the healthy
    node beside a replacement while the cut-off one lives on; healed, its agent is
    told its attempt is over and stops its ranks: no second copy trains, and nothing
    it saves is resumed."""
    env = {"SKYRESUME_LOCAL_RELEASE_SINGLE_NODES": "false"}
    with serving(tmp_path, s3=True, **env) as (http, svc):
        job = submit(http, tmp_path, 80, svc.checkpoint_uri, heartbeat_timeout_s=10,
                     grace_period_s=5)  # fmt: skip
        end = time.monotonic() + 420
        wait_for(http, job, "step 25", lambda st, n, v, step: v is not None and step >= 25, end)
        cut = api_post(http, f"/v1/jobs/{job}/chaos", {"action": "partition", "node": 1})
        node_id = cut["node_id"]
        wait_for(http, job, "attempt 2", lambda st, n, v, step: n >= 2 and v is not None, end)
        (inc,) = incidents(http, job)
        assert inc["failure_class"] == "node_lost" and inc["node_id"] == node_id
        from orchestrator.launchers.local import node_pids

        assert node_pids(job, node_id)  # not given back: it lives on, cut off
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "heal", "node": 1, "attempt": 1})
        deadline = time.monotonic() + 60
        while node_pids(job, node_id) and time.monotonic() < deadline:
            time.sleep(1)
        assert not node_pids(job, node_id), "the healed node of the old attempt still runs"
        wait_for(http, job, "the end", lambda st, n, v, step: st == "SUCCEEDED", end)
        assert len(incidents(http, job)) == 1
        assert api_get(http, f"/v1/jobs/{job}")["status"] == "SUCCEEDED"


@pytest.mark.long
def test_a_node_behind_a_slow_link_is_found_by_its_uploads_and_replaced(tmp_path):
    """tc shapes node 1's link to 2 mbit: every rank's step slows alike (one
    all-reduce), but node 1's checkpoint uploads crawl; after three such checkpoints
    its node is replaced beside the healthy one."""
    with serving(tmp_path, s3=True) as (http, svc):
        job = submit(http, tmp_path, 140, svc.checkpoint_uri)
        end = time.monotonic() + 500
        wait_for(http, job, "step 15", lambda st, n, v, step: v is not None and step >= 15, end)
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "slow-link", "node": 1, "rate": "2mbit"})
        wait_for(http, job, "attempt 2", lambda st, n, v, step: n >= 2 and v is not None, end)
        (inc,) = incidents(http, job)
        assert inc["failure_class"] == "slow_peer" and inc["node_id"].endswith("-a1-n1")
        assert "keep the 1 healthy node" in step_detail(inc, "select_replacement")
        found = [e["details"]["detail"] for e in events(http, job) if e["kind"] == "anomaly"]
        links = [d for d in found if d.get("kind") == "slow_link"]
        assert links and all(d["slow_rank"] in (2, 3) for d in links)  # node 1's ranks
        assert "uploaded its shards" in links[0]["detail"]
        wait_for(http, job, "the end", lambda st, n, v, step: st == "SUCCEEDED", end)


@pytest.mark.long
def test_a_service_restart_costs_no_training_and_nodes_keep_their_metadata(tmp_path):
    """The service is restarted (SIGTERM, as a process manager does) while its nodes
    train: they keep training through it, as a cloud's VMs outlive the control plane;
    the new service picks them up, and a preemption notice sent after the restart still
    reaches the node at its metadata address and is recovered from with nothing lost."""
    import signal

    with serving(tmp_path) as (http, svc):
        job = submit(http, tmp_path, 400)
        end = time.monotonic() + 500
        s = wait_for(http, job, "step 10", lambda st, n, v, step: v is not None and step >= 10, end)
        assert s[:2] == ("RUNNING", 1)
        http = svc.restart(signal.SIGTERM)
        after = s[3] + 20  # heartbeats with progress reach the new service
        s = wait_for(http, job, "progress", lambda st, n, v, step: step >= after, end)
        assert s[:2] == ("RUNNING", 1), "the restart cost an attempt"
        assert incidents(http, job) == []
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "preempt", "node": 1})
        wait_for(http, job, "the end", lambda st, n, v, step: st == "SUCCEEDED", end)
        # The first incident (a loaded machine may add a straggler report later).
        inc = incidents(http, job)[0]
        assert inc["failure_class"] == "preemption_notice", inc
        assert inc["steps_lost"] == 0, inc
