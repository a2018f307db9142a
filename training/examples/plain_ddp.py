"""A plain multi-node DDP script, written in the style of PyTorch's
``distributed/ddp-tutorial-series/multinode.py``: it saves and resumes its own
snapshot and imports nothing of skyresume. The plain-script e2e
(``tests/e2e/test_plain_script_e2e.py``) runs it under the service.

Run under torchrun (``--nnodes 2 --nproc-per-node 2``)::

    python plain_ddp.py 400 10 --snapshot_path /shared/snapshot.pt [--resume_from FILE]

Global rank 0 saves ``{"MODEL_STATE", "EPOCHS_RUN"}`` every ``save_every`` epochs to
``--snapshot_path`` (a temporary file, then renamed, so a kill mid-save leaves the
last one whole). With ``--resume_from`` (what the service passes as
``checkpoint.own.resume_arg`` where the file exists) rank 0 loads it and every rank
takes its epoch from rank 0, so nodes that lack the file agree all the same. Each
start appends one line to ``<snapshot>.starts`` (the epoch it started at), the
test's evidence of what each attempt resumed from. Differences from the tutorial,
for CPU: gloo instead of NCCL, a small synthetic dataset, a sleep per epoch so a
failure can land mid-run.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup() -> None:
    dist.init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
        resume_from: str | None,
        epoch_sleep: float,
    ) -> None:
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epoch_sleep = epoch_sleep
        self.epochs_run = 0
        if resume_from and self.global_rank == 0 and os.path.exists(resume_from):
            self._load_snapshot(resume_from)
        # Rank 0's epoch for all (the tutorial reads a shared file on every rank; here
        # a node without it must not start a different number of epochs and hang).
        epoch = torch.tensor([self.epochs_run])
        dist.broadcast(epoch, src=0)
        self.epochs_run = int(epoch.item())
        self.model = DDP(model)  # broadcasts rank 0's weights to every rank
        if self.global_rank == 0:
            with open(f"{snapshot_path}.starts", "a") as f:
                f.write(f"{self.epochs_run}\n")

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = int(snapshot["EPOCHS_RUN"])
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        assert isinstance(self.train_data.sampler, DistributedSampler)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)
        time.sleep(self.epoch_sleep)

    def _save_snapshot(self, epochs_run: int) -> None:
        state = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epochs_run}
        tmp = f"{self.snapshot_path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epochs_run} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main() -> None:
    p = argparse.ArgumentParser(description="plain multi-node DDP (tutorial style)")
    p.add_argument("total_epochs", type=int)
    p.add_argument("save_every", type=int)
    p.add_argument("--snapshot_path", default="snapshot.pt")
    p.add_argument("--resume_from", default=None)
    p.add_argument("--epoch_sleep", type=float, default=0.2)
    args = p.parse_args()
    torch.manual_seed(0)
    ddp_setup()
    data = TensorDataset(torch.randn(256, 20), torch.randint(0, 4, (256,)))
    loader = DataLoader(data, batch_size=32, shuffle=False, sampler=DistributedSampler(data))
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainer = Trainer(
        model,
        loader,
        optimizer,
        args.save_every,
        args.snapshot_path,
        args.resume_from,
        args.epoch_sleep,
    )
    trainer.train(args.total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
