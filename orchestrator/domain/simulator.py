"""Discrete-event simulation of a long training run under failures, per recovery policy.

Question it answers: over ``days`` of wall time on ``gpus`` GPUs, how much of the time
trains (Meta's *effective training time*), and what the lost time costs, for

* ``skyresume``: async saves (seconds of blocking), emergency saves on preemption
  notices, progress-stall detection, replacement of only the failed node;
* ``skypilot-managed``: a SkyPilot-managed-jobs-like baseline: sync saves, status
  polled every 15 s, every failure relaunches the whole cluster, notices ignored;
* ``torchrun``: torchrun restarts only: hangs wait for the NCCL watchdog, transient
  failures restart in place, but a dead node waits for a human to replace it.

The failure trace is generated once per seed in wall time and replayed through each
policy (common random numbers), so differences come from the policies, not the dice.
Failures that arrive while the job is already down are absorbed by that incident.
Each policy checkpoints at Young's interval for its own blocking save time, from the
model's MTBF; with no failures there is nothing to protect against, no periodic save,
and effective time is 100 %.

Failure model ``llama3``: 419 unexpected interruptions in 54 days on 16,384 GPUs
(rate per GPU-hour, scaled by GPU count), with the root-cause mix of the Llama 3 paper
(Dubey et al. 2024, Table 5) mapped onto the taxonomy. Optional spot preemptions add
``preemption_notice`` events on top. Pure and seeded: ``random.Random(seed)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from orchestrator.domain.advisor import LLAMA3_RATE_PER_GPU_HOUR, young_interval_seconds
from orchestrator.domain.failures import FailureClass

_F = FailureClass

#: Llama 3 Table 5 root causes (counts of the 419) mapped onto the taxonomy:
#: faulty GPU 148 + HBM3 72 + SRAM 19 + GPU system processor 17 + thermal 6 -> hardware;
#: host maintenance 32, SSD 3, PSU 3, chassis 2, IO board 2, CPU 2, DRAM 2 -> node lost;
#: network switch/cable 35 + NIC 7 -> transport; NCCL watchdog 7; software bug 54 +
#: dependency 2 -> a (transient, fixed) software error; silent data corruption 6.
LLAMA3_MIX: dict[FailureClass, int] = {
    _F.GPU_HARDWARE: 262,
    _F.NODE_LOST: 46,
    _F.NCCL_TRANSPORT: 42,
    _F.NCCL_TIMEOUT: 7,
    _F.USER_CODE_ERROR: 56,
    _F.SILENT_CORRUPTION: 6,
}

#: Classes that show up as a hang (no process exits), so detection waits for a timeout.
HANG_CLASSES = frozenset({_F.NCCL_TIMEOUT, _F.NODE_LOST, _F.GPU_HARDWARE})
#: Classes whose recovery needs a different node.
REPLACE_CLASSES = frozenset({_F.GPU_HARDWARE, _F.NODE_LOST, _F.PREEMPTION_NOTICE})
#: Classes whose recovery also discards the newest checkpoint (it may hold bad state).
ROLLBACK_CLASSES = frozenset({_F.SILENT_CORRUPTION, _F.NAN_DIVERGENCE})


class FailureModelName(StrEnum):
    LLAMA3 = "llama3"
    NONE = "none"


@dataclass(frozen=True)
class FailureModel:
    rate_per_gpu_hour: float
    """Unexpected interruptions per GPU-hour (not counting spot preemptions)."""
    mix: Mapping[FailureClass, float]
    """Relative weights of the classes of those interruptions."""
    spot_preemptions_per_day: float = 0.0
    """Job-level spot reclaims per day, each announced by a notice."""
    notice_lead_seconds: float = 120.0
    """How far ahead a notice comes (AWS ~120 s, GCP/Azure ~30 s)."""

    def __post_init__(self) -> None:
        if self.rate_per_gpu_hour < 0 or self.spot_preemptions_per_day < 0:
            raise ValueError("failure rates must be >= 0")
        if self.rate_per_gpu_hour > 0 and not any(w > 0 for w in self.mix.values()):
            raise ValueError("mix needs at least one positive weight")

    def job_rate_per_second(self, gpus: int) -> float:
        return self.rate_per_gpu_hour * gpus / 3600.0 + self.spot_preemptions_per_day / 86400.0


def failure_model(
    name: FailureModelName | str,
    *,
    rate_multiplier: float = 1.0,
    spot_preemptions_per_day: float = 0.0,
) -> FailureModel:
    name = FailureModelName(name)
    if rate_multiplier < 0:
        raise ValueError("rate_multiplier must be >= 0")
    if name is FailureModelName.NONE:
        return FailureModel(0.0, {}, spot_preemptions_per_day)
    mix = {k: float(v) for k, v in LLAMA3_MIX.items()}
    return FailureModel(LLAMA3_RATE_PER_GPU_HOUR * rate_multiplier, mix, spot_preemptions_per_day)


def failure_model_from_history(
    class_counts: Mapping[FailureClass, int],
    gpu_hours: float,
    *,
    prior_failures: float = 2.0,
    spot_preemptions_per_day: float = 0.0,
) -> FailureModel:
    """A failure model from the service's measured history instead of Llama 3's.

    Rate: gamma-Poisson posterior mean with the Llama 3 rate as prior (see
    :func:`orchestrator.domain.advisor.estimate_rate`). Mix: measured counts plus the
    Llama 3 mix scaled to ``prior_failures`` pseudo-failures, so classes never seen yet
    keep a small weight instead of vanishing. Preemptions in the counts are left out:
    spot reclaims are modelled per day by ``spot_preemptions_per_day``.
    """
    if gpu_hours < 0:
        raise ValueError(f"gpu_hours must be >= 0, got {gpu_hours}")
    if any(n < 0 for n in class_counts.values()):
        raise ValueError("class counts must be >= 0")
    counts = {c: n for c, n in class_counts.items() if c is not _F.PREEMPTION_NOTICE}
    total = sum(counts.values())
    b = prior_failures / LLAMA3_RATE_PER_GPU_HOUR
    rate = (prior_failures + total) / (b + gpu_hours)
    llama_total = sum(LLAMA3_MIX.values())
    mix: dict[FailureClass, float] = {
        c: prior_failures * n / llama_total for c, n in LLAMA3_MIX.items()
    }
    for c, n in counts.items():
        mix[c] = mix.get(c, 0.0) + n
    return FailureModel(rate, mix, spot_preemptions_per_day)


@dataclass(frozen=True)
class SimPolicy:
    name: str
    blocking_save_seconds: float
    """What every periodic save stops training for."""
    detect_crash_seconds: float
    """From a process exit to the start of recovery."""
    detect_hang_seconds: float
    """From a hang (no exit) to the start of recovery."""
    restart_in_place_seconds: float
    """Relaunch on the same nodes, rendezvous and reload."""
    replace_node_seconds: float
    """Get a different node, stage the checkpoint, relaunch, reload."""
    uses_notices: bool
    """Emergency save on a preemption notice, so no work is redone."""
    whole_cluster_relaunch: bool = False
    """Every failure tears down and relaunches the whole cluster."""
    interval_seconds: float | None = None
    """Fixed checkpoint interval; None = Young's interval for this policy."""

    def __post_init__(self) -> None:
        for name in (
            "blocking_save_seconds",
            "detect_crash_seconds",
            "detect_hang_seconds",
            "restart_in_place_seconds",
            "replace_node_seconds",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.interval_seconds is not None and self.interval_seconds <= 0:
            raise ValueError("interval_seconds must be positive")

    def downtime(self, cls: FailureClass) -> float:
        detect = self.detect_hang_seconds if cls in HANG_CLASSES else self.detect_crash_seconds
        if cls is _F.PREEMPTION_NOTICE and self.uses_notices:
            detect = 0.0  # the notice arrives before the node goes away
        if self.whole_cluster_relaunch:
            return detect + self.replace_node_seconds
        if cls in REPLACE_CLASSES:
            return detect + self.replace_node_seconds
        return detect + self.restart_in_place_seconds


#: The three policies the issue compares. Figures are assumptions stated in the docs:
#: async save blocking ~5 s vs sync ~60 s at scale; a single-node replacement with
#: staging ~5 min; a whole-cluster relaunch ~15 min; a human replacing a node ~2 h;
#: NCCL's default watchdog 10 min; torchrun re-rendezvous + reload ~2 min.
POLICIES: dict[str, SimPolicy] = {
    "skyresume": SimPolicy(
        name="skyresume",
        blocking_save_seconds=5.0,
        detect_crash_seconds=5.0,
        detect_hang_seconds=60.0,
        restart_in_place_seconds=90.0,
        replace_node_seconds=300.0,
        uses_notices=True,
    ),
    "skypilot-managed": SimPolicy(
        name="skypilot-managed",
        blocking_save_seconds=60.0,
        detect_crash_seconds=15.0,
        detect_hang_seconds=615.0,
        restart_in_place_seconds=900.0,
        replace_node_seconds=900.0,
        uses_notices=False,
        whole_cluster_relaunch=True,
    ),
    "torchrun": SimPolicy(
        name="torchrun",
        blocking_save_seconds=60.0,
        detect_crash_seconds=1.0,
        detect_hang_seconds=600.0,
        restart_in_place_seconds=120.0,
        replace_node_seconds=7200.0,
        uses_notices=False,
    ),
}


@dataclass(frozen=True)
class FailureEvent:
    at_seconds: float
    failure_class: FailureClass


def failure_trace(
    model: FailureModel, gpus: int, horizon_seconds: float, seed: int
) -> tuple[FailureEvent, ...]:
    """Poisson arrivals over the horizon, classes drawn from the mix. Seeded."""
    if gpus <= 0:
        raise ValueError(f"gpus must be positive, got {gpus}")
    if horizon_seconds <= 0:
        raise ValueError(f"horizon must be positive, got {horizon_seconds}")
    rng = random.Random(seed)
    events: list[FailureEvent] = []
    hw_rate = model.rate_per_gpu_hour * gpus / 3600.0
    spot_rate = model.spot_preemptions_per_day / 86400.0
    classes = list(model.mix)
    weights = [model.mix[c] for c in classes]
    for rate, pick_class in ((hw_rate, True), (spot_rate, False)):
        if rate <= 0:
            continue
        t = rng.expovariate(rate)
        while t < horizon_seconds:
            cls = rng.choices(classes, weights)[0] if pick_class else _F.PREEMPTION_NOTICE
            events.append(FailureEvent(t, cls))
            t += rng.expovariate(rate)
    events.sort(key=lambda e: e.at_seconds)
    return tuple(events)


@dataclass(frozen=True)
class SimResult:
    policy: str
    gpus: int
    wall_seconds: float
    productive_seconds: float
    save_seconds: float
    """Blocked in periodic and emergency saves."""
    rework_seconds: float
    """Training redone after failures (work since the last usable checkpoint)."""
    down_seconds: float
    """Detection + recovery, nothing training."""
    failures: int
    """Failures that started an incident (others were absorbed by one in progress)."""
    interval_seconds: float | None
    price_per_gpu_hour: float
    by_class: dict[FailureClass, int] = field(default_factory=dict)

    @property
    def effective_fraction(self) -> float:
        return self.productive_seconds / self.wall_seconds

    @property
    def total_cost(self) -> float:
        return self.wall_seconds / 3600.0 * self.gpus * self.price_per_gpu_hour

    @property
    def lost_cost(self) -> float:
        return self.total_cost * (1.0 - self.effective_fraction)

    def to_json_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "effective_training_fraction": round(self.effective_fraction, 5),
            "productive_hours": round(self.productive_seconds / 3600, 2),
            "save_hours": round(self.save_seconds / 3600, 2),
            "rework_hours": round(self.rework_seconds / 3600, 2),
            "down_hours": round(self.down_seconds / 3600, 2),
            "failures": self.failures,
            "by_class": {str(k): v for k, v in sorted(self.by_class.items())},
            "checkpoint_interval_minutes": (
                None if self.interval_seconds is None else round(self.interval_seconds / 60, 1)
            ),
            "total_cost_usd": round(self.total_cost, 2),
            "lost_cost_usd": round(self.lost_cost, 2),
        }


def _split(run: float, cycle: float) -> tuple[int, float]:
    """Whole (interval + save) cycles in ``run`` seconds of uptime, and the remainder."""
    if not math.isfinite(cycle):
        return 0, run
    full = math.floor(run / cycle)
    return full, run - full * cycle


def _interval(policy: SimPolicy, model: FailureModel, gpus: int) -> float | None:
    if policy.interval_seconds is not None:
        return policy.interval_seconds
    rate = model.job_rate_per_second(gpus)
    if rate <= 0 or policy.blocking_save_seconds <= 0:
        return None  # nothing to protect against, or saving is free: no periodic save
    return young_interval_seconds(policy.blocking_save_seconds, 1.0 / rate)


def simulate(
    policy: SimPolicy,
    model: FailureModel,
    gpus: int,
    days: float,
    seed: int = 0,
    price_per_gpu_hour: float = 2.0,
    trace: tuple[FailureEvent, ...] | None = None,
) -> SimResult:
    """Replay a failure trace through one policy. O(failures + checkpoints)."""
    horizon = days * 86400.0
    if trace is None:
        trace = failure_trace(model, gpus, horizon, seed) if horizon > 0 else ()
    if horizon <= 0:
        raise ValueError(f"days must be positive, got {days}")
    if price_per_gpu_hour < 0:
        raise ValueError("price_per_gpu_hour must be >= 0")
    interval = _interval(policy, model, gpus)
    save = policy.blocking_save_seconds
    cycle = math.inf if interval is None else interval + save

    productive = saved = rework = 0.0
    failures = 0
    by_class: dict[FailureClass, int] = {}
    up_since = 0.0  # when the current run segment started (after a recovery)
    for ev in trace:
        if ev.at_seconds < up_since:
            continue  # absorbed by the incident in progress
        full, partial = _split(ev.at_seconds - up_since, cycle)
        # Work in the interrupted cycle: training up to the failure, or a whole interval
        # plus part of a save that did not complete (then the interval is lost too).
        committed = full * (interval or 0.0)
        saved += full * save
        if interval is not None and partial > interval:
            lost = interval
            saved += partial - interval
        else:
            lost = partial
        notice_saved = ev.failure_class is _F.PREEMPTION_NOTICE and policy.uses_notices
        if notice_saved:
            # Emergency save on the notice: the work is kept at the price of one save.
            committed += lost
            saved += save
            lost = 0.0
        productive += committed
        rework += lost
        if ev.failure_class in ROLLBACK_CLASSES and interval is not None:
            # The newest checkpoint may hold the corrupted state: go back one more.
            back = min(productive, interval)
            productive -= back
            rework += back
        failures += 1
        by_class[ev.failure_class] = by_class.get(ev.failure_class, 0) + 1
        # The emergency save ran inside the notice's lead time, before the node went.
        ends = ev.at_seconds + (save if notice_saved else 0.0) + policy.downtime(ev.failure_class)
        up_since = min(horizon, ends)
    if up_since < horizon:
        full, partial = _split(horizon - up_since, cycle)
        # The run ends here: training in the last partial cycle counts (a final save
        # would keep it), a save cut off by the end is save time.
        productive += full * (interval or 0.0) + (min(partial, interval) if interval else partial)
        saved += full * save + (max(0.0, partial - interval) if interval else 0.0)
    # Whatever is not training, saving or redone was spent detecting and recovering
    # (an incident cut off by the horizon counts only up to it).
    down = horizon - productive - saved - rework
    return SimResult(
        policy.name, gpus, horizon, productive, saved, rework, down, failures, interval,
        price_per_gpu_hour, by_class,
    )  # fmt: skip


def compare(
    policies: Mapping[str, SimPolicy],
    model: FailureModel,
    gpus: int,
    days: float,
    seed: int = 0,
    price_per_gpu_hour: float = 2.0,
) -> list[SimResult]:
    """Every policy on the same failure trace."""
    trace = failure_trace(model, gpus, days * 86400.0, seed)
    return [
        simulate(p, model, gpus, days, seed, price_per_gpu_hour, trace) for p in policies.values()
    ]
