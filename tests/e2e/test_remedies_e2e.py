"""Each failure class gets its remedy, end to end: `skyresume serve` with the
reconciler and the local launcher, real agents, torchrun and CPU ranks on gloo, the
fault injected for real (`skyresume chaos ...` through the API), and the outcome
read back from the incidents and attempts the API serves."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from testkit import chaos_incident

from orchestrator.demo import TINY_MODEL, DemoService, api_get, api_post, job_spec, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def service(tmp_path):  # type: ignore[no-untyped-def]
    # Two regions (a stockout has somewhere to go), and nodes that declare a GPU's
    # memory, so a job with a model profile gets planned knobs.
    env = {"SKYRESUME_LOCAL_REGIONS": "local-a,local-b", "SKYRESUME_LOCAL_GPU_MEMORY_GIB": "80"}
    svc = DemoService(tmp_path, env=env)
    http = svc.wait_ready()
    yield http
    svc.stop()


def submit(http: Any, home: Path, steps: int, *, extra: str = "", **spec_kw: Any) -> str:
    spec = job_spec(home, steps)
    spec["task"]["command"] += extra
    for k, v in spec_kw.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict):
            spec[k].update(v)
        else:
            spec[k] = v
    return str(api_post(http, "/v1/jobs", spec)["id"])


def at_step(http: Any, job: str, step: int, end: float) -> None:
    wait_for(http, job, f"step {step}", lambda st, n, v, s: v is not None and s >= step, end)


def incidents(http: Any, job: str) -> list[dict[str, Any]]:
    return list(api_get(http, f"/v1/jobs/{job}/incidents")["items"])


def attempts(http: Any, job: str) -> list[dict[str, Any]]:
    return list(api_get(http, f"/v1/jobs/{job}/attempts")["items"])


def test_an_oom_is_replanned_to_smaller_settings_until_it_fits(service, tmp_path):
    """The script refuses a micro-batch above 1 the way a GPU too small does (CUDA's
    OOM at the first step): each OOM steps the memory planner down, the global batch
    kept, until the smaller micro-batch trains."""
    http = service
    job = submit(
        http, tmp_path, 300, extra=" --oom-above-micro-batch 1", model=TINY_MODEL,
        restarts={"max_restarts": 6},
    )  # fmt: skip
    end = time.monotonic() + 700
    wait_for(http, job, "a run past the OOMs", lambda st, n, v, s: v is not None and s >= 3, end)
    incs = incidents(http, job)
    assert incs and {i["failure_class"] for i in incs} == {"cuda_oom"}
    assert {i["remedy"] for i in incs} == {"replan_memory"}
    last = attempts(http, job)[-1]
    assert last["knobs"]["micro_batch"] == 1
    assert last["knobs"]["micro_batch"] * last["knobs"]["grad_accum"] * 4 == 8  # global batch
    http.post(f"/v1/jobs/{job}/cancel")


@pytest.mark.long  # CI runs it as a step of its own (.ci/run): the default run stays under 30 min
def test_an_oom_at_the_smallest_setting_fails_the_job_saying_so(service, tmp_path):
    http = service
    smallest = {**TINY_MODEL, "global_batch": 4, "micro_batch": 1}
    job = submit(
        http, tmp_path, 300, extra=" --oom-above-micro-batch 0", model=smallest,
        restarts={"max_restarts": 6},
    )  # fmt: skip
    end = time.monotonic() + 600
    wait_for(http, job, "the job to fail", lambda st, n, v, s: st == "FAILED", end)
    reason = api_get(http, f"/v1/jobs/{job}")["status_reason"]
    assert "out of memory again at the smallest setting" in reason
    assert all(i["failure_class"] == "cuda_oom" for i in incidents(http, job))


@pytest.mark.long  # CI runs it as a step of its own (.ci/run): the default run stays under 30 min
def test_a_persistent_loss_spike_rolls_back_to_a_checkpoint_older_than_its_onset(service, tmp_path):
    http = service
    job = submit(http, tmp_path, 400)
    end = time.monotonic() + 600
    at_step(http, job, 25, end)
    inc = chaos_incident(http, job, {"action": "spike", "node": 0}, end).incident
    assert inc["failure_class"] == "loss_spike" and inc["remedy"] == "rollback_last_good"
    events = api_get(http, f"/v1/jobs/{job}/events?limit=500")["items"]
    onsets = [
        e["details"].get("onset_step", e["details"].get("step"))
        for e in events
        if e["kind"] == "anomaly" and e["failure_class"] == "loss_spike"
    ]
    assert onsets and inc["resumed_step"] < min(onsets)
    assert inc["resumed_step"] % 10 == 0
    http.post(f"/v1/jobs/{job}/cancel")


def test_an_xid_keeps_the_job_off_the_host_that_reported_it(service, tmp_path):
    http = service
    job = submit(http, tmp_path, 400)
    end = time.monotonic() + 600
    at_step(http, job, 15, end)
    out = chaos_incident(http, job, {"action": "xid", "node": 1, "rank": 2}, end)
    inc = out.incident
    assert inc["failure_class"] == "gpu_hardware" and inc["remedy"] == "drain_node"
    bad = out.before["hosts"][1]
    assert bad in out.after["exclude_hosts"] and bad not in out.after["hosts"]
    http.post(f"/v1/jobs/{job}/cancel")


def test_a_transport_error_restarts_in_place_on_the_same_hosts(service, tmp_path):
    http = service
    job = submit(http, tmp_path, 400)
    end = time.monotonic() + 600
    at_step(http, job, 15, end)
    out = chaos_incident(http, job, {"action": "transport", "node": 0, "rank": 0}, end)
    inc = out.incident
    named = (inc["failure_class"], inc["remedy"])
    assert named == ("nccl_transport", "restart_in_place"), json.dumps(inc, indent=1)
    assert out.after["in_place"] and out.after["hosts"] == out.before["hosts"]
    launch = next(s for s in inc["steps"] if s["step"] == "launch")
    assert "restarted in place" in launch["detail"]
    # The peers' broken collectives are consequences, never the cause or a user error.
    assert all(c["failure_class"] != "user_code_error" for c in inc["consequences"])
    http.post(f"/v1/jobs/{job}/cancel")


def test_a_stockout_at_launch_cools_the_region_and_replans_into_another(service, tmp_path):
    http = service
    api_post(http, "/v1/chaos/stockout", {"region": "local-a", "seconds": 600})
    job = submit(http, tmp_path, 200)
    end = time.monotonic() + 600
    at_step(http, job, 3, end)
    (a,) = attempts(http, job)
    assert a["region"] == "local-b"
    events = api_get(http, f"/v1/jobs/{job}/events?limit=500")["items"]
    refused = [e for e in events if e["kind"] == "launch_failed" and e["details"].get("capacity")]
    assert refused and refused[0]["details"]["region"] == "local-a"
    assert "InsufficientInstanceCapacity" in refused[0]["message"]
    api_post(http, "/v1/chaos/stockout", {"region": "local-b", "seconds": 600})
    history = api_get(http, "/v1/placement-history")["items"]
    assert any(h["region"] == "local-a" and h["failure_class"] == "capacity_unavailable"
               for h in history)  # fmt: skip
    http.post(f"/v1/jobs/{job}/cancel")


def test_a_stockout_everywhere_fails_the_job_listing_what_was_tried(service, tmp_path):
    http = service
    for region in ("local-a", "local-b"):
        api_post(http, "/v1/chaos/stockout", {"region": region, "seconds": 600})
    job = submit(http, tmp_path, 200)
    end = time.monotonic() + 300
    wait_for(http, job, "the job to fail", lambda st, n, v, s: st == "FAILED", end)
    reason = api_get(http, f"/v1/jobs/{job}")["status_reason"]
    assert "no capacity anywhere" in reason and "local-a" in reason and "local-b" in reason


def test_the_same_user_error_twice_fails_fast_naming_the_exception(service, tmp_path):
    """A KeyError at step 15 comes back after the resume from step 10: the second
    identical exception ends the job, not the restart limit."""
    http = service
    job = submit(http, tmp_path, 400, extra=" --raise-keyerror-at-step 15")
    end = time.monotonic() + 600
    wait_for(http, job, "the job to fail", lambda st, n, v, s: st == "FAILED", end)
    reason = api_get(http, f"/v1/jobs/{job}")["status_reason"]
    assert "the same user code error 2 times: KeyError: 'input_ids'" in reason
    incs = incidents(http, job)
    assert [i["failure_class"] for i in incs] == ["user_code_error", "user_code_error"]
    assert len(attempts(http, job)) == 2


# Out of the default run for now: in one clean-clone CI run (of two) the SIGSTOPped
# rank's node was detected as node_lost before three straggler reports made it
# slow_peer (a race under load, left open in issue 12's note).
@pytest.mark.long
def test_a_consistently_slow_node_is_replaced_after_a_save(service, tmp_path):
    http = service
    job = submit(http, tmp_path, 600)
    end = time.monotonic() + 700
    at_step(http, job, 10, end)
    slow = {"action": "slow-rank", "node": 1, "rank": 2, "duty": 0.8, "seconds": 300}
    out = chaos_incident(http, job, slow, end)
    inc = out.incident
    assert inc["failure_class"] == "slow_peer" and inc["remedy"] == "drain_node"
    signal = next(s for s in inc["steps"] if s["step"] == "signal")
    assert "saved and stopped" in signal["detail"]
    assert out.before["hosts"][1] not in out.after["hosts"]
    http.post(f"/v1/jobs/{job}/cancel")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
