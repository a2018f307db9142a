"""The Hugging Face Trainer integration in one process (gloo-free: world size 1):
SIGTERM saves at the next step boundary and exits 75, the committed save is Trainer's
own directory with our manifest, and the resumed run ends with the same weights as
an uninterrupted one, bitwise."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from orchestrator.contract import ExitCode
from tests.training.datagrams import Listener
from training.checkpoint import verify_checkpoint
from training.run import RunExit

MAX_STEPS = 8


def _run_example(tmp: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from training.integrations.examples import hf_trainer

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(
        sys, "argv", ["hf_trainer", "--output-dir", str(tmp), "--max-steps", str(MAX_STEPS)]
    )
    hf_trainer.main()


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def _sigterm_at(listener: Listener, step: int) -> threading.Thread:
    """SIGTERM this process once a progress datagram says ``step`` steps are done."""

    def watch() -> None:
        while True:
            if any(d["type"] == "progress" and d["step"] >= step for d in list(listener.got)):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            threading.Event().wait(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_hf_sigterm_saves_commits_and_resumes_to_the_same_weights(tmp_path, monkeypatch):
    _run_example(tmp_path / "plain", {"SKYRESUME_RUN_CHECKPOINT_URI": ""}, monkeypatch)
    uninterrupted = _weights(tmp_path / "plain")

    ckpt = tmp_path / "ckpt"
    listener = Listener()
    env = {
        "SKYRESUME_RUN_CHECKPOINT_URI": f"file://{ckpt}",
        "SKYRESUME_RUN_CHECKPOINT_EVERY": "3",
        "SKYRESUME_RUN_PROGRESS_ADDR": listener.addr,
    }
    _sigterm_at(listener, 4)
    with pytest.raises(RunExit) as exc:
        _run_example(tmp_path / "run", env, monkeypatch)
    assert exc.value.exit_code is ExitCode.PREEMPTED_SAVED
    last_done = max(d["step"] for d in listener.of("progress"))
    saved = max(d["step"] for d in listener.of("checkpoint"))
    assert saved == last_done, "the notice lost a step"  # every step run is saved
    m = verify_checkpoint(ckpt / f"step_{saved}")
    names = {f.path for f in m.files}
    # Trainer's own format: what Trainer.train(resume_from_checkpoint=...) reads.
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= names
    assert (
        json.loads((ckpt / f"step_{saved}" / "trainer_state.json").read_text())["global_step"]
        == saved
    )
    assert not list((tmp_path / "run").glob("checkpoint-*")), "an uncommitted copy was left"

    _run_example(tmp_path / "run", env, monkeypatch)
    got = listener.close()
    resumed = [d for d in got if d["type"] == "resumed"]
    assert [d["step"] for d in resumed] == [0, saved]
    assert resumed[-1]["manifest_digest"]
    steps = [d["step"] for d in got if d["type"] == "progress"]
    assert steps == list(range(1, saved + 1)) + list(range(saved + 1, MAX_STEPS + 1))
    resumed_w = _weights(tmp_path / "run")
    assert resumed_w.keys() == uninterrupted.keys()
    for k in uninterrupted:
        assert resumed_w[k].equal(uninterrupted[k]), k


def test_hf_knobs_keep_the_global_batch(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from training.integrations.hf import apply_knobs
    from training.integrations.session import FrameworkRun

    monkeypatch.setenv("SKYRESUME_RUN_MICRO_BATCH", "2")
    monkeypatch.setenv("SKYRESUME_RUN_ACTIVATION_CHECKPOINT_EVERY", "1")
    args = TrainingArguments(
        output_dir="/nonexistent", per_device_train_batch_size=8, gradient_accumulation_steps=1,
        report_to=[], use_cpu=True,
    )  # fmt: skip
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    trainer = Trainer(model=model, args=args)
    session = FrameworkRun("hf")
    try:
        apply_knobs(trainer, session)
    finally:
        session.run._stop.restore()
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert trainer.get_total_train_batch_size(args) == 8  # the global batch kept
    assert args.gradient_checkpointing
