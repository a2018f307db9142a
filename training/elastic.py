"""Elastic world sizes: the batch and learning-rate math of a run that trains on
fewer ranks than its spec's full world, and the two torch adapters that apply it.

An elastic job (``min_nodes`` below ``num_nodes``) that loses a node restarts its
ranks on the survivors, at a smaller world size ``w``, and grows back to the full
one (``FULL_WORLD_SIZE``) later, each time from a complete checkpoint. The spec's
global batch and learning rate are for the full world; ``ElasticBatch`` says what
a smaller world trains with:

* ``keep`` (the default): the global batch is the spec's on every world; each rank
  takes ``global_batch / w`` samples a step and accumulates more. Every step sees
  exactly the samples, and does exactly the math, of an uninterrupted full run
  (up to the order of float sums in the all-reduce). The learning rate is left as
  the user's scheduler sets it.
* ``scale``: each rank's share stays ``global_batch / full``, so the global batch is
  ``global_batch * w / full`` and a step consumes fewer samples. The learning rate
  is multiplied by ``w / full`` (``ElasticLR.LINEAR``) or its square root
  (``SQRT``), and the user's scheduler counts full global batches of samples, not
  steps: its position is ``samples // full_global_batch``.

Pure: ``ElasticBatch``, ``ElasticLR``, ``ElasticPlan`` and ``plan_elastic`` (no
torch). Acting on torch objects (called by ``Run``): ``scale_lr_during_step`` and
``SamplesSchedule``.

Why the factor is applied only inside ``optimizer.step()``: the param groups'
``lr``, the scheduler's state and therefore every checkpoint hold the *full
world's* learning rate at all times. A checkpoint saved at world 2 and resumed at
world 3 then carries no factor to undo; had the factor been written into the
param groups, a chainable scheduler (``StepLR``, ``ExponentialLR``: the next lr is
the current one times gamma) would compound it at every resume, and ``LambdaLR``
(the next lr is base x lambda) would drop it at the next ``sched.step()``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from orchestrator.contract import StrEnum  # enum.StrEnum is 3.11+; ranks run on 3.9+


class ElasticBatch(StrEnum):
    """What a world smaller than the full one trains with (``Env.ELASTIC_BATCH``)."""

    KEEP = "keep"  # the spec's global batch on any world: each rank accumulates more
    SCALE = "scale"  # each rank's share stays: global batch x world / full, lr follows


class ElasticLR(StrEnum):
    """How the learning rate follows a scaled global batch (``Env.ELASTIC_LR``)."""

    LINEAR = "linear"  # x world / full
    SQRT = "sqrt"  # x sqrt(world / full)


@dataclass(frozen=True)
class ElasticPlan:
    """One world size's batch and learning-rate factor."""

    world_size: int
    full_world_size: int
    """The world ``full_global_batch`` and the learning rate are for."""
    batch: ElasticBatch
    full_global_batch: int | None
    """The spec's global batch (for the full world); None: the run has none."""
    global_batch: int | None
    """Samples per optimizer step on this world."""
    lr_factor: float
    """Multiplies the scheduler's learning rate during ``optimizer.step()``."""

    @property
    def batch_follows_world(self) -> bool:
        """A checkpoint's global batch may differ from this world's (scale mode): the
        data position is in samples, so it still names the same data."""
        return self.batch is ElasticBatch.SCALE


def plan_elastic(
    full_global_batch: int | None,
    world_size: int,
    full_world_size: int | None = None,
    batch: ElasticBatch = ElasticBatch.KEEP,
    lr: ElasticLR = ElasticLR.LINEAR,
) -> ElasticPlan:
    """The batch and lr factor for ``world_size``; ``full_world_size`` None means the
    run is not elastic (this world is the full one). Raises ValueError naming the
    numbers when the batch does not split evenly."""
    if world_size < 1:
        raise ValueError(f"world size must be positive, got {world_size}")
    full = world_size if full_world_size is None else full_world_size
    if full < 1:
        raise ValueError(f"full world size must be positive, got {full}")
    g = full_global_batch
    if batch is ElasticBatch.KEEP:
        if g is not None and g % world_size:
            raise ValueError(
                f"global batch {g} is not divisible by the world size {world_size} "
                f"(full world {full}, elastic batch keep: every world trains on the "
                "whole global batch)"
            )
        return ElasticPlan(world_size, full, batch, g, g, 1.0)
    if g is None:
        raise ValueError(
            "elastic batch scale needs the full world's global batch "
            "(SKYRESUME_RUN_GLOBAL_BATCH, or global_batch=) to scale it"
        )
    if g % full:
        raise ValueError(
            f"global batch {g} is not divisible by the full world size {full} "
            "(elastic batch scale: each rank's share is global batch / full world)"
        )
    ratio = world_size / full
    factor = ratio if lr is ElasticLR.LINEAR else math.sqrt(ratio)
    return ElasticPlan(world_size, full, batch, g, g // full * world_size, factor)


# --- torch adapters (Run calls them; they import nothing at module level) ----------


def refuse_unscalable(optimizer: Any, scheduler: Any) -> None:
    """Scale mode needs a torch optimizer (step hooks) and, if any, a torch
    ``LRScheduler`` that steps on its own position. Checked on every launch in scale
    mode, at the full world too, so a script that cannot follow a shrink fails at its
    first start rather than at the first lost node."""
    if not callable(getattr(optimizer, "register_step_pre_hook", None)):
        raise ValueError(
            f"elastic batch scale: the optimizer ({type(optimizer).__name__}) has no "
            "register_step_pre_hook, so the learning rate cannot follow the world size; "
            "use a torch.optim.Optimizer or elastic batch keep"
        )
    if scheduler is None:
        return
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if not isinstance(scheduler, LRScheduler) or isinstance(scheduler, ReduceLROnPlateau):
        raise ValueError(
            f"elastic batch scale: the scheduler ({type(scheduler).__name__}) is not a "
            "torch LRScheduler that steps on its position (ReduceLROnPlateau steps on a "
            "metric), so its position cannot follow the samples consumed; use elastic "
            "batch keep"
        )


def scale_lr_during_step(optimizer: Any, factor: float) -> tuple[Any, Any]:
    """Every param group's ``lr`` times ``factor`` for the duration of each
    ``optimizer.step()``, put back right after it (see the module doc for why).
    Returns the two hook handles."""
    saved: list[Any] = []

    def scale(opt: Any, _args: Any, _kwargs: Any) -> None:
        saved[:] = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = g["lr"] * factor  # a new value, never in place: a tensor lr is restored

    def restore(opt: Any, _args: Any, _kwargs: Any) -> None:
        for g, lr in zip(opt.param_groups, saved):  # no strict=: 3.10+
            g["lr"] = lr
        saved.clear()

    return optimizer.register_step_pre_hook(scale), optimizer.register_step_post_hook(restore)


class SamplesSchedule:
    """Keeps a torch ``LRScheduler`` at position ``samples // full_global_batch``
    (its ``last_epoch``) when a step consumes less than a full global batch.

    The user's loop calls ``sched.step()`` once per optimizer step, as for any run.
    Run snapshots the scheduler before each step (``before_step``) and, after it
    (``after_step``), puts the snapshot back and calls the scheduler's own ``step()``
    once per full global batch the samples crossed: zero or one time on a world
    smaller than the full one. Replaying ``step()`` rather than writing
    ``last_epoch`` keeps chainable schedulers (``StepLR``: lr x gamma) exact, not only
    closed-form ones (``LambdaLR``). Assumes the scheduler steps once per optimizer
    step (not per epoch); a full global batch is the unit its lambda counts in.
    """

    def __init__(self, scheduler: Any, full_global_batch: int) -> None:
        if full_global_batch < 1:
            raise ValueError(f"full global batch must be positive, got {full_global_batch}")
        self.scheduler = scheduler
        self.full_global_batch = full_global_batch
        self._before: tuple[dict[str, Any], list[Any]] | None = None

    def before_step(self) -> None:
        sched = self.scheduler
        lrs = [g["lr"] for g in sched.optimizer.param_groups]
        # deepcopy: load_state_dict pops from what it is given, and lists are shared.
        self._before = (copy.deepcopy(sched.state_dict()), lrs)

    def after_step(self, samples: int) -> None:
        """``samples``: samples trained on, this step's included."""
        sched = self.scheduler
        if self._before is not None:
            state, lrs = self._before
            self._before = None
            sched.load_state_dict(state)
            for g, lr in zip(sched.optimizer.param_groups, lrs):
                g["lr"] = lr
        target = samples // self.full_global_batch
        while sched.last_epoch < target:
            sched.step()
