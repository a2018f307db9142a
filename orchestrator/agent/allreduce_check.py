"""``python -m orchestrator.agent.allreduce_check``: a short all-reduce across the
nodes, one process per node, before torchrun starts; prints one JSON line.

The agent runs it (as a subprocess: the agent itself never imports torch) when the
job asks for a minimum bandwidth (``--min-allreduce-gbps``): a slow link or a NIC
that negotiated down shows here in seconds, instead of as a slow job for hours.

It joins a process group of ``world`` processes (node rank = rank) through a TCP
store at ``addr:port``, all-reduces a float32 tensor of ``mib`` MiB once to warm up,
then ``iters`` times, and reports the bus bandwidth as nccl-tests defines it:
``size * 2 (n - 1) / n / time`` (bytes each rank sends and receives in a ring
all-reduce), so it is comparable across world sizes. Backend: nccl on GPUs, gloo
otherwise.

Exit 0 with ``{"busbw_gbps": ..., ...}``, or exit 1 with ``{"error": ...}`` (a peer
that never joined, a collective that failed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta


def measure(
    rank: int, world: int, addr: str, port: int, mib: float, iters: int, timeout_s: float
) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = dist.TCPStore(
        addr, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s)
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        n = max(1, int(mib * 2**20) // 4)
        t = torch.ones(n, dtype=torch.float32, device=device)
        dist.all_reduce(t)  # warm-up: connections, buffers
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if backend == "nccl":
            torch.cuda.synchronize()
        took = (time.perf_counter() - t0) / iters
        size = n * 4
        busbw = size * 2 * (world - 1) / world / took
        # Every rank reports the slowest rank's time: the group is as fast as it.
        slowest = torch.tensor([took], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        busbw_min = size * 2 * (world - 1) / world / float(slowest.item())
        return {
            "backend": backend,
            "world": world,
            "bytes": size,
            "iters": iters,
            "seconds_per_iter": round(took, 6),
            "busbw_gbps": round(busbw / 1e9, 4),
            "busbw_gbps_slowest": round(busbw_min / 1e9, 4),
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.agent.allreduce_check")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=60.0)
    a = p.parse_args(argv)
    try:
        out = measure(a.rank, a.world, a.addr, a.port, a.mib, a.iters, a.timeout_s)
    except Exception as e:  # a peer that never came, a broken link: the caller decides
        print(json.dumps({"error": f"{type(e).__name__}: {e}"[:1000]}), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
