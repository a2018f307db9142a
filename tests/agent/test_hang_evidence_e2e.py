"""A hung rank, end to end: `skyresume serve` with the reconciler and the local
launcher, 2 nodes x 2 torchrun ranks training the reference GPT on gloo. One rank is
frozen (`chaos hang-rank`, SIGSTOP); the heartbeat timeout opens an incident, the
stop asks for stacks, and every node's agent stores them before the kill."""

from __future__ import annotations

import time

import pytest

from orchestrator.agent import evidence as ev
from orchestrator.demo import DemoService, api_get, api_post, job_spec, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(ev.find_py_spy() is None, reason="py-spy is not installed"),
]


@pytest.mark.long  # CI runs it as a step of its own (.ci/run): the default run stays under 30 min
def test_a_hung_ranks_incident_holds_the_stacks_of_every_rank(tmp_path):
    svc = DemoService(tmp_path)
    try:
        http = svc.wait_ready()
        spec = job_spec(tmp_path, 400)
        spec["restarts"].update(heartbeat_timeout_s=8)
        job = api_post(http, "/v1/jobs", spec)["id"]
        end = time.monotonic() + 600
        s = wait_for(http, job, "step 20", lambda st, n, v, step: v is not None and step >= 20, end)
        assert s[0] == "RUNNING"
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "hang-rank", "node": 1, "rank": 3})
        s = wait_for(http, job, "attempt 2", lambda st, n, v, step: n >= 2, end)
        assert s[1] >= 2, s
        events = api_get(http, f"/v1/jobs/{job}/events?limit=1000")["items"]
        http.post(f"/v1/jobs/{job}/cancel")
    finally:
        svc.stop()

    (hang,) = [e for e in events if e["kind"] == "rank_hang"][:1]
    assert hang["failure_class"] == "nccl_timeout"
    evidence = [e for e in events if e["kind"] == "evidence" and e["details"].get("attempt") == 1]
    assert sorted(e["node_id"] for e in evidence) == [f"{job}-a1-n0", f"{job}-a1-n1"]
    assert all(e["id"] > hang["id"] for e in evidence)  # taken on the incident's stop
    ranks = {r["rank"]: r for e in evidence for r in e["details"]["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    for r in ranks.values():
        assert r["tool"] in ("py-spy", "py-spy --nonblocking") and r["stack"], r
        assert "train_gpt" in r["stack"]
    assert ranks[3]["state"] == "T" and ranks[3]["tool"] == "py-spy --nonblocking"
    n1 = next(e for e in evidence if e["node_id"].endswith("-n1"))
    assert "rank 3 is stopped (state T)" in n1["message"]
    # The frozen rank's peers wait for it in a collective (DDP's all-reduce in
    # backward, or an explicit one): the stacks say which.
    waiting = [r for k, r in ranks.items() if k != 3 and r["op"]]
    assert waiting, [(k, r["where"]) for k, r in ranks.items()]
