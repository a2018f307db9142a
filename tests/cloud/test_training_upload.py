"""The training script's upload tier against real S3 and GCS servers: a preempted
node's checkpoint is resumed on a fresh node (empty local disk), bitwise exact."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from testkit import torchrun

from orchestrator.cloud.storage import list_checkpoints

STEPS = 12


def _train(uri: str, local: Path, final: Path, *extra: str) -> subprocess.Popen:
    return torchrun(
        "-m",
        "training.examples.train_gpt",
        "--max-steps",
        str(STEPS),
        "--checkpoint-uri",
        uri,
        "--local-dir",
        str(local),
        "--checkpoint-every",
        "3",
        "--save-final",
        str(final),
        *extra,
    )


def _out(p: subprocess.Popen) -> str:
    return p.communicate(timeout=300)[0].decode()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_preempted_run_resumes_on_a_fresh_node_from_object_storage(backend, request, tmp_path):
    bucket = request.getfixturevalue("s3_env" if backend == "s3" else "gcs_env")
    uri = f"{backend}://{bucket}/run"
    base = _train(f"file://{tmp_path / 'base'}", tmp_path / "unused", tmp_path / "base.pt")
    out = _out(base)
    assert base.returncode == 0, out[-3000:]

    first = _train(uri, tmp_path / "node-a", tmp_path / "x.pt", "--step-sleep", "0.1")
    deadline = time.monotonic() + 120
    while not any(c.complete for c in list_checkpoints(uri)):
        assert first.poll() is None and time.monotonic() < deadline, "nothing uploaded"
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGTERM)
    out = _out(first)
    assert "stop requested; saved step" in out, out[-3000:]

    second = _train(uri, tmp_path / "node-b", tmp_path / "resumed.pt")
    out = _out(second)
    assert second.returncode == 0, out[-3000:]
    assert "staged step" in out
    a, b = torch.load(tmp_path / "base.pt"), torch.load(tmp_path / "resumed.pt")
    assert a["step"] == b["step"] == STEPS
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
