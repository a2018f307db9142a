"""Goodput accounting: where a job's wall time and money went.

In Meta's terms (Llama 3 report), *effective training time* is the share of elapsed
time spent on useful training. Everything else is one of:

* **failure time**: from detection to the first step after recovery, i.e. the
  restart protocol's steps (detect, signal, confirm checkpoint, select replacement,
  launch, stage, validate); its sum per incident is that incident's MTTR;
* **lost work**: steps that had trained but were redone after resuming from an older
  checkpoint or from scratch (``steps_lost * step_seconds``); for a script that sends
  no progress reports and restarted from scratch, the failed attempt's training time
  (``Incident.lost_seconds``: there are no steps to count, and the time is what the
  restart threw away);
* **checkpoint time**: what saves blocked training.

Dollar cost uses the plan's price: all GPUs are paid for during each of these. Pure;
the store turns its rows into these dataclasses and the API/CLI print the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.domain.failures import FailureClass
from orchestrator.domain.protocol import ProtocolStep


@dataclass(frozen=True)
class StepTiming:
    step: ProtocolStep
    started: float
    """Seconds since the job's epoch (any clock, as long as all timings share it)."""
    ended: float

    def __post_init__(self) -> None:
        if self.ended < self.started:
            raise ValueError(f"{self.step}: ends ({self.ended}) before it starts ({self.started})")

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass(frozen=True)
class Incident:
    failure_class: FailureClass
    steps: tuple[StepTiming, ...]
    steps_lost: int
    """Optimizer steps trained before the failure and redone after the resume."""
    lost_seconds: float | None = None
    """Training time thrown away where it cannot be counted in steps (a plain script
    restarted from scratch); when set, it is the incident's lost work."""

    def __post_init__(self) -> None:
        if self.steps_lost < 0:
            raise ValueError(f"steps_lost must be >= 0, got {self.steps_lost}")
        if self.lost_seconds is not None and not self.lost_seconds >= 0:
            raise ValueError(f"lost_seconds must be >= 0, got {self.lost_seconds}")
        if not self.steps:
            raise ValueError("an incident needs at least its detect step")

    @property
    def started(self) -> float:
        return min(s.started for s in self.steps)

    @property
    def ended(self) -> float:
        return max(s.ended for s in self.steps)

    @property
    def mttr_seconds(self) -> float:
        """Detection to validated relaunch. Steps may overlap, so this is the span."""
        return self.ended - self.started


@dataclass(frozen=True)
class JobRun:
    started: float
    ended: float
    gpus: int
    step_seconds: float
    """Measured mean optimizer step time."""
    price_per_gpu_hour: float
    incidents: tuple[Incident, ...] = ()
    checkpoint_blocking_seconds: float = 0.0
    """Total time saves blocked training over the run."""

    def __post_init__(self) -> None:
        if self.ended < self.started:
            raise ValueError("ended is before started")
        if self.gpus <= 0:
            raise ValueError(f"gpus must be positive, got {self.gpus}")
        if self.step_seconds < 0 or self.price_per_gpu_hour < 0:
            raise ValueError("step_seconds and price_per_gpu_hour must be >= 0")
        if self.checkpoint_blocking_seconds < 0:
            raise ValueError("checkpoint_blocking_seconds must be >= 0")
        for i in self.incidents:
            if i.started < self.started or i.ended > self.ended:
                raise ValueError(f"incident {i.failure_class} lies outside the run")


@dataclass(frozen=True)
class IncidentCost:
    failure_class: FailureClass
    mttr_seconds: float
    step_seconds: dict[ProtocolStep, float]
    """Duration of each protocol step (summed if a step ran more than once)."""
    lost_work_seconds: float
    dollars: float
    """(MTTR + lost work) x GPUs x price."""


@dataclass(frozen=True)
class GoodputReport:
    wall_seconds: float
    productive_seconds: float
    failure_seconds: float
    lost_work_seconds: float
    checkpoint_seconds: float
    total_dollars: float
    lost_dollars: float
    """Failure time and lost work, priced."""
    incidents: tuple[IncidentCost, ...]

    @property
    def effective_fraction(self) -> float:
        return self.productive_seconds / self.wall_seconds if self.wall_seconds else 1.0

    def to_json_dict(self) -> dict[str, object]:
        return {
            "effective_training_fraction": round(self.effective_fraction, 5),
            "wall_seconds": self.wall_seconds,
            "productive_seconds": self.productive_seconds,
            "failure_seconds": self.failure_seconds,
            "lost_work_seconds": self.lost_work_seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
            "total_usd": round(self.total_dollars, 2),
            "lost_usd": round(self.lost_dollars, 2),
            "incidents": [
                {
                    "class": str(c.failure_class),
                    "mttr_seconds": c.mttr_seconds,
                    "steps": {str(k): v for k, v in c.step_seconds.items()},
                    "lost_work_seconds": c.lost_work_seconds,
                    "usd": round(c.dollars, 2),
                }
                for c in self.incidents
            ],
        }


def _merged_span(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union: overlapping incidents must not count time twice."""
    total = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def account_goodput(run: JobRun) -> GoodputReport:
    """Split the run's wall time into productive, failure, lost-work and checkpoint time."""
    wall = run.ended - run.started
    dollars_per_second = run.gpus * run.price_per_gpu_hour / 3600.0
    costs = []
    for inc in run.incidents:
        per_step: dict[ProtocolStep, float] = {}
        for s in inc.steps:
            per_step[s.step] = per_step.get(s.step, 0.0) + s.seconds
        lost = (
            inc.lost_seconds if inc.lost_seconds is not None else inc.steps_lost * run.step_seconds
        )
        costs.append(
            IncidentCost(
                inc.failure_class,
                inc.mttr_seconds,
                per_step,
                lost,
                (inc.mttr_seconds + lost) * dollars_per_second,
            )
        )
    failure = _merged_span([(i.started, i.ended) for i in run.incidents])
    lost_work = sum(c.lost_work_seconds for c in costs)
    unaccounted = failure + lost_work + run.checkpoint_blocking_seconds
    if unaccounted > wall + 1e-9:
        raise ValueError(
            f"failure ({failure:.0f}s) + lost work ({lost_work:.0f}s) + checkpoints "
            f"({run.checkpoint_blocking_seconds:.0f}s) exceed the run's {wall:.0f}s"
        )
    return GoodputReport(
        wall_seconds=wall,
        productive_seconds=wall - unaccounted,
        failure_seconds=failure,
        lost_work_seconds=lost_work,
        checkpoint_seconds=run.checkpoint_blocking_seconds,
        total_dollars=wall * dollars_per_second,
        lost_dollars=(failure + lost_work) * dollars_per_second,
        incidents=tuple(costs),
    )
