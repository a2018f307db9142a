"""Each framework integration (Hugging Face Trainer, Accelerate, Lightning) through
every fault in one run: ``skyresume serve`` with the local launcher, nodes that are
hosts of their own (network namespaces), the framework's template installing its
pinned extra, 2 nodes x 2 gloo ranks under torchrun, checkpoints in a real S3 server
(SeaweedFS) staged by each new node itself. The docs' script itself runs (paced:
tests/e2e/paced_example.py), a tiny GPT-2 built from a config, data made locally.

In sequence, each recovered by the service on its own:

1. a spot preemption notice on node 1: every rank saves the step it is at, no step
   is lost;
2. node 1 killed outright: resumed from the last periodic checkpoint, staged from S3
   by the replacement;
3. an OOM injected on rank 0: the memory planner's smaller per-device batch (1, from
   2) with the same global batch (8), in the framework's own terms.

Every resume is validated on every rank (the service's VALIDATE: each rank's resume
report). The final weights are compared with an uninterrupted run of the same script
(bare torchrun, no checkpoints): not bitwise, because after the OOM a step's gradient
is summed over two micro-batches of 1 instead of one of 2 per rank, which rounds
differently in float32 (the same samples, the same mean in exact arithmetic). So the
test also trains an uninterrupted run in micro-batches of 1 throughout, and holds the
run to no further from the uninterrupted weights than that split alone puts them
(SPLIT_MARGIN), and under an absolute ceiling (docs/integrations.md: Tested)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.demo import TINY_MODEL, api_get, api_post, job_spec, wait_for
from orchestrator.launchers.netns import Fabric
from tests.e2e.test_cloud_path_e2e import incidents, serving, step_detail
from tests.e2e.test_integrations_e2e import _nodes, _wait

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.timeout(600),
    pytest.mark.skipif(Fabric.unavailable_reason() is not None, reason="needs network namespaces"),
]

REPO = Path(__file__).resolve().parents[2]
#: framework -> (the docs' script, the extra it needs)
EXAMPLES = {
    "hf": ("hf_trainer", "transformers"),
    "accelerate": ("accelerate_loop", "accelerate"),
    "lightning": ("lightning_fit", "lightning"),
}
MAX_STEPS = 100
PACE_S = 0.25
#: The final weights may be this many times further from the uninterrupted run's than
#: those of a run in micro-batches of 1 throughout (the split's own effect, measured in
#: the same test), or FLOOR, whichever is more: the run switched split at the OOM
#: (about half way), and AdamW makes a rounding-sized gradient difference a full
#: lr-sized step for a parameter whose gradient is near zero, so this is not a norm.
SPLIT_MARGIN = 2.0
FLOOR = 1e-5
#: A ceiling on the difference, whatever the split alone measured.
ATOL = 2e-2


def _spec(home: Path, framework: str, uri: str | None) -> dict[str, Any]:
    example = EXAMPLES[framework][0]
    spec = job_spec(home, MAX_STEPS, uri)
    spec["task"] = {
        "template": framework,
        "framework": framework,
        # "out" is under each node's own home: nodes share no output directory.
        "command": f"{sys.executable} {REPO / 'tests/e2e/paced_example.py'} {PACE_S} "
        f"training.integrations.examples.{example} --output-dir out "
        f"--max-steps {MAX_STEPS} --batch-size 2",
    }
    spec["model"] = TINY_MODEL  # global batch 8 in micro-batches of 2 over 4 ranks
    spec["restarts"].update(max_restarts=6, heartbeat_timeout_s=15)
    return spec


def _final_weights(framework: str, out: Path) -> dict[str, Any]:
    if framework == "lightning":
        import torch

        return dict(torch.load(out / "final.ckpt", weights_only=True)["state_dict"])
    from safetensors.torch import load_file

    return dict(load_file(str(out / "final" / "model.safetensors")))


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _newest_output(home: Path, framework: str) -> Path:
    """The ``out`` of the node that wrote the final weights (rank 0's, last attempt)."""
    name = "final.ckpt" if framework == "lightning" else "final/model.safetensors"
    found = sorted(home.glob(f"local-nodes/**/out/{name}"), key=lambda p: p.stat().st_mtime)
    assert found, f"no {name} under {home / 'local-nodes'}"
    return found[-1].parents[1 if framework != "lightning" else 0]


def _logs_say(home: Path, pattern: str) -> bool:
    rx = re.compile(pattern)
    for p in home.glob("local-nodes/**/*.log"):
        if p.is_file() and rx.search(p.read_text(errors="replace")):
            return True
    return False


@pytest.mark.parametrize("framework", list(EXAMPLES))
def test_a_framework_run_survives_a_notice_a_node_kill_and_an_oom(tmp_path, framework):
    pytest.importorskip(EXAMPLES[framework][1])
    example = EXAMPLES[framework][0]
    env = {"SKYRESUME_LOCAL_GPU_MEMORY_GIB": "80"}  # so the model profile gets planned knobs
    with serving(tmp_path, s3=True, **env) as (http, svc):
        uri = svc.checkpoint_uri
        job = str(api_post(http, "/v1/jobs", _spec(tmp_path, framework, uri))["id"])
        end = time.monotonic() + 480

        def trained_past(number: int, steps: int) -> Any:
            return lambda st, n, v, s: n >= number and v is not None and s >= v + steps

        wait_for(http, job, "attempt 1 at step 8", trained_past(1, 8), end)
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "preempt", "node": 1})
        wait_for(http, job, "attempt 2 past its resume", trained_past(2, 8), end)
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "kill-node", "node": 1})
        wait_for(http, job, "attempt 3 past its resume", trained_past(3, 4), end)
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "oom", "node": 0, "rank": 0})
        st = wait_for(http, job, "the end", lambda st, n, v, s: st == "SUCCEEDED", end)
        assert st[0] == "SUCCEEDED", api_get(http, f"/v1/jobs/{job}")
        incs = incidents(http, job)
        attempts = api_get(http, f"/v1/jobs/{job}/attempts")["items"]

    assert [i["failure_class"] for i in incs] == ["preemption_notice", "node_lost", "cuda_oom"]
    notice, kill, oom = incs
    assert notice["steps_lost"] == 0, notice  # every rank saved the step it was at
    assert f"from {uri}/step_{kill['resumed_step']}" in step_detail(kill, "stage")
    assert oom["remedy"] == "replan_memory", oom
    for inc in incs:  # each rank's resume report, on all four
        assert f"all 4 ranks resumed at step {inc['resumed_step']}" in step_detail(
            inc, "validate"
        ), inc
    knobs = [(a["knobs"]["micro_batch"], a["knobs"]["grad_accum"]) for a in attempts]
    assert knobs[0] == (2, 1) and knobs[-1] == (1, 2), knobs
    assert {m * g * 4 for m, g in knobs} == {8}  # the global batch kept
    # The script trained on it, in the framework's terms (rank 0's log).
    assert _logs_say(tmp_path, r"batch_size 2 -> 1\b.*\(global batch 8 kept\)")

    # Uninterrupted: in micro-batches of 2 (the job's first knobs), and of 1 throughout.
    plain = {"SKYRESUME_RUN_CHECKPOINT_URI": ""}
    split = {**plain, "SKYRESUME_RUN_GLOBAL_BATCH": "8", "SKYRESUME_RUN_MICRO_BATCH": "1"}
    for name, env in (("plain", plain), ("split", split)):
        assert _wait(_nodes(tmp_path, name, env, example, MAX_STEPS), tmp_path, name) == [0, 0]
    uninterrupted = _final_weights(framework, tmp_path / "plain-node0" / "out")
    in_ones = _final_weights(framework, tmp_path / "split-node0" / "out")
    final = _final_weights(framework, _newest_output(tmp_path, framework))
    assert final.keys() == uninterrupted.keys() == in_ones.keys()
    worst = _max_diff(final, uninterrupted)
    split_alone = _max_diff(in_ones, uninterrupted)
    print(f"{framework}: max |w - w_uninterrupted| {worst:.3g}; the split alone {split_alone:.3g}")
    # Not bitwise (see the module), and no further off than the split alone makes a run.
    assert 0 < worst <= max(SPLIT_MARGIN * split_alone, FLOOR)
    assert worst <= ATOL
