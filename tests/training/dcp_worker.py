"""Run by the DCP tests: save a small model's state on N gloo ranks, or save forever
(so a test can SIGKILL it mid-save)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from training.checkpoint import save_distributed


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return {"model": model.state_dict(), "step": torch.tensor(seed)}


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    if mode == "once":
        save_distributed(model_state(7), root, 7, extra={"note": "test"})
        print(f"rank {dist.get_rank()}: committed", flush=True)
    else:  # forever: a new step every iteration until killed
        step = 1
        while True:
            save_distributed(model_state(step), root, step)
            step += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
