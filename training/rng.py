"""Every rank's random number generators, saved and restored with the checkpoint.

Each rank stores its own states under ``rng/rank<R>`` in the DCP state dict: the
torch CPU generator, the current CUDA device's generator (when CUDA is in use),
Python's ``random`` and, when numpy has been imported, numpy's global generator.
DCP keeps per-rank keys apart, so one checkpoint holds every rank's streams.

**Same world size:** rank R gets back exactly rank R's states, so dropout masks
and any other random draw continue as if the run had never stopped (the exact
resume tests run with dropout to prove it).

**Different world size:** the old streams cannot map one-to-one (rank 3 of 4 has
no counterpart among 2 ranks, and the data each rank sees is resliced anyway), so
no rank restores a saved stream. Every rank instead reseeds all its generators
from ``(seed, step, rank)``. That is deterministic (resuming the same checkpoint
on the same new world size twice gives the same run) but not the stream an
uninterrupted run would have drawn. Model, optimizer, scheduler and the data
position reshard exactly; only randomness is redrawn.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any


def rng_key(rank: int) -> str:
    return f"rank{rank}"


def capture_rng_state() -> dict[str, Any]:
    """This rank's generator states, as DCP-saveable values."""
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def rng_load_template() -> dict[str, Any]:
    """Placeholders of the right shape for DCP to load this rank's states into."""
    return capture_rng_state()


def restore_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(_as_python_state(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _as_python_state(s: Any) -> tuple:
    # random.setstate wants (version, tuple_of_ints, gauss); a round trip through a
    # serializer may have turned the inner tuple into a list.
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed that depends on all three, stable across Python processes
    (``hash()`` is salted per process, so it is not used)."""
    digest = hashlib.sha256(f"skyresume:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def reseed_all(seed: int, step: int, rank: int) -> int:
    """Seed every generator of this rank from (seed, step, rank); returns the seed."""
    import torch

    s = derived_seed(seed, step, rank)
    torch.manual_seed(s)  # also seeds every CUDA device
    random.seed(s)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(s % (2**32))
    return s
