"""Run by test_run_torchrun.py: a tiny model under Run, where each rank may be told
to resume from its own path (as if each node's disk held something else)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from training import Run


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def main() -> None:
    dist.init_process_group("gloo")
    model, opt = build()
    paths = sys.argv[1:]  # one per rank
    run = Run.from_env(model=model, optimizer=opt, resume_from=paths[dist.get_rank()])
    run.restore()
    print(f"rank {dist.get_rank()}: restored step {run.step}", flush=True)
    run.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
