"""Reference training script: a small GPT on deterministic synthetic tokens, DDP.

    torchrun --nproc-per-node 2 -m training.examples.train_gpt \
        --max-steps 50 --checkpoint-uri file:///tmp/ckpt --checkpoint-every 10

Rerunning the same command resumes from the newest complete checkpoint. SIGTERM
or SIGUSR1 on any rank: every rank stops at the same step boundary, saves an
emergency checkpoint and exits with ExitCode.PREEMPTED_SAVED (75). A NaN/Inf loss
or gradient exits with NAN_DETECTED (76) before the optimizer touches the weights.

The data is a pure function of (seed, global sample index), and a step consumes
samples [step * global_batch, (step + 1) * global_batch): the data-loader position
*is* the step, so a resume on any world size sees exactly the same samples.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from orchestrator.contract import Env, ExitCode, manifest_digest
from training.checkpoint import (
    Checkpointer,
    CheckpointError,
    find_latest_complete,
    load_distributed,
    verify_checkpoint,
)
from training.knobs import plan_batch
from training.progress import ProgressReporter
from training.resume import ResumeMismatch, agree_on_resume
from training.signals import StopRequest


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        d: int,
        layers: int,
        heads: int,
        seq: int,
        activation_checkpoint_every: int = 0,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.ac_every = activation_checkpoint_every

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for i, b in enumerate(self.blocks):
            if self.training and self.ac_every and i % self.ac_every == 0:
                x = checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return self.head(self.ln(x))


def synthetic_batch(seed: int, first: int, count: int, seq: int, vocab: int) -> torch.Tensor:
    """Samples [first, first + count): each a pure function of (seed, index)."""
    rows = []
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        start = torch.randint(0, vocab, (1,), generator=g)
        step = torch.randint(1, 7, (1,), generator=g)
        noise = (torch.rand(seq + 1, generator=g) < 0.1) * torch.randint(
            0, vocab, (seq + 1,), generator=g
        )
        rows.append((start + step * torch.arange(seq + 1) + noise) % vocab)
    return torch.stack(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--checkpoint-uri", default=env.get(Env.CHECKPOINT_URI, ""))
    p.add_argument("--checkpoint-every", type=int, default=int(env.get(Env.CHECKPOINT_EVERY, 20)))
    p.add_argument("--keep", type=int, default=3)
    p.add_argument(
        "--local-dir",
        default=env.get(Env.LOCAL_CHECKPOINT_DIR, ""),
        help="local tier for s3:// and gs:// checkpoint URIs (saves land here first)",
    )
    p.add_argument("--sync-save", action="store_true", help="blocking saves instead of async")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-final", default="")
    p.add_argument("--resume-from", default=env.get(Env.RESUME_FROM, "latest"))
    p.add_argument("--global-batch", type=int, default=int(env.get(Env.GLOBAL_BATCH, 8)))
    p.add_argument("--micro-batch", type=int, default=int(env.get(Env.MICRO_BATCH, 0)) or None)
    p.add_argument(
        "--activation-checkpoint-every",
        type=int,
        default=int(env.get(Env.ACTIVATION_CHECKPOINT_EVERY, 0)),
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds; to slow a demo")
    p.add_argument("--inject-nan-at", type=int, default=-1, help="testing: NaN loss at this step")
    return p.parse_args(argv)


def _checkpoint_tiers(uri: str, local_dir: str) -> tuple[Path | None, str | None]:
    """(local tier, remote URI to upload to). A file:// URI is used directly."""
    if not uri:
        return None, None
    parsed = urlparse(uri)
    if parsed.scheme in ("file", ""):
        return Path(parsed.path), None
    if parsed.scheme not in ("s3", "gs"):
        sys.exit(f"error: --checkpoint-uri {uri}: use file://, s3:// or gs://")
    import hashlib

    default = (
        Path(tempfile.gettempdir())
        / "skyresume-local"
        / hashlib.sha256(uri.encode()).hexdigest()[:12]
    )
    return Path(local_dir) if local_dir else default, uri


def _stage_remote(uri: str, local_root: Path) -> None:
    """Bring the newest complete remote checkpoint to this node's disk (one rank
    per node does it; the others wait at the barrier that follows)."""
    from orchestrator.cloud.storage import StorageError, list_checkpoints, stage_checkpoint

    if not any(c.complete for c in list_checkpoints(uri)):
        return  # nothing saved yet: a fresh start
    try:
        staged = stage_checkpoint(uri, str(local_root))
    except StorageError as e:
        print(f"error: staging {uri}: {e}", file=sys.stderr)
        raise
    print(f"staged step {staged.step} from {uri}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        batch_plan = plan_batch(args.global_batch, world, args.micro_batch)
    except ValueError as e:
        sys.exit(f"error: {e}")
    per_rank, micro, accum = (
        batch_plan.per_rank_batch,
        batch_plan.micro_batch,
        batch_plan.grad_accum,
    )
    stop = StopRequest()
    reporter = ProgressReporter(rank=rank)

    torch.manual_seed(args.seed)
    model = GPT(
        args.vocab,
        args.d_model,
        args.layers,
        args.heads,
        args.seq,
        args.activation_checkpoint_every,
    )
    ddp = nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def state() -> dict:
        msd, osd = get_state_dict(model, optimizer)
        return {
            "model": msd,
            "optim": osd,
            "sched": sched.state_dict(),
            "step": torch.tensor(step),
            "rng": {f"rank{rank}": torch.get_rng_state()},
        }

    root, upload_uri = _checkpoint_tiers(args.checkpoint_uri, args.local_dir)
    step, digest = 0, None
    if args.resume_from != "none" and root is not None:
        if args.resume_from == "latest" and upload_uri:
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                _stage_remote(upload_uri, root)
            if dist.is_initialized():
                dist.barrier()
        if args.resume_from == "latest":
            found = find_latest_complete(root)
            for path, why in found.rejected if found else ():
                print(f"rank {rank}: skipped {path}: {why}", file=sys.stderr)
            target = found.path if found else None
        else:
            target = Path(urlparse(args.resume_from).path)
        if target is not None:
            try:
                manifest = verify_checkpoint(target)
                sd = state()
                sd["rng"] = {} if manifest.world_size != world else sd["rng"]
                load_distributed(sd, target)
            except CheckpointError as e:
                print(f"error: {e}", file=sys.stderr)
                return ExitCode.CHECKPOINT_INVALID
            set_state_dict(
                model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
            )
            sched.load_state_dict(sd["sched"])
            if sd["rng"]:
                torch.set_rng_state(sd["rng"][f"rank{rank}"])
            step = int(sd["step"])
            digest = manifest_digest((target / "manifest.json").read_bytes())
    expected = os.environ.get(Env.EXPECTED_STEP)
    try:
        agree_on_resume(
            step if digest else None, digest, expected_step=int(expected) if expected else None
        )
    except ResumeMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.RESUME_MISMATCH

    ckpt = (
        Checkpointer(
            root,
            keep=args.keep,
            use_async=not args.sync_save,
            extra={"global_batch": args.global_batch},
            upload_uri=upload_uri,
        )
        if root is not None
        else None
    )

    def checkpoint(at: int, *, emergency: bool = False) -> None:
        if ckpt is None:
            return
        if emergency:
            ckpt.wait()  # the periodic save in flight first, then this one synchronously
            ckpt.use_async = False
        ckpt.save(state(), at)
        if emergency:
            ckpt.close()
        reporter.send(
            "checkpoint", step=at, path=str(root / f"step_{at}"), blocking_s=ckpt.last_blocking_s
        )

    last_saved = step
    while step < args.max_steps:
        if stop.agreed():
            if last_saved != step:
                checkpoint(step, emergency=True)
            elif ckpt is not None:
                ckpt.close()
            print(f"rank {rank}: stop requested; saved step {step}", file=sys.stderr)
            return ExitCode.PREEMPTED_SAVED
        t0 = time.perf_counter()
        model.train()
        batch = synthetic_batch(
            args.seed, step * args.global_batch + rank * per_rank, per_rank, args.seq, args.vocab
        )
        total = 0.0
        for m in range(accum):
            chunk = batch[m * micro : (m + 1) * micro]
            logits = ddp(chunk[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), chunk[:, 1:].reshape(-1))
            if step == args.inject_nan_at:
                loss = loss * float("nan")
            (loss / accum).backward()
            total += loss.item() / accum
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        bad = torch.tensor([0 if math.isfinite(total) and math.isfinite(grad_norm) else 1])
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            optimizer.zero_grad(set_to_none=True)  # the weights are untouched
            reporter.send("anomaly", kind="nan", step=step, loss=total, grad_norm=grad_norm)
            print(
                f"rank {rank}: non-finite loss/grad at step {step}; no update applied",
                file=sys.stderr,
            )
            return ExitCode.NAN_DETECTED
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dt = time.perf_counter() - t0
        reporter.progress(
            step=step,
            step_time=dt,
            loss=total,
            grad_norm=grad_norm,
            samples_per_s=args.global_batch / dt if dt else 0.0,
        )
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.max_steps:
            checkpoint(step)
            last_saved = step
    if ckpt is not None:
        ckpt.close()
    if args.save_final and rank == 0:
        torch.save(
            {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step},
            args.save_final,
        )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(int(main()))
