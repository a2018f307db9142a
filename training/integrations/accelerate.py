"""Accelerate loops under skyresume: ``AccelerateRun`` around ``save_state``/``load_state``.

    run = AccelerateRun(accelerator)            # after accelerator.prepare(...)
    start = run.restore()                       # load_state of the agreed step_<N>
    for step in run.steps(max_steps):           # SIGTERM: save_state on every rank, exit 75
        ...forward, accelerator.backward(loss)...
        run.report(loss=loss, grad_norm=norm)   # NaN/Inf anywhere: exit 76, before the update
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

A save is ``accelerator.save_state(dir)`` on every rank (Accelerate writes the
weights, optimizer, schedulers and samplers from the main process and each rank's
``random_states_<rank>.pkl``), committed as ``step_<N>`` with our manifest: the
directory opens with ``accelerator.load_state`` as usual. The step is saved with it,
as a registered checkpointing object, so a resume checks the step Accelerate
actually loaded against the manifest's on every rank.

Data position: ``restore()`` returns the step; the script skips that many steps'
micro-batches of its epoch with ``accelerator.skip_first_batches`` (what Accelerate's
own checkpointing example does with the step it parsed from a folder name).
Knobs: ``batch_plan(per_device, accumulation)``, before the DataLoader is built, gives
the per-device batch and the micro-batches per step after the memory planner's
micro-batch (a smaller one after an OOM), global batch kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from training.integrations.session import FrameworkRun, Resume, plan_knobs
from training.knobs import BatchPlan
from training.run import RunConfig


def batch_plan(per_device: int, accumulation: int = 1, **overrides: Any) -> BatchPlan:
    """The per-device batch and micro-batches per optimizer step to build the loader
    with (before ``Accelerator``): the job's global batch (else the script's own,
    per_device x accumulation x WORLD_SIZE) at the memory planner's micro-batch."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = plan_knobs(RunConfig.from_env(**overrides), world, per_device, accumulation)
    if plan.micro_batch != per_device and os.environ.get("RANK", "0") == "0":
        print(
            f"skyresume: the DataLoader's batch_size {per_device} -> {plan.micro_batch}, "
            f"{plan.grad_accum} micro-batches per step "
            f"(global batch {plan.per_rank_batch * world} kept)",
            flush=True,
        )
    return plan


class _StepCounter:
    """Saved by Accelerate with the rest (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])


class AccelerateRun:
    """An Accelerate loop's saves, resume, stop, reports and knobs."""

    def __init__(self, accelerator: Any, **overrides: Any) -> None:
        """Build it after ``accelerator.prepare``; ``overrides`` are ``RunConfig`` fields."""
        self.accelerator = accelerator
        self.session = FrameworkRun("accelerate", **overrides)
        self._counter = _StepCounter()
        accelerator.register_for_checkpointing(self._counter)
        self.resume: Resume | None = None
        self._restored = False

    @property
    def step(self) -> int:
        return self.session.step

    def batch_plan(self, per_device: int, accumulation: int = 1) -> BatchPlan:
        return self.session.batch_plan(per_device, accumulation)

    def restore(self) -> int:
        """Load the step every rank agrees on with ``accelerator.load_state`` (or start
        fresh); returns the step. Exits 78/77 on every rank as ``Run.restore`` does."""
        if self._restored:
            return self.step
        self.resume = self.session.restore()
        if self.resume is not None:
            self.accelerator.load_state(str(self.resume.path))
        loaded = self._counter.step if self.resume is not None else 0
        self.session.confirm_resumed(loaded, self.resume)
        optimizers = getattr(self.accelerator, "_optimizers", [])
        if optimizers:
            self.session.run.optimizer = optimizers[0]
        self._restored = True
        return loaded

    def steps(self, max_steps: int) -> Iterator[int]:
        """Each step to run, from the restored one to ``max_steps`` (see the module)."""
        run = self.session.run
        self.restore()
        while run.step < max_steps:
            if run.should_stop():
                if self.session.root is not None and self.session.last_saved != run.step:
                    self.save()
                self.session.exit_stopped()
            run.begin_step()
            yield run.step
            run.end_step()
            self._counter.step = run.step
            if self.session.save_due(run.step, max_steps):
                self.save()

    def report(self, *, loss: Any, grad_norm: Any = None) -> None:
        """After backward, before ``optimizer.step()``: NaN/Inf on any rank, exit 76."""
        self.session.run.report(loss=loss, grad_norm=grad_norm)

    def save(self) -> str | None:
        """``save_state`` of this step on every rank, committed (a collective)."""
        step = self.session.step
        self._counter.step = step
        src = self.session.saving_dir(step)
        self.accelerator.save_state(str(src))
        return self.session.commit(src, step)

    def finish(self) -> None:
        self.session.finish()
