"""The Lightning integration under torchrun (2 gloo ranks, one node): skyresume sees
the world Lightning trains in. Lightning starts its process group only inside
``trainer.fit``; a session built before that took every process for rank 0 of a
world of 1, and at 100 steps a rank died on a FileNotFoundError writing a manifest
that only rank 0 may write (the Lightning case of tests/e2e/test_framework_faults_e2e.py)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from datagrams import Listener
from testkit import torchrun

from orchestrator.contract import Env
from training.checkpoint import step_dirs, verify_checkpoint

MAX_STEPS = 6


def _fit(tmp: Path, out: str, listener: Listener, mp: pytest.MonkeyPatch) -> str:
    for k, v in {
        Env.PROGRESS_ADDR: listener.addr,
        "SKYRESUME_RUN_CHECKPOINT_URI": f"file://{tmp / 'ckpt'}",
        "SKYRESUME_RUN_CHECKPOINT_EVERY": "2",
        # The job's global batch 8 in micro-batches of 1: 4 per step on each of 2 ranks.
        "SKYRESUME_RUN_GLOBAL_BATCH": "8",
        "SKYRESUME_RUN_MICRO_BATCH": "1",
        "HF_HUB_OFFLINE": "1",
    }.items():
        mp.setenv(k, v)
    proc = torchrun(
        "-m", "training.integrations.examples.lightning_fit",
        "--output-dir", str(tmp / out), "--max-steps", str(MAX_STEPS), "--batch-size", "2",
    )  # fmt: skip
    log = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, log[-4000:]
    return log


def _weights(out: Path) -> dict[str, Any]:
    import torch

    return dict(torch.load(out / "final.ckpt", weights_only=False)["state_dict"])


@pytest.mark.slow
@pytest.mark.e2e
def test_lightning_under_torchrun_saves_plans_and_resumes_as_one_world_of_two(
    tmp_path, monkeypatch
):
    pytest.importorskip("lightning")
    import torch

    first = Listener()
    log = _fit(tmp_path, "first", first, monkeypatch)
    got = first.close()

    # The knobs for 2 ranks: 8 = 2 ranks x micro-batch 1 x 4 (one rank would be 1 x 8).
    assert "accumulate_grad_batches 1 -> 4 (global batch 8 kept)" in log, log[-4000:]
    assert sorted(d["rank"] for d in got if d["type"] == "resumed") == [0, 1]
    # One committer, for a world of 2, at every periodic step.
    ckpts = [(d["step"], d["rank"], d["world_size"]) for d in got if d["type"] == "checkpoint"]
    assert ckpts == [(2, 0, 2), (4, 0, 2)], ckpts
    root = tmp_path / "ckpt"
    assert sorted(s for s, _ in step_dirs(root)) == [2, 4]
    for _s, d in step_dirs(root):
        assert verify_checkpoint(d).world_size == 2
    assert not [p for p in root.iterdir() if p.name.startswith(".saving-")]
    # Every rank's RNG states are in the save (rank 0's alone, one rank's world, before).
    saved = torch.load(root / "step_4" / "lightning.ckpt", weights_only=False)
    rng = [pickle.loads(t.numpy().tobytes()) for t in saved["skyresume_rng"]]
    assert len(rng) == 2 and all("torch" in r for r in rng)

    # The same run again resumes step 4 on both ranks and ends where the first did.
    again = Listener()
    _fit(tmp_path, "again", again, monkeypatch)
    got = again.close()
    resumed = {(d["rank"], d["step"]) for d in got if d["type"] == "resumed"}
    assert resumed == {(0, 4), (1, 4)}, resumed
    progress = sorted({d["step"] for d in got if d["type"] == "progress"})
    assert progress == [5, 6], progress
    a, b = _weights(tmp_path / "first"), _weights(tmp_path / "again")
    assert a.keys() == b.keys()
    different = [k for k in a if not a[k].equal(b[k])]
    assert not different, f"{len(different)} tensors differ, first {different[:3]}"
