"""Steps per second of each framework under its skyresume integration against the
bare framework, on the same model, data and process, in one run.

    python bench/integrations.py [--steps 60] [--repeats 3] [--frameworks hf,accelerate,lightning]

Model: GPT2Config(n_layer=2, n_embd=64, n_head=2), random weights, batch 8 x 32
tokens, one process on CPU. The integration runs with the agent's progress address
set (one UDP datagram per step to a socket that never reads) and no checkpoint URI:
saves are the framework's own cost either way, so what is measured is the per-step
work skyresume adds (the stop and NaN agreements, the loss and grad norm reads, the
spike detector, the datagram). Bare and integrated runs alternate, ``--repeats``
times each after one warm-up of each; the ratio is of the medians (>= 0.98 wanted).
``cpu_ratio`` is the same ratio of steps per CPU second of this process, which other
processes' load moves far less than the wall clock (see ``_Clock``). Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ, BATCH, VOCAB = 32, 8, 256


class _Clock:
    """Wall time and this process's CPU time (every thread, user + system) from now.

    On a shared machine the wall figure moves with other work (2.8-10.3 steps/s
    between repeats at load 40 on 2 cores); the CPU figure is the work this process
    did, which another process's load slows far less. Both are reported."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def rates(self, steps: int) -> tuple[float, float]:
        """(steps per wall second, steps per CPU second)."""
        return (
            steps / (time.perf_counter() - self.wall),
            steps / (time.process_time() - self.cpu),
        )


def _model() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, n_positions=SEQ, vocab_size=VOCAB,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _ids(n: int) -> Any:
    import torch

    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))


def _hf(steps: int, integrated: bool, out: str) -> float:
    import torch
    from transformers import Trainer, TrainingArguments

    ids = _ids(steps * BATCH)

    class Tokens(torch.utils.data.Dataset[dict[str, Any]]):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": ids[i], "labels": ids[i]}

    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, report_to=[],
        use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=10_000,
    )  # fmt: skip
    trainer = Trainer(model=_model(), args=args, train_dataset=Tokens())
    t0 = _Clock()
    if integrated:
        from training.integrations.hf import train

        train(trainer)
    else:
        trainer.train()
    return t0.rates(steps)


def _accelerate(steps: int, integrated: bool, out: str) -> float:
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = _model()
    loader = torch.utils.data.DataLoader(_ids(steps * BATCH), BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    batches = iter(loader)
    t0 = _Clock()
    if integrated:
        from training.integrations.accelerate import AccelerateRun

        run = AccelerateRun(accelerator)
        for _ in run.steps(steps):
            batch = next(batches)
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            run.report(loss=loss, grad_norm=norm)
            opt.step()
            opt.zero_grad()
        run.finish()
    else:
        for _ in range(steps):
            batch = next(batches)
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return t0.rates(steps)


def _lightning(steps: int, integrated: bool, out: str) -> float:
    import lightning.pytorch as pl
    import torch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch: Any, idx: int) -> Any:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(
        max_steps=steps, default_root_dir=out, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0,
    )  # fmt: skip
    if integrated:
        from training.integrations.lightning import ResumableDataLoader, fit

        loader: Any = ResumableDataLoader(_ids(steps * BATCH), BATCH)
        t0 = _Clock()
        fit(trainer, Module(), loader)
    else:
        loader = torch.utils.data.DataLoader(_ids(steps * BATCH), BATCH)
        t0 = _Clock()
        trainer.fit(Module(), loader)
    return t0.rates(steps)


BENCHES: dict[str, Callable[[int, bool, str], tuple[float, float]]] = {
    "hf": _hf,
    "accelerate": _accelerate,
    "lightning": _lightning,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--frameworks", default="hf,accelerate,lightning")
    a = p.parse_args()
    import logging

    import torch

    torch.set_num_threads(1)  # the same share of the machine for both
    logging.disable(logging.WARNING)
    os.environ["HF_HUB_OFFLINE"] = "1"
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    os.environ["SKYRESUME_RUN_PROGRESS_ADDR"] = f"127.0.0.1:{sink.getsockname()[1]}"
    os.environ["SKYRESUME_RUN_CHECKPOINT_URI"] = ""
    result: dict[str, Any] = {"steps": a.steps, "repeats": a.repeats, "frameworks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.frameworks.split(","):
            bench = BENCHES[name]
            bench(10, False, tmp)  # warm-up: imports, first-call allocations
            bench(10, True, tmp)
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(a.repeats):
                runs[False].append(bench(a.steps, False, tmp))
                runs[True].append(bench(a.steps, True, tmp))
            bare, integrated = ([w for w, _ in runs[k]] for k in (False, True))
            bare_cpu, integrated_cpu = ([c for _, c in runs[k]] for k in (False, True))
            row = {
                "bare_steps_per_s": round(statistics.median(bare), 3),
                "integrated_steps_per_s": round(statistics.median(integrated), 3),
                "ratio": round(statistics.median(integrated) / statistics.median(bare), 4),
                "bare_all": [round(x, 3) for x in bare],
                "integrated_all": [round(x, 3) for x in integrated],
                # Steps per CPU second of this process: the same medians, less moved
                # by other processes' load (see _Clock).
                "cpu_ratio": round(
                    statistics.median(integrated_cpu) / statistics.median(bare_cpu), 4
                ),
                "bare_cpu_all": [round(x, 3) for x in bare_cpu],
                "integrated_cpu_all": [round(x, 3) for x in integrated_cpu],
            }
            result["frameworks"][name] = row
            print(
                f"{name}: bare {row['bare_steps_per_s']} steps/s, integrated "
                f"{row['integrated_steps_per_s']} steps/s, ratio {row['ratio']} "
                f"(per CPU second: {row['cpu_ratio']})",
                file=sys.stderr,
                flush=True,
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
