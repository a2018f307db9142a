"""The reference script under torchrun: interrupted runs end bitwise equal to an
uninterrupted one (with dropout, so every rank's RNG state must come back too).
A NaN's exit is in test_run.py (in one process, where the weights can be compared)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from testkit import kill_tree, torchrun

from orchestrator.contract import ExitCode
from training.checkpoint import find_latest_complete

STEPS = 16


def _train(
    tmp: Path, name: str, *extra: str, nproc: int = 2, dropout: str = "0.1"
) -> subprocess.Popen:
    return torchrun(
        "-m",
        "training.examples.train_gpt",
        "--max-steps",
        str(STEPS),
        "--checkpoint-uri",
        f"file://{tmp / name}",
        "--checkpoint-every",
        "4",
        "--save-final",
        str(tmp / f"{name}.pt"),
        "--dropout",
        dropout,
        *extra,
        nproc=nproc,
    )


def _finish(p: subprocess.Popen) -> str:
    out, _ = p.communicate(timeout=300)
    return out.decode()


def _assert_bitwise_equal(a: Path, b: Path) -> None:
    sa, sb = torch.load(a), torch.load(b)
    assert sa["step"] == sb["step"] == STEPS
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    for pid, st in sa["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["optim"]["state"][pid][k]), (pid, k)


def _wait_for_checkpoint(root: Path, p: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while find_latest_complete(root, deep=False) is None:
        assert p.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.e2e
def test_sigterm_and_sigkill_resumes_end_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    base = _train(tmp_path, "base")
    out = _finish(base)
    assert base.returncode == 0, out[-3000:]

    # SIGTERM mid-run: every rank saves at the same boundary and exits 75.
    run = _train(tmp_path, "term", "--step-sleep", "0.1")
    _wait_for_checkpoint(tmp_path / "term", run)
    time.sleep(0.35)
    os.killpg(run.pid, signal.SIGTERM)
    out = _finish(run)
    assert "stop requested; saved step" in out, out[-3000:]
    assert f"exitcode  : {int(ExitCode.PREEMPTED_SAVED)}" in out or run.returncode != 0
    resumed = _train(tmp_path, "term")
    out = _finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    _assert_bitwise_equal(tmp_path / "base.pt", tmp_path / "term.pt")

    # SIGKILL of the whole node (no save): resume from the last periodic checkpoint.
    run = _train(tmp_path, "kill", "--step-sleep", "0.1")
    _wait_for_checkpoint(tmp_path / "kill", run)
    time.sleep(0.5)
    kill_tree(run.pid, signal.SIGKILL)
    run.wait(timeout=30)
    resumed = _train(tmp_path, "kill")
    out = _finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    _assert_bitwise_equal(tmp_path / "base.pt", tmp_path / "kill.pt")


@pytest.mark.slow
@pytest.mark.e2e
def test_four_rank_checkpoint_resumes_on_two_ranks_with_the_same_global_batch(tmp_path):
    # 4 DDP ranks stop at step 8 (a final periodic save at 8 is skipped, so stop at 9
    # and resume from 8), then 2 FSDP2 ranks finish (DCP reshards the replicated
    # state into shards); compare with a 2-rank DDP run throughout.
    # No dropout here: 4 and 2 ranks draw different masks by design (rng.py).
    base = _train(tmp_path, "two", nproc=2, dropout="0")
    out = _finish(base)
    assert base.returncode == 0, out[-3000:]
    first = _train(tmp_path, "re", "--max-steps", "9", nproc=4, dropout="0")
    out = _finish(first)
    assert first.returncode == 0, out[-3000:]
    found = find_latest_complete(tmp_path / "re")
    assert found is not None and (found.manifest.step, found.manifest.world_size) == (8, 4)
    second = _train(tmp_path, "re", "--fsdp", nproc=2, dropout="0")  # and DDP -> FSDP2
    out = _finish(second)
    assert second.returncode == 0, out[-3000:]
    a, b = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "re.pt")
    assert a["step"] == b["step"] == STEPS
    # Same samples per step, so the same math; only the all-reduce order differs,
    # which Adam amplifies a little. Different samples would differ by ~1e-1.
    num = sum(((a["model"][k] - b["model"][k]) ** 2).sum() for k in a["model"])
    den = sum((a["model"][k] ** 2).sum() for k in a["model"])
    assert float((num / den) ** 0.5) < 1e-4
