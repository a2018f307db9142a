"""Blocking time per save: sync DCP save vs async_save vs a plain in-memory copy of
the state dict (the floor), on the same model and ranks in one run.

    python -m torch.distributed.run --standalone --nproc-per-node 4 bench/checkpoint.py

Model: a stack of Linear layers of about --params parameters, DDP, with AdamW
state (so a save carries weights + 2 moments). Prints one JSON line on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from training.checkpoint import Checkpointer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    width = 2048
    layers = max(1, round(args.params / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ddp(torch.randn(2, width)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def state() -> dict:
        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    base = Path(args.dir or tempfile.mkdtemp(prefix="skyresume-bench-"))
    results: dict[str, list[float]] = {"sync": [], "async": [], "copy": []}
    sync_ckpt = Checkpointer(base / "sync", keep=2, use_async=False)
    async_ckpt = Checkpointer(base / "async", keep=2, use_async=True)
    step = 0
    for _ in range(args.repeats):
        for kind in ("copy", "sync", "async"):
            dist.barrier()
            step += 1
            t0 = time.perf_counter()
            if kind == "copy":
                snapshot = copy.deepcopy(state())
                del snapshot
                results["copy"].append(time.perf_counter() - t0)
            elif kind == "sync":
                sync_ckpt.save(state(), step)
                results["sync"].append(sync_ckpt.last_blocking_s or 0.0)
            else:
                async_ckpt.save(state(), step)
                results["async"].append(async_ckpt.last_blocking_s or 0.0)
                async_ckpt.wait()  # finished before the next measurement starts
    # The blocking time of a save is the slowest rank's: every rank waits for it.
    med = {k: torch.tensor([statistics.median(v)]) for k, v in results.items()}
    for t in med.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        sync_s, async_s, copy_s = (float(med[k]) for k in ("sync", "async", "copy"))
        print(
            json.dumps(
                {
                    "bench": "checkpoint",
                    "params": n,
                    "ranks": world,
                    "sync_blocking_s": round(sync_s, 3),
                    "async_blocking_s": round(async_s, 3),
                    "copy_floor_s": round(copy_s, 3),
                    "async_blocking_over_sync": round(async_s / sync_s, 3),
                    "async_blocking_over_copy": round(async_s / copy_s, 3),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
