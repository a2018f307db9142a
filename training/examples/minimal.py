"""train.py: a complete training script under skyresume (run it with torchrun)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training import ResumableSampler, Run


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    torch.manual_seed(0)  # the same initial weights on every rank
    x, y = torch.randn(10_000, 32), torch.randint(0, 4, (10_000,))  # your data set
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    sampler = ResumableSampler(len(x), global_batch=64, seed=0)
    run = Run.from_env(  # checkpoint URI, resume, knobs, agent address: SKYRESUME_RUN_*
        model=ddp,
        optimizer=opt,
        scheduler=sched,
        sampler=sampler,
        reference_fn=lambda: F.cross_entropy(model(x[:16]), y[:16]),  # corruption check
    )
    run.restore()  # the newest checkpoint every rank has (exit 77/78 if unusable)
    for _step in run.steps(max_steps=1000):  # SIGTERM: every rank saves, exit 75
        idx = sampler.indices()  # this rank's share of the step's global batch
        loss = F.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run.report(loss=loss, grad_norm=grad_norm)  # NaN/Inf anywhere: exit 76, no update
        opt.step()
        sched.step()
        opt.zero_grad()
    run.finish()  # waits for the last save, then tears the process group down


if __name__ == "__main__":
    main()
