"""Checkpoint-interval advisor: Young's interval from a measured MTBF.

Model (Young 1974; Daly 2006 refines it for saves that are not small against MTBF):

* interval ``T = sqrt(2 * S * M)``, with ``S`` the *blocking* save time (what the ranks
  wait for; with async saves, only the copy to host memory) and ``M`` the job's MTBF;
* expected lost fraction of wall time, first-order::

      S / T            time spent blocked in saves
    + T / (2 * M)      work redone: on average half an interval is lost per failure
    + R / M            restart: detect, replace, stage, relaunch, reload (R seconds)

  With Llama 3's rate on 512 GPUs (M ~ 99 h) and R = 10 min this gives a 109-minute
  interval and 2.0 % lost for 60 s saves; 31 minutes and 0.70 % for 5 s saves.

MTBF: the Llama 3 run saw 419 unexpected interruptions in 54 days on 16,384 GPUs; the
rate per GPU-hour scales linearly with the job's GPU count. Measured history per
(cloud, region, instance type) replaces it through a conjugate (gamma-Poisson) update
with a *mixture* of two gamma priors: Llama 3's rate, worth
:data:`PRIOR_PSEUDO_FAILURES` failures, and a vague component (mean one failure per
GPU-hour, worth half a GPU-hour) with a prior weight of :data:`VAGUE_PRIOR_WEIGHT`. A
single gamma prior cannot both keep a quiet day from declaring a region perfect and let
six failures in 1.3 GPU-hours speak: at Llama 3's rate two pseudo-failures are ~100,000
GPU-hours of pseudo-exposure, which outweighed that evidence ~80,000 to 1 and pushed a
40,719-step interval to a job failing every few minutes (issue 27). In the mixture each
component is updated exactly and reweighed by how well it predicted the counts
(negative binomial marginals): zero or one failure in a day keeps Llama 3's rate; a
third failure within a GPU-hour hands the estimate to the data.

The interval is Daly's (2006) first-order refinement of Young's, bounded to
[:data:`MIN_INTERVAL_S`, :data:`MAX_INTERVAL_S`], and a running job's interval moves by at
most :data:`MAX_FACTOR_PER_PUSH` per push (:func:`next_checkpoint_every`): one estimate,
however sure, never swings a job's saves by orders of magnitude at once.

Pure: the caller reads the history; times in seconds unless a name says hours.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
#: Failures per GPU-hour in the Llama 3 run.
LLAMA3_RATE_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)

#: How many failures' worth of evidence the Llama 3 component carries.
PRIOR_PSEUDO_FAILURES = 2.0

#: The vague component: Gamma(shape 0.5, 0.5 GPU-hours), mean 1 failure per GPU-hour,
#: so wide that it stands for "anything from rare to every few minutes".
VAGUE_PRIOR_SHAPE = 0.5
VAGUE_PRIOR_GPU_HOURS = 0.5
#: Its prior weight: small enough that with no history the estimate is Llama 3's rate
#: (within 0.01 %), large enough that three failures in a GPU-hour outweigh it.
VAGUE_PRIOR_WEIGHT = 1e-9

#: A save at most every this often, however reliable the placement looks: the estimate
#: of a quiet placement rests on the absence of evidence.
MAX_INTERVAL_S = 4 * 3600.0
#: And at least this far apart (Daly's interval can be shorter than a save on a
#: placement that fails every few seconds; saving back to back trains nothing).
MIN_INTERVAL_S = 1.0
#: A running job's ``every_steps`` moves by at most this factor per push.
MAX_FACTOR_PER_PUSH = 4.0

#: A pushed interval changes only when it moves by at least this fraction; jobs should
#: not be told a new interval on every noisy estimate.
MEANINGFUL_CHANGE = 0.2


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def llama3_mtbf_hours(gpus: int) -> float:
    """MTBF of a job on ``gpus`` GPUs at Llama 3's failure rate (3.09 h at 16,384)."""
    _positive("gpus", gpus)
    return 1.0 / (LLAMA3_RATE_PER_GPU_HOUR * gpus)


def young_interval_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    _positive("save_seconds", save_seconds)
    _positive("mtbf_seconds", mtbf_seconds)
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def daly_interval_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's first-order optimum: Young's, corrected for saves that are not small
    against the MTBF; the MTBF itself once a save takes half of it or more."""
    _positive("save_seconds", save_seconds)
    _positive("mtbf_seconds", mtbf_seconds)
    if save_seconds >= 2.0 * mtbf_seconds:
        return mtbf_seconds
    r = save_seconds / (2.0 * mtbf_seconds)
    young = math.sqrt(2.0 * save_seconds * mtbf_seconds)
    return max(young * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - save_seconds, save_seconds)


@dataclass(frozen=True)
class LostTime:
    save_fraction: float
    """Share of wall time blocked in saves: S / T."""
    rework_fraction: float
    """Share redone after failures: T / (2 M)."""
    restart_fraction: float
    """Share spent restarting: R / M."""

    @property
    def total(self) -> float:
        return self.save_fraction + self.rework_fraction + self.restart_fraction


def expected_lost(
    interval_seconds: float, save_seconds: float, restart_seconds: float, mtbf_seconds: float
) -> LostTime:
    _positive("interval_seconds", interval_seconds)
    _positive("mtbf_seconds", mtbf_seconds)
    if save_seconds < 0 or restart_seconds < 0:
        raise ValueError("save_seconds and restart_seconds must be >= 0")
    return LostTime(
        save_fraction=save_seconds / interval_seconds,
        rework_fraction=interval_seconds / (2.0 * mtbf_seconds),
        restart_fraction=restart_seconds / mtbf_seconds,
    )


@dataclass(frozen=True)
class Advice:
    gpus: int
    mtbf_hours: float
    interval_seconds: float
    lost: LostTime

    @property
    def interval_minutes(self) -> float:
        return self.interval_seconds / 60.0

    def to_json_dict(self) -> dict[str, float | int]:
        return {
            "gpus": self.gpus,
            "mtbf_hours": round(self.mtbf_hours, 3),
            "interval_seconds": round(self.interval_seconds, 1),
            "interval_minutes": round(self.interval_minutes, 2),
            "lost_fraction": round(self.lost.total, 5),
            "save_fraction": round(self.lost.save_fraction, 5),
            "rework_fraction": round(self.lost.rework_fraction, 5),
            "restart_fraction": round(self.lost.restart_fraction, 5),
        }


def advise(
    gpus: int, save_seconds: float, restart_seconds: float, mtbf_hours: float | None = None
) -> Advice:
    """Daly's interval (bounded) and expected loss; MTBF from Llama 3's rate when not
    given."""
    _positive("gpus", gpus)
    mtbf_h = llama3_mtbf_hours(gpus) if mtbf_hours is None else mtbf_hours
    _positive("mtbf_hours", mtbf_h)
    mtbf_s = mtbf_h * 3600.0
    interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, daly_interval_seconds(save_seconds, mtbf_s)))
    return Advice(
        gpus, mtbf_h, interval, expected_lost(interval, save_seconds, restart_seconds, mtbf_s)
    )


def interval_changed_meaningfully(current_seconds: float, new_seconds: float) -> bool:
    """Whether the service should push ``new_seconds`` to a job running ``current``."""
    _positive("current_seconds", current_seconds)
    _positive("new_seconds", new_seconds)
    return abs(new_seconds - current_seconds) / current_seconds >= MEANINGFUL_CHANGE


def next_checkpoint_every(
    current_every: int,
    step_seconds: float,
    interval_seconds: float,
    max_factor: float = MAX_FACTOR_PER_PUSH,
) -> int | None:
    """The ``every_steps`` to push to a job saving every ``current_every`` steps, or None
    when the advised interval is not a meaningful change (under 20 %).

    The advised interval in steps, moved at most ``max_factor`` from the current one:
    the next push, a minute later on fresher counts, goes on if the estimate holds.
    """
    if current_every < 1:
        raise ValueError(f"current_every must be >= 1, got {current_every!r}")
    _positive("step_seconds", step_seconds)
    _positive("interval_seconds", interval_seconds)
    if max_factor <= 1 or not math.isfinite(max_factor):
        raise ValueError(f"max_factor must be a finite number > 1, got {max_factor!r}")
    target = interval_seconds / step_seconds
    moved = min(current_every * max_factor, max(current_every / max_factor, target))
    new = max(1, round(moved))
    if new == current_every or not interval_changed_meaningfully(current_every, new):
        return None
    return new


# --- MTBF from history ---------------------------------------------------------------


@dataclass(frozen=True)
class PlacementKey:
    cloud: str
    region: str
    instance_type: str


@dataclass(frozen=True)
class Exposure:
    """Observed run time and failures of one placement (any number of jobs)."""

    key: PlacementKey
    gpu_hours: float
    failures: int

    def __post_init__(self) -> None:
        if self.gpu_hours < 0 or self.failures < 0:
            raise ValueError("gpu_hours and failures must be >= 0")


@dataclass(frozen=True)
class MtbfEstimate:
    key: PlacementKey
    rate_per_gpu_hour: float
    """Posterior mean failures per GPU-hour."""
    observed_failures: int
    observed_gpu_hours: float
    prior_weight: float
    """0..1: how much of the estimate is still the prior (1 = no data at all)."""

    def mtbf_hours(self, gpus: int) -> float:
        _positive("gpus", gpus)
        return 1.0 / (self.rate_per_gpu_hour * gpus)


def _log_marginal(shape: float, gpu_hours: float, n: int, e: float) -> float:
    """log P(n failures in e GPU-hours) under a Gamma(shape, gpu_hours) prior on the rate
    (negative binomial), without the -log(n!) every component shares."""
    return (
        math.lgamma(shape + n)
        - math.lgamma(shape)
        + shape * math.log(gpu_hours / (gpu_hours + e))
        + (n * math.log(e / (gpu_hours + e)) if n else 0.0)
    )


def estimate_rate(
    key: PlacementKey,
    history: Iterable[Exposure],
    prior_rate_per_gpu_hour: float = LLAMA3_RATE_PER_GPU_HOUR,
    prior_failures: float = PRIOR_PSEUDO_FAILURES,
    vague_weight: float = VAGUE_PRIOR_WEIGHT,
) -> MtbfEstimate:
    """Posterior mean of one placement's failure rate (module docstring: the mixture).

    Component k is Gamma(a_k, b_k); after n failures in E GPU-hours it is
    Gamma(a_k + n, b_k + E), with mean (a_k + n) / (b_k + E), and its weight is its
    prior weight times the chance it gave the counts. The estimate is the weighted
    mean. ``prior_weight`` is the share of the estimate the Llama 3 prior still
    carries: its posterior weight times b / (b + E).
    """
    _positive("prior_rate_per_gpu_hour", prior_rate_per_gpu_hour)
    _positive("prior_failures", prior_failures)
    if not 0 <= vague_weight < 1:
        raise ValueError(f"vague_weight must be within [0, 1), got {vague_weight!r}")
    n = 0
    e = 0.0
    for x in history:
        if x.key == key:
            n += x.failures
            e += x.gpu_hours
    a, b = prior_failures, prior_failures / prior_rate_per_gpu_hour
    components = [(1.0 - vague_weight, a, b)]
    if vague_weight > 0:
        components.append((vague_weight, VAGUE_PRIOR_SHAPE, VAGUE_PRIOR_GPU_HOURS))
    logs = [math.log(w) + _log_marginal(ak, bk, n, e) for w, ak, bk in components]
    top = max(logs)
    weights = [math.exp(x - top) for x in logs]
    total = sum(weights)
    rate = sum(w * (ak + n) / (bk + e) for w, (_, ak, bk) in zip(weights, components, strict=True))
    llama_share = weights[0] / total * b / (b + e)
    return MtbfEstimate(key, rate / total, n, e, llama_share)


def advise_from_history(
    key: PlacementKey,
    history: Iterable[Exposure],
    gpus: int,
    save_seconds: float,
    restart_seconds: float,
) -> tuple[Advice, MtbfEstimate]:
    """What the reconciler calls per running job: MTBF from this placement's history
    (Llama 3's rate where it is thin, the measured rate once failures say otherwise),
    then Daly's interval for the job's measured save time. The reconciler turns it into
    steps with :func:`next_checkpoint_every`."""
    est = estimate_rate(key, history)
    return advise(gpus, save_seconds, restart_seconds, est.mtbf_hours(gpus)), est


def collective_timeout_s(
    slowest_step_s: float | None,
    blocking_save_s: float | None,
    *,
    factor: float = 10.0,
    floor_s: float = 60.0,
    cap_s: float = 600.0,
) -> int | None:
    """The process group's timeout for a relaunch, from what the job measured.

    A healthy collective completes within one step; the longest legitimate wait is a
    rank blocked in a save while its peers wait at the next collective. ``factor``
    times the larger of the two leaves room for noise; the floor covers start-up
    (the first steps compile and allocate), the cap is torch's own default, so a
    hang is caught in about a minute on a fast job instead of after ten. None when
    nothing was measured (a first launch keeps the default)."""
    measured = [x for x in (slowest_step_s, blocking_save_s) if x is not None and x > 0]
    if not measured:
        return None
    return round(min(cap_s, max(floor_s, factor * max(measured))))
