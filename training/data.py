"""A deterministic, resumable sampler whose position survives any world size.

The position is the number of *global* samples consumed, not a per-rank offset,
so it means the same thing on 2 ranks as on 4. Each step consumes one global
batch: the sample indices ``order[consumed : consumed + global_batch]`` of the
current epoch's order, split into contiguous per-rank slices by rank. The order
of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone (or the identity
with ``shuffle=False``), so it never depends on the world size, the RNG state or
what happened before a restart.

Resume: the checkpoint carries ``{"consumed", "seed", "global_batch",
"num_samples", "shuffle"}``; a resume onto another world size reslices the same
global batch, so every step sees exactly the samples it would have seen.
A saved state from a different dataset or global batch is refused by name.

Elastic batch scale (``training.elastic``) is the one case where the global batch
changes within a run: a smaller world takes fewer samples a step. Because the
position counts samples, the order of samples is unchanged; only where the step
boundaries fall in it moves. ``Run`` says so explicitly, with ``rebatch`` and
``load_state_dict(batch_may_change=True)``; nothing else lifts the refusal, since
a batch changed by mistake would silently train on other data per step.
"""

from __future__ import annotations

from typing import Any


class ResumableSampler:
    """Per-rank sample indices for each step; ``Run`` advances and checkpoints it."""

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        if rank is None or world_size is None:
            import torch.distributed as dist

            on = dist.is_available() and dist.is_initialized()
            if rank is None:
                rank = dist.get_rank() if on else 0
            if world_size is None:
                world_size = dist.get_world_size() if on else 1
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by {world_size} ranks")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.consumed = 0
        """Global samples consumed so far: the data position."""
        self._order_epoch: int | None = None
        self._order: Any = None

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def _epoch_order(self, epoch: int) -> Any:
        import torch

        if self._order_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(self.num_samples, generator=g)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def global_indices(self) -> list[int]:
        """The whole global batch of the next step (every rank's samples, in order)."""
        out: list[int] = []
        pos = self.consumed
        while len(out) < self.global_batch:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(self.global_batch - len(out), self.num_samples - offset)
            out.extend(self._epoch_order(epoch)[offset : offset + take].tolist())
            pos += take
        return out

    def indices(self) -> list[int]:
        """This rank's sample indices for the next step."""
        lo = self.rank * self.per_rank
        return self.global_indices()[lo : lo + self.per_rank]

    def rebatch(self, global_batch: int) -> None:
        """Take ``global_batch`` samples a step from the next one on (elastic batch
        scale); the position, in samples, is unchanged."""
        if global_batch < 1:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        if global_batch % self.world_size:
            raise ValueError(
                f"global batch {global_batch} is not divisible by {self.world_size} ranks"
            )
        self.global_batch = global_batch

    def reslice(self, rank: int, world_size: int, global_batch: int | None = None) -> None:
        """Serve ``rank`` of ``world_size`` from the next step on (a warm regroup: the
        same sampler in a process whose world changed), with ``global_batch`` when the
        batch follows the world (elastic scale). The position is unchanged; a resume
        sets it next."""
        batch = self.global_batch if global_batch is None else global_batch
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if batch < 1 or batch % world_size:
            raise ValueError(f"global batch {batch} is not divisible by {world_size} ranks")
        self.rank, self.world_size, self.global_batch = rank, world_size, batch

    def advance(self) -> None:
        """One step done: move past its global batch."""
        self.consumed += self.global_batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any], *, batch_may_change: bool = False) -> None:
        """``batch_may_change``: a state saved with another global batch is accepted
        (elastic batch scale: Run passes it); otherwise it is refused."""
        names = ("seed", "num_samples", "shuffle") + (() if batch_may_change else ("global_batch",))
        for name in names:
            if state.get(name) != getattr(self, name):
                raise ValueError(
                    f"sampler state: {name} was {state.get(name)!r} when saved, now "
                    f"{getattr(self, name)!r}; the data position would not mean the same samples"
                )
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise ValueError(
                f"sampler state: consumed must be a non-negative int, got {consumed!r}"
            )
        self.consumed = consumed
