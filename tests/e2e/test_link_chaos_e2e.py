"""A node's link cut for real, end to end: the service (reconciler on) with the local
launcher in netns mode on a private bridge, real agents, torchrun and gloo ranks in
network namespaces, the partition made by the kernel through ``POST .../chaos``.

What a partition must lead to: the node's heartbeats stop, so after the job's
heartbeat timeout it is ``node_lost`` and replaced; the job resumes from a
checkpoint complete before the cut (no checkpoint can complete after it: every save
is a collective over all ranks) and finishes; the cut node's processes do not live
on beside the new attempt."""

from __future__ import annotations

import contextlib
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.demo import api_get, api_post, job_spec, wait_for
from orchestrator.launchers.local import free_port, node_pids
from orchestrator.launchers.netns import Fabric

REASON = Fabric.unavailable_reason()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.long,
    pytest.mark.timeout(400),
    pytest.mark.skipif(REASON is not None, reason=f"no network fabric: {REASON}"),
]
HARNESS = Path(__file__).with_name("netns_service.py")


@pytest.fixture
def netns_service(tmp_path: Path) -> Iterator[tuple[httpx.Client, Path]]:
    home, port = tmp_path / "home", free_port()
    home.mkdir()
    bridge, subnet = f"srbre{secrets.token_hex(2)}", f"10.217.{random.randrange(256)}.0/24"
    log = open(tmp_path / "service.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), str(home), str(port), bridge, subnet],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "service.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < end, "the service did not become ready"
            time.sleep(0.2)
        token = (home / "token").read_text().strip()
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as http:
            yield http, home
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        Fabric(home / "local-nodes" / "fabric", bridge=bridge, subnet=subnet).teardown()


def _steps(http: httpx.Client, job: str) -> int:
    a = api_get(http, f"/v1/jobs/{job}/attempts")["items"][-1]
    return max((r.get("step") or -1 for n in a["nodes"] for r in n["ranks"]), default=-1)


def test_a_partitioned_node_is_lost_replaced_and_the_job_resumes_from_before_the_cut(
    netns_service: tuple[httpx.Client, Path], tmp_path: Path
) -> None:
    http, _ = netns_service
    spec: dict[str, Any] = job_spec(tmp_path, 160)
    spec["restarts"]["heartbeat_timeout_s"] = 10
    job = str(api_post(http, "/v1/jobs", spec)["id"])
    end = time.monotonic() + 330
    wait_for(http, job, "step 15", lambda st, n, v, s: v is not None and s >= 15, end)
    first = api_get(http, f"/v1/jobs/{job}/attempts")["items"][0]
    cut_node = first["nodes"][1]["node_id"]
    done = api_post(http, f"/v1/jobs/{job}/chaos", {"action": "partition", "node": 1})
    seen_at_cut = _steps(http, job)
    assert done["partitioned"] is True and done["host"] == first["hosts"][1]
    assert node_pids(job, cut_node), "a partition must leave the node's processes running"

    wait_for(http, job, "a validated attempt 2", lambda st, n, v, s: n >= 2 and v is not None, end)
    (inc,) = api_get(http, f"/v1/jobs/{job}/incidents")["items"][:1]
    assert inc["failure_class"] == "node_lost", inc
    confirm = next(s for s in inc["steps"] if s["step"] == "confirm_checkpoint")
    # Every rank was stuck in the step after the cut: no save could complete after it.
    assert inc["resumed_step"] is not None and inc["resumed_step"] <= seen_at_cut + 1
    assert f"step_{inc['resumed_step']}" in confirm["detail"]
    # The cut node was given back (the VM taken away): nothing of it trains on.
    deadline = time.monotonic() + 60
    while node_pids(job, cut_node) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not node_pids(job, cut_node)

    wait_for(http, job, "the end", lambda st, n, v, s: st == "SUCCEEDED", end)
    j = api_get(http, f"/v1/jobs/{job}")
    assert j["status"] == "SUCCEEDED", j
    # No later incident resumed from anything the cut attempt wrote after the cut.
    later = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
    assert all(i["attempt"] > inc["attempt"] for i in later if i["id"] != inc["id"])
