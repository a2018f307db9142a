"""Anomaly and straggler detectors.

The detectors are pure functions of what they are given (a window of past values,
per-rank step times), so they are unit-tested without torch; the training loop
feeds them and reports each finding with its evidence.

* Spikes use robust statistics: a value is a spike when it exceeds the window's
  median by more than ``threshold`` scaled MADs (median absolute deviation). A
  mean/stddev rule would let one earlier spike inflate the spread and hide the
  next one.
* Stragglers: the slowest rank's step time over the median of all ranks.
* Silent corruption: a fixed reference batch's loss, recomputed periodically in
  eval mode, must stay within tolerance of what the same weights produced before
  (call it right after a save and right after the resume from that save).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    kind: str
    """loss_spike | grad_norm_spike | straggler | nan | reference_drift"""
    step: int
    value: float
    evidence: str


def is_spike(
    value: float, window: list[float], *, threshold: float = 6.0, min_window: int = 8
) -> tuple[bool, str]:
    """(spike?, evidence). Too little history is never a spike."""
    if not math.isfinite(value):
        return True, f"value {value} is not finite"
    if len(window) < min_window:
        return False, "not enough history"
    med = statistics.median(window)
    mad = statistics.median(abs(x - med) for x in window)
    # A perfectly flat window has MAD 0: use a small floor relative to the median.
    scale = max(1.4826 * mad, 1e-3 * abs(med), 1e-12)
    z = (value - med) / scale
    return z > threshold, f"value {value:.4g} vs median {med:.4g} (robust z {z:.1f})"


@dataclass
class SpikeDetector:
    kind: str
    window: int = 50
    threshold: float = 6.0
    history: deque[float] = field(default_factory=deque)

    def observe(self, step: int, value: float) -> Finding | None:
        spike, why = is_spike(value, list(self.history), threshold=self.threshold)
        if not spike:  # spikes stay out of the window, so they cannot hide the next one
            self.history.append(value)
            if len(self.history) > self.window:
                self.history.popleft()
            return None
        return Finding(self.kind, step, value, why)


def detect_straggler(
    step: int, step_times: list[float], *, ratio_threshold: float = 1.5
) -> tuple[int, float, Finding | None]:
    """(slowest rank, its time over the median, a finding if over the threshold)."""
    med = statistics.median(step_times)
    slowest = max(range(len(step_times)), key=step_times.__getitem__)
    ratio = step_times[slowest] / med if med > 0 else 1.0
    finding = None
    if ratio >= ratio_threshold:
        finding = Finding(
            "straggler",
            step,
            ratio,
            f"rank {slowest} took {step_times[slowest]:.3f}s, median {med:.3f}s ({ratio:.2f}x)",
        )
    return slowest, ratio, finding


def check_reference(
    step: int, loss_now: float, loss_before: float, *, rtol: float = 1e-5
) -> Finding | None:
    """Same weights, same batch, same eval mode: the loss must not move."""
    if math.isfinite(loss_now) and abs(loss_now - loss_before) <= rtol * max(1.0, abs(loss_before)):
        return None
    return Finding(
        "reference_drift",
        step,
        loss_now,
        f"reference loss {loss_now!r} vs {loss_before!r} for identical weights",
    )


def detect_reference_divergence(
    step: int, losses: list[float], *, rtol: float = 1e-6
) -> Finding | None:
    """Every rank ran the same forward pass on the same weights and batch (DDP and
    FSDP keep the replicas identical), so every rank must get the same loss. A rank
    away from the median of all ranks (or any non-finite loss) is silent corruption
    in its memory or arithmetic. With two ranks there is no majority: both are named."""
    med = statistics.median(losses)
    tol = rtol * max(1.0, abs(med)) if math.isfinite(med) else 0.0
    bad = [r for r, v in enumerate(losses) if not math.isfinite(v) or abs(v - med) > tol]
    if not bad:
        return None
    if len(bad) * 2 >= len(losses):  # no majority agrees: everyone is suspect
        bad = list(range(len(losses)))
    shown = ", ".join(f"rank {r}: {losses[r]!r}" for r in bad)
    return Finding(
        "reference_drift",
        step,
        max(abs(losses[r] - med) if math.isfinite(losses[r]) else math.inf for r in bad),
        f"reference loss differs across replicas at step {step} ({shown}; median {med!r})",
    )
