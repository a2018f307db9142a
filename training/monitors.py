"""Anomaly and straggler detectors.

The detectors are pure functions of what they are given (a window of past values,
per-rank step times), so they are unit-tested without torch; the training loop
feeds them and reports each finding with its evidence.

* NaN/Inf is not a spike: ``Run.report`` catches a non-finite loss or grad norm on
  any rank with an all-reduce before the update (``nan`` anomaly, exit 76). The
  spike detector never sees one.
* Loss spikes (:class:`SpikeDetector`): a step's loss is *over* when it is above
  the median of a trailing window of accepted losses by both ``z`` robust
  standard deviations (1.4826 x MAD, median absolute deviation) **and**
  ``min_jump`` of the median. The first bound is the run's own noise: a noisy run
  needs a bigger excursion. The second is what a user means by a spike: on a
  smooth curve the MAD is tiny, and a robust-z rule alone flags a 0.96 against a
  median of 0.82 (the demo did, on every rank). A spike is reported only once
  ``persist`` consecutive steps are over, and it names its **onset** (the first
  of them), so a rollback can pick a checkpoint older than it. Values that are
  over stay out of the window while the run lasts, so a spike cannot raise its
  own baseline; a run that ends before ``persist`` was noise after all, and its
  values go back into the window.
* Grad norm never raises a finding by itself. It is noisier than the loss (it
  climbs through warmup and jumps 30-50% on ordinary batches of this reference
  script), clipping already bounds what one large gradient does to the weights,
  and a rollback costs every step since the checkpoint. It is shown as evidence
  beside a loss spike.
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

#: 1.4826 x MAD estimates the standard deviation of normally distributed noise.
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Finding:
    kind: str
    """loss_spike | straggler | slow_link | reference_drift"""
    step: int
    """For a spike: its onset step (see :class:`Spike`)."""
    value: float
    evidence: str


@dataclass(frozen=True)
class SpikeRule:
    """When a loss is a spike. The defaults keep 20 clean runs of the reference
    script free of findings (``tests/training/test_anomaly_signals.py``) while a
    10x jump is found after ``persist`` steps."""

    window: int = 50
    """Accepted values the median and MAD are taken over (the trailing ones)."""
    min_history: int = 20
    """Steps observed before anything can be over: the first steps of a run fall
    fast and their spread says nothing about later noise."""
    z: float = 6.0
    """Robust standard deviations (1.4826 x MAD) above the median."""
    min_jump: float = 0.5
    """And at least this fraction of the median above it (0.5: 1.5x the median)."""
    persist: int = 5
    """Consecutive steps over both bounds before it is reported."""

    def __post_init__(self) -> None:
        if self.window < 4 or self.min_history < 4:
            raise ValueError(
                f"window and min_history must be >= 4 (got {self.window}, {self.min_history})"
            )
        if not (self.z > 0 and math.isfinite(self.z)):
            raise ValueError(f"z must be a positive number, got {self.z}")
        if not (self.min_jump > 0 and math.isfinite(self.min_jump)):
            raise ValueError(f"min_jump must be a positive fraction, got {self.min_jump}")
        if self.persist < 1:
            raise ValueError(f"persist must be >= 1, got {self.persist}")


@dataclass(frozen=True)
class Spike:
    """A persistent spike, as found once ``persist`` steps were over."""

    onset_step: int
    """The first step over the threshold: the checkpoint ``step_<onset>`` holds the
    weights that computed that loss, so a rollback takes one older than it."""
    detected_step: int
    """The step that made it persistent (``onset_step + persist - 1``)."""
    onset_value: float
    peak: float
    median: float
    """The window's median before the onset (the baseline)."""
    threshold: float
    """What a value had to exceed: median + max(z x sigma, min_jump x |median|)."""

    def evidence(self, metric: str = "loss") -> str:
        steps = self.detected_step - self.onset_step + 1
        return (
            f"{metric} {self.onset_value:.4g} at step {self.onset_step} vs median "
            f"{self.median:.4g} (threshold {self.threshold:.4g}), over for {steps} steps, "
            f"peak {self.peak:.4g}"
        )


def spike_threshold(window: list[float], rule: SpikeRule) -> tuple[float, float]:
    """(median, threshold) of a window: a value above the threshold is over."""
    med = statistics.median(window)
    mad = statistics.median(abs(x - med) for x in window)
    return med, med + max(rule.z * MAD_TO_SIGMA * mad, rule.min_jump * abs(med))


@dataclass
class SpikeDetector:
    """Feed it one finite value per step; it returns a :class:`Spike` once, at the
    step a spike becomes persistent, and None otherwise."""

    rule: SpikeRule = field(default_factory=SpikeRule)
    history: deque[float] = field(default_factory=deque)
    seen: int = 0
    """Values observed (accepted or not)."""
    _over: list[tuple[int, float]] = field(default_factory=list)
    _baseline: tuple[float, float] | None = None
    """(median, threshold) frozen at the onset of the current run of over values."""
    _reported: bool = False

    def observe(self, step: int, value: float) -> Spike | None:
        if not math.isfinite(value):
            raise ValueError(f"step {step}: {value} is not finite (a NaN is not a spike)")
        self.seen += 1
        rule = self.rule
        if self.seen <= rule.min_history or len(self.history) < 4:
            self._accept(value)
            return None
        med, threshold = self._baseline or spike_threshold(list(self.history), rule)
        if value > threshold:
            if self._reported:
                return None  # the same spike, still going: reported once, at its onset
            if not self._over:
                self._baseline = (med, threshold)
            self._over.append((step, value))
            if len(self._over) == rule.persist:
                self._reported = True
                onset, first = self._over[0]
                return Spike(
                    onset_step=onset,
                    detected_step=step,
                    onset_value=first,
                    peak=max(v for _s, v in self._over),
                    median=med,
                    threshold=threshold,
                )
            return None
        if self._over and not self._reported:
            for _s, v in self._over:  # too short to be a spike: ordinary noise after all
                self._accept(v)
        self._over.clear()
        self._baseline = None
        self._reported = False
        self._accept(value)
        return None

    def _accept(self, value: float) -> None:
        self.history.append(value)
        while len(self.history) > self.rule.window:
            self.history.popleft()


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


class StragglerRun:
    """Reports a straggler only once the same rank was it ``persist`` shares in a row.

    A straggler stays slow; noise (a loaded host, a GC pause, a page fault) makes a
    different rank the slowest from one share to the next, so one finding alone says
    little (measured here: steps of 10-20 ms on a shared 2-core machine put some rank
    1.5x over the median at most shares, and three reports of any ranks opened false
    incidents)."""

    def __init__(self, persist: int = 3) -> None:
        if persist < 1:
            raise ValueError(f"persist must be >= 1, got {persist}")
        self.persist = persist
        self.rank = -1
        self.count = 0

    def observe(self, slowest: int, finding: Finding | None) -> Finding | None:
        """The finding, once ``slowest`` was over the threshold ``persist`` times in a
        row (and at every share after that while it stays so); else None."""
        if finding is None:
            self.rank, self.count = -1, 0
            return None
        self.count = self.count + 1 if slowest == self.rank else 1
        self.rank = slowest
        return finding if self.count >= self.persist else None


def detect_slow_link(
    step: int,
    uploads: list[tuple[int, int, float]],
    *,
    ratio_threshold: float = 4.0,
    min_extra_s: float = 1.0,
) -> tuple[int, Finding] | None:
    """The rank whose checkpoint upload ran far slower than the others', or None.

    ``uploads``: (rank, bytes, seconds) of each rank's own shards to the checkpoint
    store. A slow link slows every rank's step alike (they all wait in the same
    all-reduce), so step times cannot tell which node it is; each node's uploads go
    over its own link, so their rates can. Slow means a rate under the median's
    ``1/ratio_threshold`` *and* at least ``min_extra_s`` longer than the median rate
    would have taken (small shards time request latency, not bandwidth: measured on
    an unshaped run here, one rank's 0.5 MB took 0.66-0.79 s against a 0.14 s median,
    a client's first connection and a loaded machine)."""
    rates = [(r, b / s) for r, b, s in uploads if b > 0 and s > 0]
    if len(rates) < 2:
        return None
    med = statistics.median(rate for _r, rate in rates)
    rank, rate = min(rates, key=lambda x: x[1])
    nbytes, seconds = next((b, s) for r, b, s in uploads if r == rank)
    if rate * ratio_threshold > med or seconds - nbytes / med < min_extra_s:
        return None
    ratio = med / rate
    return rank, Finding(
        "slow_link",
        step,
        ratio,
        f"rank {rank} uploaded its shards at {rate / 1e6:.2f} MB/s, median {med / 1e6:.2f} MB/s "
        f"({ratio:.1f}x slower: {nbytes} bytes in {seconds:.2f} s)",
    )


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
