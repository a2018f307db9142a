"""The recovery loop end to end: `skyresume serve` with the reconciler and the local
launcher, real agents, torchrun and CPU ranks on gloo, real failures injected.

Each test is a real multi-node run on this machine's cores, so they take minutes
together; they are marked ``e2e``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit import chaos_incident

from orchestrator.demo import DemoService, api_get, api_post, job_spec, run_demo, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def uninterrupted(tmp: Path, steps: int) -> Path:
    """The same training, 4 ranks on one torchrun, no skyresume and no failure."""
    out = tmp / "uninterrupted.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "training.examples.train_gpt",
            "--max-steps",
            str(steps),
            "--save-final",
            str(out),
        ],
        env=env,
        cwd=REPO,
        check=True,
        timeout=600,
        capture_output=True,
    )
    return out


def test_demo_recovers_from_a_preemption_and_a_node_kill_to_bitwise_identical_weights(tmp_path):
    """The README's main command: a notice loses zero steps, a kill resumes from the
    last periodic checkpoint, and the final weights equal an uninterrupted run's."""
    import torch

    home = tmp_path / "demo"
    assert run_demo(home=home, steps=120, timeout_s=800) == 0
    got = torch.load(home / "final_weights.pt", weights_only=True)
    want = torch.load(uninterrupted(tmp_path, 120), weights_only=True)
    assert got["step"] == want["step"] == 120
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"parameter {k} differs"


@pytest.fixture
def service(tmp_path):  # type: ignore[no-untyped-def]
    svc = DemoService(tmp_path)
    http = svc.wait_ready()
    yield http
    svc.stop()


def _submit(http, home: Path, steps: int, **restarts) -> str:  # type: ignore[no-untyped-def]
    spec = job_spec(home, steps)
    spec["restarts"].update(restarts)
    return api_post(http, "/v1/jobs", spec)["id"]


def test_a_hung_rank_is_caught_by_the_heartbeat_timeout_and_the_job_recovers(service, tmp_path):
    http = service
    job = _submit(http, tmp_path, 400, heartbeat_timeout_s=8)
    end = time.monotonic() + 600
    s = wait_for(http, job, "step 20", lambda st, n, v, step: v is not None and step >= 20, end)
    assert s[0] == "RUNNING"
    out = chaos_incident(http, job, {"action": "hang-rank", "node": 1, "rank": 3}, end)
    inc = out.incident
    assert inc["failure_class"] == "nccl_timeout", inc
    assert "no progress" in inc["message"]
    # Every peer stalls at its next collective with the frozen rank: rank 3 is named
    # among the silent ones (which stopped first is not observable from progress).
    named = {int(r) for r in re.findall(r"\b(\d+)\b", inc["message"].split("made")[0])}
    named |= {int(r) for r in re.findall(r"\d+", inc["message"].partition("Also silent:")[2])}
    assert 3 in named
    # The evidence was taken before the kill and is kept with the incident: every
    # rank's stack, and the frozen rank named as stopped.
    assert inc["evidence"], "no stacks were taken before the ranks were stopped"
    events = api_get(http, f"/v1/jobs/{job}/events?limit=500")["items"]
    n = out.before["number"]
    stacks = [e for e in events if e["kind"] == "evidence" and e["details"].get("attempt") == n]
    ranks = {r["rank"]: r for e in stacks for r in e["details"]["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert all(r["stack"] for r in ranks.values())
    assert any("rank 3 is stopped" in e["message"] for e in stacks)
    http.post(f"/v1/jobs/{job}/cancel")


def test_a_tampered_checkpoint_stops_the_job_with_the_reason_and_nothing_trains_on_it(
    service, tmp_path
):
    http = service
    spec = job_spec(tmp_path, 400)
    spec["checkpoint"]["every_steps"] = 20  # ~2 s apart: time to tamper before the next
    job = api_post(http, "/v1/jobs", spec)["id"]
    end = time.monotonic() + 600
    wait_for(http, job, "step 25", lambda st, n, v, step: v is not None and step >= 25, end)
    newest = _next_commit(tmp_path / "checkpoints", end)
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    api_post(http, f"/v1/jobs/{job}/chaos", {"action": "kill-node", "node": 1})
    s = wait_for(http, job, "the job to fail", lambda st, n, v, step: st == "FAILED", end)
    j = api_get(http, f"/v1/jobs/{job}")
    assert j["status"] == "FAILED"
    # The new nodes stage it themselves and refuse it, naming the shard; no rank starts.
    assert f"could not stage {newest.name}" in j["status_reason"]
    assert shard.name in j["status_reason"]
    attempts = api_get(http, f"/v1/jobs/{job}/attempts")["items"]
    assert attempts[-1]["validated_step"] is None, "nothing trained on a corrupt checkpoint"
    events = api_get(http, f"/v1/jobs/{job}/events?limit=1000")["items"]
    last = f"{job}-a{attempts[-1]['number']}-"
    assert not [e for e in events if e["kind"] == "rank_exit" and e["node_id"].startswith(last)]
    staged = [e for e in events if e["kind"] == "staged" and e["node_id"].startswith(last)]
    assert staged and not any(e["details"]["ok"] for e in staged)
    assert s[0] == "FAILED"


def _newest_step(root: Path) -> int:
    return max((int(p.parent.name[5:]) for p in root.glob("step_*/COMMIT")), default=-1)


def _next_commit(root: Path, deadline: float) -> Path:
    """The step directory of the next checkpoint to be committed, as soon as it is."""
    before = _newest_step(root)
    while time.monotonic() < deadline:
        now = _newest_step(root)
        if now > before:
            return root / f"step_{now}"
        time.sleep(0.05)
    raise AssertionError("no new checkpoint was committed")


def test_a_killed_agent_is_a_lost_node_and_its_orphaned_ranks_are_cleaned_up(service, tmp_path):
    """The agent dies alone: its ranks train on as orphans. The heartbeat timeout
    catches it, and the recovery releases the node whole, orphans included."""
    from orchestrator.launchers.local import node_pids

    http = service
    job = _submit(http, tmp_path, 400, heartbeat_timeout_s=8, grace_period_s=10)
    end = time.monotonic() + 600
    wait_for(http, job, "step 15", lambda st, n, v, step: v is not None and step >= 15, end)
    # The attempt training now: on a loaded machine an earlier one may have ended already.
    now = api_get(http, f"/v1/jobs/{job}/attempts")["items"][-1]
    node1 = now["nodes"][1]["node_id"]
    api_post(http, f"/v1/jobs/{job}/chaos", {"action": "kill-agent", "node": 1})
    assert node_pids(job, node1), "the ranks outlive their agent"
    after = now["number"] + 1
    wait_for(http, job, f"attempt {after} validated", lambda st, n, v, s: n >= after and v, end)
    incs = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
    (inc,) = [i for i in incs if i["attempt"] == now["number"]]
    assert inc["failure_class"] == "node_lost" and "no heartbeat" in inc["message"], inc
    assert node_pids(job, node1) == [], "the old node's orphaned ranks were killed"
    http.post(f"/v1/jobs/{job}/cancel")


def test_a_nan_rolls_back_to_the_last_good_checkpoint(service, tmp_path):
    """`chaos nan` reaches the ranks through the agent's control file; the ranks report
    a `nan` anomaly naming the step before any update is applied (and exit 76 unless
    the service's stop reaches them first), and the job resumes from the newest
    checkpoint older than that step."""
    http = service
    job = _submit(http, tmp_path, 400)
    end = time.monotonic() + 600
    wait_for(http, job, "step 15", lambda st, n, v, step: v is not None and step >= 15, end)
    inc = chaos_incident(http, job, {"action": "nan", "node": 0}, end).incident
    assert inc["failure_class"] == "nan_divergence" and inc["remedy"] == "rollback_last_good"
    events = api_get(http, f"/v1/jobs/{job}/events?limit=500")["items"]
    onsets = [e["details"]["step"] for e in events if e["kind"] == "anomaly"
              and e["failure_class"] == "nan_divergence"]  # fmt: skip
    assert onsets, "the ranks reported the NaN with its step"
    assert inc["resumed_step"] % 10 == 0 and inc["resumed_step"] < min(onsets)
    http.post(f"/v1/jobs/{job}/cancel")
