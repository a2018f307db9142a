"""Each framework integration in one process (world size 1, the default run): a
SIGTERM saves at the next step boundary and exits 75 with no step lost, the save is
the framework's own format committed with our manifest, and the resumed run ends
with the same weights as an uninterrupted one, bitwise. Plus the knobs after an OOM
in each framework's terms, global batch kept."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.contract import ExitCode
from tests.training.datagrams import Listener
from training.checkpoint import verify_checkpoint
from training.run import RunExit

MAX_STEPS = 6

#: framework -> (the example module, the extra's import, files its save must hold)
CASES = {
    "hf": (
        "hf_trainer",
        "transformers",
        {"model.safetensors", "optimizer.pt", "trainer_state.json"},
    ),
    "accelerate": ("accelerate_loop", "accelerate", {"model.safetensors", "optimizer.bin"}),
    "lightning": ("lightning_fit", "lightning", {"lightning.ckpt"}),
}


def _run_example(name: str, out: Path, env: dict[str, str], mp: pytest.MonkeyPatch) -> None:
    import importlib

    module = importlib.import_module(f"training.integrations.examples.{name}")
    for k, v in env.items():
        mp.setenv(k, v)
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(sys, "argv", [name, "--output-dir", str(out), "--max-steps", str(MAX_STEPS)])
    _reset_accelerate()
    try:
        module.main()
    finally:
        _reset_accelerate()


def _reset_accelerate() -> None:
    """Accelerate's state is per process (Trainer builds an Accelerator too): each
    run here is a process of its own would start without one."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)


def _weights(framework: str, out: Path) -> dict[str, Any]:
    if framework == "lightning":
        import torch

        return dict(torch.load(out / "final.ckpt", weights_only=False)["state_dict"])
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def _until_exit(listener: Listener, code: int, n: int) -> None:
    """Until the ``n``-th ``exit`` datagram with ``code`` is in (the last a run sends):
    the listener reads on a thread of its own, behind the run."""
    deadline = time.monotonic() + 10
    while sum(1 for d in list(listener.got) if d["type"] == "exit" and d["code"] == code) < n:
        assert time.monotonic() < deadline, f"no exit {code} datagram"
        time.sleep(0.01)


def _sigterm_at(listener: Listener, step: int) -> None:
    """SIGTERM this process once a progress datagram says ``step`` steps are done."""

    def watch() -> None:
        while not any(d["type"] == "progress" and d["step"] >= step for d in list(listener.got)):
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


@pytest.mark.parametrize("framework", list(CASES))
def test_sigterm_saves_the_frameworks_checkpoint_and_resumes_bitwise(
    framework, tmp_path, monkeypatch
):
    example, extra, must_hold = CASES[framework]
    pytest.importorskip(extra)
    _run_example(example, tmp_path / "plain", {"SKYRESUME_RUN_CHECKPOINT_URI": ""}, monkeypatch)
    uninterrupted = _weights(framework, tmp_path / "plain")

    ckpt = tmp_path / "ckpt"
    listener = Listener()
    env = {
        "SKYRESUME_RUN_CHECKPOINT_URI": f"file://{ckpt}",
        "SKYRESUME_RUN_CHECKPOINT_EVERY": "2",
        "SKYRESUME_RUN_PROGRESS_ADDR": listener.addr,
    }
    _sigterm_at(listener, 3)
    with pytest.raises(RunExit) as exc:
        _run_example(example, tmp_path / "run", env, monkeypatch)
    assert exc.value.exit_code is ExitCode.PREEMPTED_SAVED
    _until_exit(listener, int(ExitCode.PREEMPTED_SAVED), 1)
    last_done = max(d["step"] for d in listener.of("progress"))
    saved = max(d["step"] for d in listener.of("checkpoint"))
    assert saved == last_done, "the notice lost a step"
    manifest = verify_checkpoint(ckpt / f"step_{saved}")
    assert manifest.extra["framework"] == framework
    assert must_hold <= {f.path for f in manifest.files}  # the framework's own format
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".saving-")]

    _run_example(example, tmp_path / "run", env, monkeypatch)
    _until_exit(listener, int(ExitCode.OK), 1)
    got = listener.close()
    assert [d["step"] for d in got if d["type"] == "resumed"] == [0, saved]
    steps = [d["step"] for d in got if d["type"] == "progress"]
    assert steps == list(range(1, MAX_STEPS + 1)), "a step was lost or run twice"
    resumed = _weights(framework, tmp_path / "run")
    assert resumed.keys() == uninterrupted.keys()
    different = [k for k in uninterrupted if not resumed[k].equal(uninterrupted[k])]
    assert not different, f"{len(different)} tensors differ, first {different[:3]}"


def test_hf_knobs_keep_the_global_batch(monkeypatch):
    pytest.importorskip("transformers")
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
        session.run.release_signals()
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert trainer.get_total_train_batch_size(args) == 8  # the global batch kept
    assert args.gradient_checkpointing


def test_lightning_knobs_keep_the_global_batch(monkeypatch):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    import torch

    from training.integrations.lightning import ResumableDataLoader, apply_knobs
    from training.integrations.session import FrameworkRun

    monkeypatch.setenv("SKYRESUME_RUN_MICRO_BATCH", "3")
    trainer = pl.Trainer(accumulate_grad_batches=1, logger=False, enable_progress_bar=False)
    loader = ResumableDataLoader(torch.arange(48), batch_size=12)
    session = FrameworkRun("lightning")
    try:
        smaller = apply_knobs(trainer, loader, session)
    finally:
        session.run.release_signals()
    assert isinstance(smaller, ResumableDataLoader)
    assert (smaller.batch_size, trainer.accumulate_grad_batches) == (3, 4)
    # The same samples per optimizer step, in the same order.
    assert torch.cat(list(smaller)[:4]).tolist() == next(iter(loader)).tolist()


def test_the_integrations_touch_no_private_part_of_run():
    """training.integrations drives Run through its public surface (docs/training.md:
    Driving Run from a framework's loop): no ``run._x`` or ``.run._x`` anywhere, so a
    change inside Run cannot silently break a framework's loop."""
    import ast

    import training.integrations as pkg

    found = []
    for path in sorted(Path(pkg.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name == "run" and not node.attr.startswith("__"):
                found.append(f"{path.name}:{node.lineno}: {name}.{node.attr}")
    assert found == []


def test_accelerate_batch_plan_keeps_the_global_batch_before_the_accelerator(monkeypatch):
    """The loader is built before ``Accelerator``: the plan reads the job's global
    batch, the planner's micro-batch and torchrun's WORLD_SIZE from the environment."""
    pytest.importorskip("accelerate")
    from training.integrations.accelerate import batch_plan

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("SKYRESUME_RUN_GLOBAL_BATCH", "8")
    assert (batch_plan(2).micro_batch, batch_plan(2).grad_accum) == (2, 1)
    monkeypatch.setenv("SKYRESUME_RUN_MICRO_BATCH", "1")  # after an OOM
    plan = batch_plan(2)
    assert (plan.micro_batch, plan.grad_accum) == (1, 2)
    assert plan.micro_batch * plan.grad_accum * 4 == 8


def test_lightning_refuses_a_trainer_that_would_train_each_torchrun_process_alone(monkeypatch):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from training.integrations.lightning import fit

    monkeypatch.setenv("WORLD_SIZE", "4")  # what torchrun sets on 2 nodes x 2
    trainer = pl.Trainer(logger=False, enable_progress_bar=False)  # devices=1, num_nodes=1
    with pytest.raises(ValueError, match="torchrun started 4"):
        fit(trainer, pl.LightningModule())
