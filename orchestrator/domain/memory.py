"""The memory planner: training knobs that fit a model on a given GPU.

When a replacement GPU has less memory than the one a job ran on, SkyPilot will
happily launch it and the job dies of CUDA OOM on its first step. This module picks
the knobs that make it fit, in the order that costs the least:

1. the least activation checkpointing that fits: none, then every Nth transformer
   block for N = L, L-1, ... (``i % N == 0`` blocks are checkpointed, the rule
   ``training.examples.train_gpt`` applies), then every block;
2. only when even every block checkpointed does not fit, a smaller micro-batch with
   more gradient accumulation, so that ``micro_batch * grad_accum * data_parallel``
   stays equal to the global batch and the training math does not change.

The estimate, per GPU, in bytes (``w`` = bytes per element of ``dtype``):

* weights ``P*w``, gradients ``P*w``, optimizer states ``P*optimizer_bytes_per_param``
  (12 = fp32 master copy + Adam's two moments); FSDP (full shard) divides all three by
  the data-parallel size and adds the gathered parameters and gradients of about two
  blocks in flight;
* activations after Korthikanti et al. ("Reducing Activation Recomputation in Large
  Transformer Models", 2022), per block and micro-batch ``b``, sequence ``s``, hidden
  ``h``, heads ``a``: ``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations. The
  ``5*a*s/h`` term is the attention scores and softmax, which fused attention
  (PyTorch SDPA / FlashAttention) never stores; it is left out unless
  ``attention_scores_stored=True`` (their "selective recomputation" row). A
  checkpointed block keeps only its input, ``2*s*b*h``; backward recomputes one
  checkpointed block at a time, so one full block's activations come back on top.
  fp32 activations are twice the 16-bit figures.
* a fixed runtime reserve (CUDA context, NCCL buffers, allocator slack), and a
  ``headroom`` fraction of the GPU left unused, because the estimate leaves out the
  output logits (the profile has no vocabulary size) and fragmentation.

Expected compute overhead: recomputing a block's forward costs about a third of that
block's forward+backward FLOPs, so checkpointing ``k`` of ``L`` blocks adds
``k / (3L)`` (a third with every block; published measurements are 20-30 %). A
smaller micro-batch adds no FLOPs but runs smaller kernels; that cost is not modelled
here and is named in the reasons instead.

Pure: no I/O, no SDK; memory in bytes unless a name says GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from orchestrator.domain.plan import TrainingKnobs
from orchestrator.domain.spec import ModelProfile

GIB = 1024**3

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

#: CUDA context, NCCL communicator buffers and allocator slack that no model can use.
RUNTIME_RESERVE_BYTES = 1 * GIB

#: Recomputing a block's forward pass costs about 1/3 of its forward+backward FLOPs.
RECOMPUTE_FRACTION = 1.0 / 3.0

#: Blocks whose parameters FSDP holds gathered at once (current + prefetched).
FSDP_BLOCKS_IN_FLIGHT = 2


class DoesNotFit(ValueError):
    """No knobs fit the model on this GPU. ``smallest`` is the least memory any
    setting needs (every block checkpointed, micro-batch 1)."""

    def __init__(self, message: str, smallest: MemoryPlan) -> None:
        super().__init__(message)
        self.smallest = smallest


class BatchNotDivisible(ValueError):
    """The global batch cannot be split evenly over the data-parallel ranks."""


@dataclass(frozen=True)
class MemoryPlan:
    """The chosen knobs and the per-GPU estimate behind them."""

    knobs: TrainingKnobs
    data_parallel: int
    gpu_memory_bytes: int
    usable_bytes: int
    """GPU memory less the headroom fraction; the budget the total must fit in."""
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int
    """FSDP's gathered blocks plus the runtime reserve."""
    fits: bool
    compute_overhead: float
    """Extra compute per step from recomputation, as a fraction (0.33 = +33 %)."""
    reasons: tuple[str, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.buffers_bytes
        )

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    def to_dict(self) -> dict[str, object]:
        return {
            "knobs": self.knobs.to_dict(),
            "data_parallel": self.data_parallel,
            "gpu_memory_gib": round(self.gpu_memory_bytes / GIB, 2),
            "usable_gib": round(self.usable_bytes / GIB, 2),
            "weights_gib": round(self.weights_bytes / GIB, 2),
            "gradients_gib": round(self.gradients_bytes / GIB, 2),
            "optimizer_gib": round(self.optimizer_bytes / GIB, 2),
            "activations_gib": round(self.activations_bytes / GIB, 2),
            "buffers_gib": round(self.buffers_bytes / GIB, 2),
            "total_gib": round(self.total_gib, 2),
            "fits": self.fits,
            "compute_overhead": round(self.compute_overhead, 4),
            "reasons": list(self.reasons),
        }


def describe_model(profile: ModelProfile) -> str:
    """'7.0B-parameter model (32 layers, hidden 4096, seq 4096, bf16, fsdp)'."""
    p = profile.parameters
    size = f"{p / 1e9:.1f}B" if p >= 1e9 else f"{p / 1e6:.0f}M"
    return (
        f"{size}-parameter model ({profile.layers} layers, hidden {profile.hidden_size}, "
        f"seq {profile.seq_len}, {profile.dtype}, {profile.sharding})"
    )


def checkpointed_blocks(layers: int, every: int) -> int:
    """How many blocks ``i % every == 0`` checkpoints (0 when ``every`` is 0)."""
    return 0 if every == 0 else math.ceil(layers / every)


def activation_bytes(
    profile: ModelProfile,
    micro_batch: int,
    checkpoint_every: int,
    *,
    attention_scores_stored: bool = False,
) -> int:
    """Activation memory of one rank for one micro-batch (Korthikanti et al.)."""
    s, b, h, a = profile.seq_len, micro_batch, profile.hidden_size, profile.heads
    scale = DTYPE_BYTES[profile.dtype] / 2  # the paper's constants are for 16-bit
    per_token_factor = 34.0 + (5.0 * a * s / h if attention_scores_stored else 0.0)
    full_block = s * b * h * per_token_factor * scale
    block_input = 2.0 * s * b * h * scale
    k = checkpointed_blocks(profile.layers, checkpoint_every)
    total = (profile.layers - k) * full_block + k * block_input
    if k:
        total += full_block  # one checkpointed block recomputed in backward at a time
    return int(total)


def _per_rank_batch(profile: ModelProfile, data_parallel: int) -> int:
    if data_parallel < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    if profile.global_batch % data_parallel:
        raise BatchNotDivisible(
            f"global batch {profile.global_batch} cannot be split evenly over "
            f"{data_parallel} data-parallel ranks; the global batch never changes, so "
            "choose a node count whose rank count divides it"
        )
    return profile.global_batch // data_parallel


def _micro_batches(profile: ModelProfile, per_rank: int) -> list[int]:
    """Divisors of the per-rank batch, largest first, no larger than asked."""
    start = min(profile.micro_batch, per_rank)
    return [m for m in range(start, 0, -1) if per_rank % m == 0]


def _checkpoint_levels(layers: int) -> list[int]:
    """0 (off), then every Nth block with the fewest checkpointed blocks first; one
    ``every`` per distinct count (the largest such ``every``)."""
    levels = [0]
    seen: set[int] = set()
    for every in range(layers, 0, -1):
        k = checkpointed_blocks(layers, every)
        if k not in seen:
            seen.add(k)
            levels.append(every)
    return levels


def estimate(
    profile: ModelProfile,
    knobs: TrainingKnobs,
    gpu_memory_gib: float,
    data_parallel: int,
    *,
    headroom: float = 0.1,
    attention_scores_stored: bool = False,
) -> MemoryPlan:
    """The per-GPU estimate for given knobs (``fits`` says whether it is within budget)."""
    if gpu_memory_gib <= 0:
        raise ValueError(f"gpu_memory_gib must be > 0, got {gpu_memory_gib}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if data_parallel < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    w = DTYPE_BYTES[profile.dtype]
    p = profile.parameters
    weights = float(p * w)
    grads = float(p * w)
    optim = p * profile.optimizer_bytes_per_param
    buffers = float(RUNTIME_RESERVE_BYTES)
    if profile.sharding == "fsdp":
        weights /= data_parallel
        grads /= data_parallel
        optim /= data_parallel
        per_block = p / profile.layers
        # gathered parameters of the blocks in flight, and one block's unsharded grads
        buffers += (FSDP_BLOCKS_IN_FLIGHT + 1) * per_block * w
    acts = activation_bytes(
        profile,
        knobs.micro_batch,
        knobs.activation_checkpoint_every,
        attention_scores_stored=attention_scores_stored,
    )
    gpu_bytes = int(gpu_memory_gib * GIB)
    usable = int(gpu_bytes * (1.0 - headroom))
    k = checkpointed_blocks(profile.layers, knobs.activation_checkpoint_every)
    plan = MemoryPlan(
        knobs=knobs,
        data_parallel=data_parallel,
        gpu_memory_bytes=gpu_bytes,
        usable_bytes=usable,
        weights_bytes=int(weights),
        gradients_bytes=int(grads),
        optimizer_bytes=int(optim),
        activations_bytes=acts,
        buffers_bytes=int(buffers),
        fits=False,
        compute_overhead=RECOMPUTE_FRACTION * k / profile.layers,
    )
    return _with_fit(plan, plan.total_bytes <= usable)


def _with_fit(plan: MemoryPlan, fits: bool, reasons: tuple[str, ...] = ()) -> MemoryPlan:
    return replace(plan, fits=fits, reasons=reasons or plan.reasons)


def _explain(profile: ModelProfile, plan: MemoryPlan) -> tuple[str, ...]:
    k = plan.knobs
    out = [f"{plan.total_gib:.1f} of {plan.usable_bytes / GIB:.1f} GiB usable per GPU"]
    if k.activation_checkpoint_every == 0:
        out.append("no activation checkpointing")
    else:
        n = checkpointed_blocks(profile.layers, k.activation_checkpoint_every)
        every = (
            "every block"
            if k.activation_checkpoint_every == 1
            else (f"every {k.activation_checkpoint_every}th block")
        )
        out.append(
            f"activation checkpointing {every} ({n}/{profile.layers}), "
            f"+{plan.compute_overhead:.0%} compute"
        )
    if k.micro_batch < profile.micro_batch:
        out.append(
            f"micro-batch {profile.micro_batch} -> {k.micro_batch} with grad accumulation "
            f"{k.grad_accum} (global batch {profile.global_batch} kept; smaller kernels "
            "run less efficiently)"
        )
    return tuple(out)


def plan_memory(
    profile: ModelProfile,
    gpu_memory_gib: float,
    data_parallel: int,
    *,
    headroom: float = 0.1,
    attention_scores_stored: bool = False,
) -> MemoryPlan:
    """The cheapest knobs that fit: least checkpointing first, then smaller micro-batches.

    Raises :class:`DoesNotFit` when nothing fits (its message names the model, the
    GPU's memory and the smallest estimate) and :class:`BatchNotDivisible` when the
    global batch cannot be split over ``data_parallel`` ranks.
    """
    per_rank = _per_rank_batch(profile, data_parallel)
    smallest: MemoryPlan | None = None
    for micro in _micro_batches(profile, per_rank):
        for every in _checkpoint_levels(profile.layers):
            knobs = TrainingKnobs(
                micro_batch=micro,
                grad_accum=per_rank // micro,
                activation_checkpoint_every=every,
            )
            plan = estimate(
                profile,
                knobs,
                gpu_memory_gib,
                data_parallel,
                headroom=headroom,
                attention_scores_stored=attention_scores_stored,
            )
            if plan.fits:
                return _with_fit(plan, True, _explain(profile, plan))
            if smallest is None or plan.total_bytes < smallest.total_bytes:
                smallest = plan
    assert smallest is not None  # micro-batch 1 always divides the per-rank batch
    need = smallest.total_bytes / GIB
    states = (smallest.weights_bytes + smallest.gradients_bytes + smallest.optimizer_bytes) / GIB
    hint = (
        "shard it with fsdp or use more GPUs"
        if profile.sharding == "ddp"
        else "use more GPUs or a larger GPU"
    )
    raise DoesNotFit(
        f"the {describe_model(profile)} does not fit a {gpu_memory_gib:g} GiB GPU with "
        f"{data_parallel} data-parallel ranks: the smallest estimate is {need:.1f} GiB per "
        f"GPU (weights+gradients+optimizer {states:.1f} GiB, every block checkpointed, "
        f"micro-batch 1) against {smallest.usable_bytes / GIB:.1f} GiB usable after "
        f"{headroom:.0%} headroom; {hint}",
        _with_fit(smallest, False, _explain(profile, smallest)),
    )


def next_smaller_setting(
    profile: ModelProfile, current: TrainingKnobs, data_parallel: int
) -> TrainingKnobs | None:
    """After an out-of-memory at ``current``: the cheapest setting, in the planner's
    order (least recompute first, then smaller micro-batches), whose activations are
    smaller than ``current``'s, with the global batch unchanged. None when ``current``
    is already the smallest. The estimate was wrong once (the GPU said so), so the
    answer is relative to it, never "what fits by the estimate"."""
    per_rank = _per_rank_batch(profile, data_parallel)
    now = activation_bytes(profile, current.micro_batch, current.activation_checkpoint_every)
    for micro in _micro_batches(profile, per_rank):
        if micro > current.micro_batch:
            continue
        for every in _checkpoint_levels(profile.layers):
            knobs = TrainingKnobs(micro, per_rank // micro, every)
            if knobs == current:
                continue
            if activation_bytes(profile, micro, every) < now:
                return knobs
    return None
