"""Real torch.distributed.checkpoint saves on gloo ranks under torchrun."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from testkit import kill_tree, torchrun

from orchestrator.contract import parse_step_dir
from training.checkpoint import find_latest_complete, load_distributed, verify_checkpoint

WORKER = Path(__file__).with_name("dcp_worker.py")


def _torchrun(mode: str, root: Path, nproc: int = 2) -> subprocess.Popen:
    return torchrun(str(WORKER), mode, str(root), nproc=nproc, pythonpath=str(WORKER.parent))


@pytest.mark.slow
def test_two_rank_save_commits_and_loads_bit_exact_on_one_rank(tmp_path):
    proc = _torchrun("once", tmp_path)
    out = proc.communicate(timeout=180)[0].decode()
    # Both ranks returned from the save. (Once in many CI runs a rank aborted in
    # gloo's teardown *after* this point; the claim here is about the checkpoint,
    # which is checked below, so the exit status alone is not asserted.)
    assert "rank 0: committed" in out and "rank 1: committed" in out, out[-6000:]
    step_dir = tmp_path / "step_7"
    manifest = verify_checkpoint(step_dir)
    assert manifest.world_size == 2 and manifest.extra == {"note": "test"}
    sys.path.insert(0, str(WORKER.parent))
    from dcp_worker import model_state

    want = model_state(7)
    target = model_state(0)  # different values, same shapes: loading must overwrite them
    load_distributed(target, step_dir)  # one process reading a two-rank checkpoint
    for k, v in want["model"].items():
        assert torch.equal(target["model"][k], v), k
    assert int(target["step"]) == 7


@pytest.mark.slow
def test_sigkill_during_saves_never_leaves_a_partial_checkpoint_chosen(tmp_path):
    rng = random.Random(1234)
    for trial in range(4):
        root = tmp_path / f"t{trial}"
        proc = _torchrun("forever", root)
        # Wait for the first complete checkpoint, then kill at a random moment.
        deadline = time.monotonic() + 120
        while find_latest_complete(root, deep=False) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(rng.uniform(0.0, 1.5))
        kill_tree(proc.pid, signal.SIGKILL)  # torchrun and every rank at once
        proc.wait(timeout=30)
        found = find_latest_complete(root)
        assert found is not None
        verify_checkpoint(found.path)  # deep: every shard hashes to its manifest entry
        # Only saves newer than the chosen one may be partial (the one killed).
        for path, _reason in found.rejected:
            assert parse_step_dir(path.name) > found.manifest.step
