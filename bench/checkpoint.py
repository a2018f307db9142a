"""Blocking time per save: sync DCP save vs async_save vs a plain in-memory copy of
the state dict (the floor), on the same model and ranks in one run.

    python -m torch.distributed.run --standalone --nproc-per-node 4 bench/checkpoint.py

Model: a stack of Linear layers of about --params parameters with AdamW state (so a
save carries weights + 2 moments), wrapped two ways, each measured in the same run:

* ``ddp``: every rank holds the whole state. DCP writes each tensor once (spread
  over ranks), but ``async_save`` must still copy the whole state on every rank
  before it returns, so its floor is a full copy per rank.
* ``fsdp2``: ``fully_shard`` per layer; every rank holds and copies 1/N of it.

``async`` is the Checkpointer as used (replicated entries split over the ranks
before ``async_save``, so each rank copies about 1/N); ``async_unsplit`` is plain
``async_save`` of every rank's whole state dict, the previous behaviour.

``--process`` adds DCP's process-based async checkpointer (measured after one
warm-up save, which starts its helper processes). Prints one JSON line on rank 0;
a save's blocking time is the slowest rank's (every rank waits for it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from training.checkpoint import Checkpointer


def build(kind: str, params: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if kind == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        wrapped = fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrapped(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def measure(kind: str, args: argparse.Namespace, base: Path) -> dict[str, float]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build(kind, args.params)

    def state() -> dict:
        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    results: dict[str, list[float]] = {"sync": [], "async": [], "async_unsplit": [], "copy": []}
    sync_ckpt = Checkpointer(base / kind / "sync", keep=2, use_async=False)
    async_ckpt = Checkpointer(base / kind / "async", keep=2, use_async=True)
    # Every rank copies its whole (replicated) state before async_save returns.
    unsplit_ckpt = Checkpointer(
        base / kind / "unsplit", keep=2, use_async=True, split_replicated=False
    )
    proc_group = None
    if args.process:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        results["async_process"] = []
        proc_group = dist.new_group(backend="gloo")
        warm = dcp.async_save(  # starts the helper processes; not measured
            state(),
            checkpoint_id=str(base / kind / "proc" / "warmup"),
            process_group=proc_group,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        warm.result()
    step = 0
    for _ in range(args.repeats):
        for what in results:
            dist.barrier()
            step += 1
            t0 = time.perf_counter()
            if what == "copy":
                snapshot = copy.deepcopy(state())
                results["copy"].append(time.perf_counter() - t0)
                del snapshot
            elif what == "sync":
                sync_ckpt.save(state(), step)
                results["sync"].append(sync_ckpt.last_blocking_s or 0.0)
            elif what in ("async", "async_unsplit"):
                ckpt = async_ckpt if what == "async" else unsplit_ckpt
                ckpt.save(state(), step)
                results[what].append(ckpt.last_blocking_s or 0.0)
                ckpt.wait()  # finished before the next measurement starts
            else:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                fut = dcp.async_save(
                    state(),
                    checkpoint_id=str(base / kind / "proc" / f"step_{step}"),
                    process_group=proc_group,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                )
                results["async_process"].append(time.perf_counter() - t0)
                fut.result()
    for c in (sync_ckpt, async_ckpt, unsplit_ckpt):
        c.close()
    med = {k: torch.tensor([statistics.median(v)], dtype=torch.float64) for k, v in results.items()}
    for t in med.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: float(v) for k, v in med.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="")
    p.add_argument("--wrap", choices=["ddp", "fsdp2", "both"], default="both")
    p.add_argument("--process", action="store_true", help="also the process-based checkpointer")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    # One directory for every rank (a checkpoint is shared), removed at the end.
    made = [tempfile.mkdtemp(prefix="skyresume-bench-") if rank == 0 and not args.dir else None]
    dist.broadcast_object_list(made, src=0)
    base = Path(args.dir or str(made[0]))
    kinds = ["ddp", "fsdp2"] if args.wrap == "both" else [args.wrap]
    out: dict[str, object] = {"bench": "checkpoint", "ranks": world}
    width = 2048
    layers = max(1, round(args.params / (width * width + width)))
    out["params"] = layers * (width * width + width)
    for kind in kinds:
        m = measure(kind, args, base)
        out[kind] = {
            **{f"{k}_blocking_s": round(v, 3) for k, v in m.items()},
            "async_blocking_over_sync": round(m["async"] / m["sync"], 3),
            "async_blocking_over_copy": round(m["async"] / m["copy"], 3),
            **(
                {"process_blocking_over_sync": round(m["async_process"] / m["sync"], 3)}
                if "async_process" in m
                else {}
            ),
        }
    # The headline ratio: the best wrapping for async saves, measured in this run.
    best = min(kinds, key=lambda k: out[k]["async_blocking_over_sync"])  # type: ignore[index]
    out["best"] = best
    out["ratio"] = out[best]["async_blocking_over_sync"]  # type: ignore[index]
    if rank == 0:
        print(json.dumps(out))
    dist.barrier()
    if rank == 0 and not args.dir:
        shutil.rmtree(base, ignore_errors=True)  # several GB per run
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
