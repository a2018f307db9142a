"""Run by test_run.py: one rank that trains until SIGTERM, saves, exits 75, and is
still exiting when a second SIGTERM comes (torchrun forwards the agent's).

It talks to the test over stdin/stdout, so nothing depends on timing: it prints
``training`` and waits for a line (the test sends SIGTERM, then the line); after
``RunExit`` it prints ``exiting`` from an atexit hook and waits for a line again (the
test sends the second SIGTERM, then the line). ``argv[1]``: the checkpoint root."""

from __future__ import annotations

import atexit
import os
import sys

import torch

from training import Run


def _still_exiting() -> None:
    print("exiting", flush=True)
    sys.stdin.readline()


def main(root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run.from_env(
        model=model, optimizer=opt, env={}, checkpoint_uri=f"file://{root}",
        checkpoint_every=1000, use_async=False,
    )  # fmt: skip
    run.restore()
    atexit.register(_still_exiting)  # runs after RunExit, while the process is exiting
    for step in run.steps(1000):
        if step == 1:
            print("training", flush=True)
            sys.stdin.readline()
        loss = model(torch.ones(4)).pow(2).sum()
        loss.backward()
        run.report(loss=loss, grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
    run.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
