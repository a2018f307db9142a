"""Reference training script: a small GPT on deterministic synthetic tokens, DDP.

    torchrun --nproc-per-node 2 -m training.examples.train_gpt \
        --max-steps 50 --checkpoint-uri file:///tmp/ckpt --checkpoint-every 10

It is the documented example of ``training.Run``: everything skyresume does in the
job (restore, the stop agreement, reports, monitors, checkpoints) is in the few
``run.`` calls of ``main``. Rerunning the same command resumes from the newest
complete checkpoint. SIGTERM or SIGUSR1 on any rank: every rank stops at the same
step boundary, saves an emergency checkpoint and exits with
ExitCode.PREEMPTED_SAVED (75). A NaN/Inf loss or gradient exits with NAN_DETECTED
(76) before the optimizer touches the weights; replicas whose reference loss
differ exit with SILENT_CORRUPTION (79). A loss that jumps far above its trend and
stays there is reported as a ``spike`` anomaly naming its onset step; training goes on.

The data set is ``--dataset-size`` synthetic sequences, each a pure function of
(seed, index); a ``ResumableSampler`` shuffles it per epoch from the seed alone and
its position (global samples consumed) is checkpointed, so a resume on any world
size sees exactly the samples an uninterrupted run would have.

Elastic runs (``SKYRESUME_RUN_FULL_WORLD_SIZE`` set, ``training.elastic``): the
sampler takes ``config.global_batch_for(world)`` and the accumulation comes from
``run.batch_plan``, so a shrunk world keeps the global batch (``keep``) or trains
on its share of it with the learning rate scaled (``scale``). With warm regroup
(``SKYRESUME_RUN_REGROUP_TIMEOUT_S``, set by an agent that writes memberships into
the control file) the loop ``for group in run.groups(): with group: ...`` outlives
its process group: a lost node or a new membership ends the group, and the same
process re-forms it, builds a new DDP wrapper around the same model and resumes
from the membership's checkpoint. ``--sample-log`` writes what every rank trained
on, one JSON line per step, for tests that check that a run cut and resumed on
other world sizes saw every sample as often as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from orchestrator.contract import Env
from training import ResumableSampler, Run, RunConfig, chaos
from training.knobs import collective_timeout_from_env


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout)
        )

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
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
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


def synthetic_batch(seed: int, indices: list[int], seq: int, vocab: int) -> torch.Tensor:
    """The given samples, each a pure function of (seed, index)."""
    rows = []
    for i in indices:
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        start = torch.randint(0, vocab, (1,), generator=g)
        step = torch.randint(1, 7, (1,), generator=g)
        noise = (torch.rand(seq + 1, generator=g) < 0.1) * torch.randint(
            0, vocab, (seq + 1,), generator=g
        )
        rows.append((start + step * torch.arange(seq + 1) + noise) % vocab)
    return torch.stack(rows)


#: Environment variables for the options that make this script fail like a real one
#: (a job spec's command line can carry the flags too).
OOM_ABOVE_MICRO_BATCH = "TRAIN_GPT_OOM_ABOVE_MICRO_BATCH"
RAISE_KEYERROR_AT_STEP = "TRAIN_GPT_RAISE_KEYERROR_AT_STEP"
SAMPLE_LOG = "TRAIN_GPT_SAMPLE_LOG"


class SampleLog:
    """One JSON line per step and rank: what it trained on. Appended and flushed per
    line, because the process restarts: a resume redoes the steps after the last
    checkpoint, so a step may be logged by several launches.

    A reader takes, for each step, the lines of the latest launch that ran it
    (``launch``: rank 0's clock in ns when the launch, or a warm regroup's next process
    group, started; the same on every rank of it). Not the last line per (step, rank):
    after 3 ranks -> 2, rank 2's line of a redone step is from the earlier launch and
    was never kept. ``pid`` tells a warm regroup (the same process) from a restart.
    The file is named by the rank the process started as."""

    def __init__(self, path: str, rank: int) -> None:
        self.launch = 0
        """Set by the script at the start of each process group."""
        self._file = open(path.replace("{rank}", str(rank)), "a") if path else None  # noqa: SIM115

    def write(self, **record: object) -> None:
        if self._file is not None:
            doc = {**record, "launch": self.launch, "pid": os.getpid()}
            self._file.write(json.dumps(doc) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--checkpoint-uri", default=env.get(Env.CHECKPOINT_URI, ""))
    p.add_argument("--checkpoint-every", type=int, default=int(env.get(Env.CHECKPOINT_EVERY, 20)))
    p.add_argument("--keep", type=int, default=int(env.get(Env.CHECKPOINT_KEEP, 3)))
    p.add_argument(
        "--local-dir",
        default=env.get(Env.LOCAL_CHECKPOINT_DIR, ""),
        help="local tier for s3:// and gs:// checkpoint URIs (saves land here first)",
    )
    p.add_argument("--sync-save", action="store_true", help="blocking saves instead of async")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
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
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--dataset-size", type=int, default=4096, help="synthetic sequences")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reference-every", type=int, default=0, help="0: only before saves")
    p.add_argument("--straggler-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds; to slow a demo")
    p.add_argument("--inject-nan-at", type=int, default=-1, help="testing: NaN loss at this step")
    p.add_argument(
        "--inject-spike-at",
        type=int,
        default=-1,
        help=f"testing: the loss is {chaos.SPIKE_FACTOR:g}x in the forward for "
        f"{chaos.SPIKE_STEPS} steps from this step (every rank)",
    )
    p.add_argument(
        "--oom-above-micro-batch",
        type=int,
        default=int(env.get(OOM_ABOVE_MICRO_BATCH, -1)),
        help="testing: refuse like a GPU too small would: CUDA's OOM at the first step "
        f"when the micro-batch is above this (-1: never; env {OOM_ABOVE_MICRO_BATCH})",
    )
    p.add_argument(
        "--raise-keyerror-at-step",
        type=int,
        default=int(env.get(RAISE_KEYERROR_AT_STEP, -1)),
        help="testing: a user bug at this step, KeyError: 'input_ids', again after every "
        f"resume from before it (-1: never; env {RAISE_KEYERROR_AT_STEP})",
    )
    p.add_argument(
        "--inject-corruption-at",
        type=int,
        default=-1,
        help="testing: rank 1 (or 0 alone) perturbs one weight after this step's update",
    )
    p.add_argument("--slow-rank", type=int, default=-1, help="testing: this rank computes slower")
    p.add_argument("--slow-seconds", type=float, default=0.05)
    p.add_argument(
        "--sample-log",
        default=env.get(SAMPLE_LOG, ""),
        help="append one JSON line per step and rank (step, rank, world, global_batch, "
        "indices, loss, lr, launch, pid) to this path; '{rank}' in it is the rank (empty: "
        f"off; env {SAMPLE_LOG}). Per step, the latest launch's lines count",
    )
    return p.parse_args(argv)


def wrap_for_group(model: nn.Module, *, fsdp: bool) -> nn.Module:
    """What the model trains through in the current process group: a new DDP per group
    (DDP holds the group it was built on); the model itself under FSDP (sharded in
    place once) or without a process group."""
    if fsdp or not dist.is_initialized():
        return model
    # find_unused_parameters=True keeps DDP's first bucket layout for good. By default
    # DDP rebuilds its buckets after the first iteration of every process, so a resumed
    # run would reduce its first step's gradients in another order than an
    # uninterrupted one (ring allreduce over 3+ ranks is not associative in floating
    # point) and drift by ~1e-8: not a bitwise-exact resume.
    return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)


def lm_loss(batch: torch.Tensor, net: nn.Module, vocab: int) -> torch.Tensor:
    logits = net(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if "RANK" in os.environ:
        # The service's collective timeout (from the measured step time) on relaunch.
        timeout = timedelta(seconds=collective_timeout_from_env())
        dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    torch.manual_seed(args.seed)
    model = GPT(
        args.vocab,
        args.d_model,
        args.layers,
        args.heads,
        args.seq,
        args.activation_checkpoint_every,
        args.dropout,
    )
    if args.fsdp and dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        # In place and before the optimizer (it takes the sharded parameters): once per
        # process. A sharded model is never regrouped warm (Run exits for a cold start).
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # each rank holds 1/N of the state: async saves copy less
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    try:
        config = RunConfig.from_env(
            checkpoint_uri=args.checkpoint_uri,
            local_dir=args.local_dir,
            resume_from=args.resume_from,
            checkpoint_every=args.checkpoint_every,
            keep=args.keep,
            use_async=not args.sync_save,
            seed=args.seed,
            global_batch=args.global_batch,  # the full world's, on an elastic run
            micro_batch=args.micro_batch,
            activation_checkpoint_every=args.activation_checkpoint_every,
            reference_every=args.reference_every,
            straggler_every=args.straggler_every,
        )
        # This world's batch: the spec's, or its share of it with elastic batch scale.
        batch = config.global_batch_for(world)
        assert batch is not None
        sampler = ResumableSampler(args.dataset_size, batch, seed=args.seed)
    except ValueError as e:
        sys.exit(f"error: {e}")

    # A fixed batch outside the training stream, run on the unwrapped model.
    reference = synthetic_batch(args.seed + 1, list(range(4)), args.seq, args.vocab)
    run = Run(
        config,
        model=model,  # rewrapped for each process group below
        optimizer=optimizer,
        scheduler=sched,
        sampler=sampler,
        reference_fn=lambda: lm_loss(reference, model, args.vocab),
    )
    log = SampleLog(args.sample_log, rank)
    at = args.inject_spike_at
    spike_steps = range(at, at + chaos.SPIKE_STEPS) if at >= 0 else range(0)
    # One group on a plain run. With warm regroup (elastic, the agent writes memberships)
    # a lost node or a new membership ends the group, and this loop re-forms it in the
    # same process: only what uses the process group is built again.
    for group in run.groups():
        with group:
            ddp = wrap_for_group(model, fsdp=args.fsdp)
            run.rewrap(ddp)  # the wrapper: Run times each rank's compute with a DDP comm hook
            launch = [time.time_ns()]
            if args.sample_log and dist.is_initialized():
                dist.broadcast_object_list(launch, src=0)  # one id for every rank of the group
            log.launch = launch[0]
            run.restore()
            assert run.batch_plan is not None
            micro, accum = run.batch_plan.micro_batch, run.batch_plan.grad_accum
            first_step = run.step
            for step in run.steps(args.max_steps):
                model.train()
                indices = sampler.indices()
                batch = synthetic_batch(args.seed, indices, args.seq, args.vocab)
                if step == first_step and 0 <= args.oom_above_micro_batch < micro:
                    # What a card too small for this micro-batch does in its first forward;
                    # a re-planned smaller micro-batch runs, the smallest one fails again.
                    raise chaos.cuda_oom_error(tried_gib=0.25 * micro)
                features = {"tokens": batch}
                # The user's bug at that step (every rank): reading a key the batch lacks.
                tokens = features["input_ids" if step == args.raise_keyerror_at_step else "tokens"]
                if run.rank == args.slow_rank:
                    time.sleep(args.slow_seconds)
                total = 0.0
                for m in range(accum):
                    chunk = tokens[m * micro : (m + 1) * micro]
                    loss = run.perturb_loss(lm_loss(chunk, ddp, args.vocab))  # chaos spike
                    if step == args.inject_nan_at:
                        loss = loss * float("nan")
                    if step in spike_steps:
                        loss = loss * chaos.SPIKE_FACTOR
                    (loss / accum).backward()
                    total += loss.item() / accum
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                run.report(loss=total, grad_norm=grad_norm)  # NaN/Inf: exit 76, no update
                # The lr this step applies: the param groups hold the full world's.
                lr = optimizer.param_groups[0]["lr"] * run.lr_factor
                optimizer.step()
                sched.step()
                optimizer.zero_grad(set_to_none=True)
                if step == args.inject_corruption_at and run.rank == min(1, run.world_size - 1):
                    with torch.no_grad():
                        model.head.weight[0, 0] *= -4.0  # a flipped sign and exponent bit
                log.write(
                    step=step,
                    rank=run.rank,
                    world=run.world_size,
                    global_batch=run.global_batch,
                    indices=indices,
                    loss=total,
                    lr=lr,
                )
                if args.step_sleep:
                    time.sleep(args.step_sleep)
    log.close()
    if args.save_final:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # Full (unsharded) tensors whatever the wrapping, so runs compare directly.
        full = StateDictOptions(full_state_dict=True)
        final = {
            "model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, optimizer, options=full),
            "step": run.step,
        }
        if run.rank == 0:
            torch.save(final, args.save_final)
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
