"""Resume validation: every rank must have loaded the same checkpoint before the
first optimizer step. One all-gather of (step, manifest digest) per resume; any
disagreement stops training with an error that names the ranks and their steps."""

from __future__ import annotations

from dataclasses import dataclass


class ResumeMismatch(RuntimeError):
    """Ranks loaded different checkpoints. Training must not start."""


@dataclass(frozen=True)
class RankResume:
    rank: int
    step: int | None
    """None = the rank starts from scratch."""
    digest: str | None


def check_agreement(views: list[RankResume], *, expected_step: int | None = None) -> int | None:
    """The agreed step, or ResumeMismatch naming each group of ranks. Pure."""
    groups: dict[tuple[int | None, str | None], list[int]] = {}
    for v in views:
        groups.setdefault((v.step, v.digest), []).append(v.rank)
    if len(groups) > 1:
        parts = [
            f"ranks {_ranges(ranks)} at step {step if step is not None else 'none (fresh start)'}"
            + (f" (manifest {digest[:12]})" if digest else "")
            for (step, digest), ranks in sorted(groups.items(), key=lambda kv: kv[1][0])
        ]
        raise ResumeMismatch("ranks loaded different checkpoints: " + "; ".join(parts))
    ((step, _digest),) = groups
    # A fresh start loads nothing (step None): that is what "staged step 0" means.
    if expected_step is not None and (step if step is not None else 0) != expected_step:
        raise ResumeMismatch(
            f"all ranks loaded step {step}, but the orchestrator staged step {expected_step}"
        )
    return step


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    out, start, prev = [], ranks[0], ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def agree_on_resume(
    step: int | None, digest: str | None, *, expected_step: int | None = None, group=None
) -> int | None:
    """All-gather this rank's (step, digest) and check every rank agrees."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return check_agreement([RankResume(0, step, digest)], expected_step=expected_step)
    world = dist.get_world_size(group)
    gathered: list[tuple[int | None, str | None] | None] = [None] * world
    dist.all_gather_object(gathered, (step, digest), group=group)
    views = [RankResume(r, *(g or (None, None))) for r, g in enumerate(gathered)]
    return check_agreement(views, expected_step=expected_step)


@dataclass(frozen=True)
class RankCandidates:
    """What one rank could resume from: the complete checkpoints on its disk."""

    rank: int
    candidates: tuple[tuple[int, str], ...]
    """(step, manifest digest) of every complete checkpoint it found, any order."""
    error: str | None = None
    """Why this rank could not even look (a failed staging, an unreadable path)."""


def choose_checkpoint(views: list[RankCandidates], *, explicit: bool) -> tuple[int, str] | None:
    """The (step, digest) every rank will load, or None for a fresh start. Pure.

    Nodes have their own disks, so ranks may see different sets: the newest
    checkpoint that *every* rank has wins. A fresh start happens only when no
    rank has any checkpoint: if some do and they share none, training would
    silently restart from scratch, so that is a ResumeMismatch naming each rank's
    newest. ``explicit`` (one path was asked for): every rank must have found it,
    with the same manifest.
    """
    errors = [v for v in views if v.error]
    if errors:
        raise CheckpointUnusable("; ".join(f"rank {v.rank}: {v.error}" for v in errors))
    if explicit:
        missing = [v.rank for v in views if not v.candidates]
        if missing:
            raise CheckpointUnusable(f"ranks {_ranges(missing)} found no usable checkpoint there")
        check_agreement([RankResume(v.rank, *max(v.candidates)) for v in views])
        return max(views[0].candidates)
    if not any(v.candidates for v in views):
        return None
    common = set(views[0].candidates).intersection(*(set(v.candidates) for v in views[1:]))
    if not common:
        newest = [
            RankResume(v.rank, *(max(v.candidates) if v.candidates else (None, None)))
            for v in views
        ]
        try:
            check_agreement(newest)
            detail = ""
        except ResumeMismatch as e:
            detail = ": " + str(e).split(": ", 1)[-1]
        raise ResumeMismatch(f"no checkpoint is on every rank's disk; newest per rank{detail}")
    return max(common)


class CheckpointUnusable(RuntimeError):
    """The checkpoint asked for cannot be loaded (partial, corrupt, not staged)."""
