"""Knobs the orchestrator chooses, read from the run's environment, and the
process-group settings that make a hung collective fail fast instead of idling
GPUs for hours."""

from __future__ import annotations

import os
from dataclasses import dataclass

from orchestrator.contract import Env


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    grad_accum: int
    per_rank_batch: int


def plan_batch(global_batch: int, world_size: int, micro_batch: int | None = None) -> BatchPlan:
    """Micro-batch and accumulation so that micro * accum * world == global batch.

    The global batch is the training math; it never changes when the world size or
    the micro-batch (chosen by the memory planner) does.
    """
    if global_batch < 1 or world_size < 1:
        raise ValueError("global batch and world size must be positive")
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not divisible by {world_size} ranks")
    per_rank = global_batch // world_size
    micro = min(micro_batch or per_rank, per_rank)
    while per_rank % micro:  # the largest micro-batch <= the asked one that divides evenly
        micro -= 1
    return BatchPlan(micro, per_rank // micro, per_rank)


def nccl_fail_fast_env(
    timeout_s: int = 600, dump_dir: str = "/tmp/skyresume-nccl"
) -> dict[str, str]:
    """Environment for GPU runs: async error handling tears the process down on a
    collective timeout (so the agent sees an exit, not a hang), and the flight
    recorder dumps what every rank was doing for the classifier."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(dump_dir, "nccl_trace_rank_"),
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "SKYRESUME_NCCL_TIMEOUT_S": str(timeout_s),
    }


def collective_timeout_from_env(default: int = 600) -> int:
    """The process group's timeout the service derived from the job's measured step
    and save times (``Env.COLLECTIVE_TIMEOUT_S``); torch's 10 minutes otherwise."""
    raw = os.environ.get(Env.COLLECTIVE_TIMEOUT_S, "")
    try:
        value = int(raw)
    except ValueError:
        return default
    return value if value > 0 else default


def init_process_group_for_device(timeout_s: int | None = None) -> str:
    """nccl with fail-fast settings on GPUs, gloo on CPU. Returns the backend. The
    timeout defaults to the one the service derived (``collective_timeout_from_env``)."""
    timeout_s = collective_timeout_from_env() if timeout_s is None else timeout_s
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        for k, v in nccl_fail_fast_env(timeout_s).items():
            os.environ.setdefault(k, v)
        os.makedirs("/tmp/skyresume-nccl", exist_ok=True)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return backend


def activation_checkpoint_every_from_env(default: int = 0) -> int:
    return int(os.environ.get(Env.ACTIVATION_CHECKPOINT_EVERY, default))
