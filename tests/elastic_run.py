"""What an elastic run's ranks trained, read back and held against an uninterrupted run
of the same script (issue 20's checks, shared by the local and the SkyPilot e2e).

``training.examples.train_gpt --sample-log DIR/{rank}.jsonl`` writes one line per
rank per step: the step, the sample ids, the loss, the world size, the launch and the
pid. A resume redoes the steps after its checkpoint, so a step's lines are those of
the latest launch that ran it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

Samples = dict[int, list[dict[str, Any]]]


def read_samples(d: Path) -> Samples:
    """Per step, the lines of the latest launch that ran it, in rank order."""
    lines: Samples = defaultdict(list)
    for f in d.glob("*.jsonl"):
        for raw in f.read_text().splitlines():
            rec = json.loads(raw)
            lines[rec["step"]].append(rec)
    out = {}
    for step, recs in lines.items():
        latest = max(r["launch"] for r in recs)
        out[step] = sorted((r for r in recs if r["launch"] == latest), key=lambda r: r["rank"])
    return out


def uninterrupted(home: Path, args: str, nproc: int) -> Path:
    """The same script on ``nproc`` ranks of this machine, nothing injected: the
    baseline. Its samples are under ``home/samples``, its weights at ``home/final.pt``."""
    home.mkdir()
    (home / "samples").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_RUN_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), "-m", "training.examples.train_gpt", *args.split(),
        "--checkpoint-uri", f"file://{home / 'ckpt'}",
        "--sample-log", f"{home / 'samples'}/{{rank}}.jsonl",
        "--save-final", str(home / "final.pt"),
    ]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, timeout=600, capture_output=True)
    return home


def worlds_checked(
    got: Samples, steps: int, global_batch: int, dataset_size: int, want: Samples | None = None
) -> list[int]:
    """Each step's world size, after checking that every step ran once and its global
    batch holds the spec's ``global_batch`` samples, the sampler's own (and the
    baseline's, when given): over the run no sample is repeated or skipped."""
    from training.data import ResumableSampler

    assert sorted(got) == list(range(steps)), sorted(set(range(steps)) ^ set(got))[:10]
    sampler = ResumableSampler(dataset_size, global_batch, seed=0, rank=0, world_size=1)
    worlds = []
    for step in range(steps):
        ids = [i for r in got[step] for i in r["indices"]]
        assert len(ids) == global_batch, (step, len(ids))
        assert all(r["global_batch"] == global_batch for r in got[step]), step
        assert ids == sampler.global_indices(), step
        if want is not None:
            assert ids == [i for r in want[step] for i in r["indices"]], step
        sampler.advance()
        worlds.append(got[step][0]["world"])
    return worlds


def phases(worlds: list[int]) -> list[int]:
    """The world sizes in the order the run had them: [3, 2, 3] for a shrink and a grow."""
    return [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]


def worst_loss_gap(got: Samples, want: Samples, steps: int) -> float:
    """The largest gap between the two runs' mean loss at one step."""

    def mean(recs: list[dict[str, Any]]) -> float:
        return float(sum(r["loss"] for r in recs) / len(recs))

    return max(abs(mean(got[s]) - mean(want[s])) for s in range(steps))


def worst_weight_gap(mine: Path, theirs: Path, d_model: int) -> float:
    """The largest gap between two final weights, every value but the attention's key
    bias (the middle third of ``in_proj_bias``): its gradient is exactly zero in real
    arithmetic (softmax ignores a bias every key shares), so AdamW steps its float
    noise by up to the learning rate either way and it follows no run (measured over
    160 steps: up to 5e-3 apart, every other value at most 7.2e-7)."""
    import torch

    a = torch.load(mine, weights_only=False)["model"]
    b = torch.load(theirs, weights_only=False)["model"]
    d = d_model

    def comparable(k: str, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:d], t[2 * d :]]) if k.endswith("attn.in_proj_bias") else t

    return max((comparable(k, a[k]) - comparable(k, b[k])).abs().max().item() for k in b)
