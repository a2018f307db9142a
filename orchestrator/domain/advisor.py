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
(cloud, region, instance type) replaces it through a gamma-Poisson update: the Llama 3
rate is the prior, worth :data:`PRIOR_PSEUDO_FAILURES` failures, so a region with a
day of history is not declared perfectly reliable (or hopeless) on one sample.

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

#: How many failures' worth of evidence the prior carries. Small: two failures of real
#: history already move the estimate halfway.
PRIOR_PSEUDO_FAILURES = 2.0

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
    """Young's interval and expected loss; MTBF from Llama 3's rate when not given."""
    _positive("gpus", gpus)
    mtbf_h = llama3_mtbf_hours(gpus) if mtbf_hours is None else mtbf_hours
    _positive("mtbf_hours", mtbf_h)
    mtbf_s = mtbf_h * 3600.0
    interval = young_interval_seconds(save_seconds, mtbf_s)
    return Advice(
        gpus, mtbf_h, interval, expected_lost(interval, save_seconds, restart_seconds, mtbf_s)
    )


def interval_changed_meaningfully(current_seconds: float, new_seconds: float) -> bool:
    """Whether the service should push ``new_seconds`` to a job running ``current``."""
    _positive("current_seconds", current_seconds)
    _positive("new_seconds", new_seconds)
    return abs(new_seconds - current_seconds) / current_seconds >= MEANINGFUL_CHANGE


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


def estimate_rate(
    key: PlacementKey,
    history: Iterable[Exposure],
    prior_rate_per_gpu_hour: float = LLAMA3_RATE_PER_GPU_HOUR,
    prior_failures: float = PRIOR_PSEUDO_FAILURES,
) -> MtbfEstimate:
    """Gamma-Poisson posterior mean of the failure rate for one placement.

    Prior Gamma(a, b) with a = ``prior_failures`` and b = a / prior rate (GPU-hours), so
    its mean is the prior rate. After n failures in E GPU-hours the mean is
    (a + n) / (b + E): thin data stays near the prior, plenty of data wins.
    """
    _positive("prior_rate_per_gpu_hour", prior_rate_per_gpu_hour)
    _positive("prior_failures", prior_failures)
    n = 0
    e = 0.0
    for x in history:
        if x.key == key:
            n += x.failures
            e += x.gpu_hours
    a = prior_failures
    b = prior_failures / prior_rate_per_gpu_hour
    return MtbfEstimate(key, (a + n) / (b + e), n, e, b / (b + e))


def advise_from_history(
    key: PlacementKey,
    history: Iterable[Exposure],
    gpus: int,
    save_seconds: float,
    restart_seconds: float,
) -> tuple[Advice, MtbfEstimate]:
    """What the reconciler calls per running job: MTBF from this placement's history
    (Llama 3 prior where it is thin), then Young's interval for the job's measured save
    time. Push the interval only if :func:`interval_changed_meaningfully` says so."""
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
