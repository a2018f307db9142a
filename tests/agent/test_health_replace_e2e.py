"""A node whose health check fails is replaced, never trained on: `skyresume serve`
with the reconciler and the local launcher, 2 nodes x 2 ranks of the reference GPT.

The nodes "have" one GPU each through a fake ``nvidia-smi`` on PATH (this machine
has none; the ranks still train on CPU): on node 1 of the first attempt it prints what
a GPU fallen off the bus prints (text from public issue threads), elsewhere a healthy
listing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from orchestrator.demo import DemoService, api_get, api_post, job_spec, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

FAKE_SMI = """#!/bin/sh
case "$SKYRESUME_LOCAL_NODE" in
  *-a1-n1)
    echo "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error"
    exit 0;;
esac
if [ "$1" = "-L" ]; then
  echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-67a571b1-79ee-1016-8ea3-c1fff3f1c1d2)"
else
  echo "0, 0"
fi
"""


@pytest.mark.long  # CI runs it as a step of its own (.ci/run): the default run stays under 30 min
def test_a_node_whose_health_check_fails_is_replaced_and_never_trained_on(tmp_path: Path):
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(FAKE_SMI)
    (bindir / "nvidia-smi").chmod(0o755)
    env = {
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "SKYRESUME_AGENT_EXPECT_GPUS": "1",  # the agents read it as --expect-gpus
        # The nodes' "image" has the fake tool and the expectation; nothing else of the
        # service's environment reaches them.
        "SKYRESUME_LOCAL_NODE_ENV": "PATH,SKYRESUME_AGENT_EXPECT_GPUS",
    }
    svc = DemoService(tmp_path, env=env)
    try:
        http = svc.wait_ready()
        job = api_post(http, "/v1/jobs", job_spec(tmp_path, 400))["id"]
        end = time.monotonic() + 600
        s = wait_for(http, job, "attempt 2", lambda st, n, v, step: n >= 2, end)
        assert s[1] >= 2, s

        def replaced() -> list[dict]:
            evs = api_get(http, f"/v1/jobs/{job}/events?limit=1000")["items"]
            done = {e["node_id"] for e in evs if e["kind"] in ("health_check", "rank_exit")}
            return evs if {f"{job}-a2-n0", f"{job}-a2-n1"} <= done else []

        while not (events := replaced()):
            assert time.monotonic() < end, "attempt 2's nodes never reported their checks"
            time.sleep(0.5)
        incidents = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
        http.post(f"/v1/jobs/{job}/cancel")
    finally:
        svc.stop()

    bad_node = f"{job}-a1-n1"
    health = {e["node_id"]: e for e in events if e["kind"] == "health_check"}
    assert health[bad_node]["failure_class"] == "health_check_failed"
    assert "Unable to determine the device handle" in health[bad_node]["message"]
    assert health[f"{job}-a1-n0"]["failure_class"] is None
    assert health[f"{job}-a2-n1"]["failure_class"] is None  # the replacement is healthy
    assert health[f"{job}-a2-n0"]["failure_class"] is None
    checks = {c["name"]: c["status"] for c in health[f"{job}-a2-n1"]["details"]["checks"]}
    assert checks["gpus"] == "pass"
    exits = {e["node_id"]: e for e in events if e["kind"] == "node_exit"}
    assert exits[bad_node]["details"]["exit_code"] == 69
    # Never trained on: no rank of the failed node ever ran.
    assert not [e for e in events if e["kind"] == "rank_exit" and e["node_id"] == bad_node]
    assert any(i["failure_class"] == "health_check_failed" for i in incidents), incidents
