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

Elastic variant (:func:`simulate_elastic`, :class:`ElasticPlan`, issue 20): on a failure
that needs a different node, ``skyresume`` waiting for a full set idles every GPU for the
replacement's provisioning plus a restart; the elastic one restarts at once on the
survivors (one restart), trains at ``active / nodes`` of full throughput while the
replacement provisions, and grows back when it is ready (one blocking save + one
restart). Effective time is GPU-time-weighted: a phase on 3 of 4 nodes counts 0.75 of
its wall time. Below ``min_nodes`` it waits for the full set, as without elasticity.
An example sequence on 4 nodes, ``min_nodes`` 3, provisioning P, restart R, save s::

    node lost (detect) -> restart on 3 (R) -> train at 3/4 (P - R) -> save (s)
    -> restart on 4 (R) -> train at 4/4;  waiting: down (P + R) -> train at 4/4

so the gain per incident is ``3/4 * (P - R) - s``, and a shrink is only made when that
is positive for the expected P (with P <= R the replacement is there before the
survivors would have restarted).

Failure model ``llama3``: 419 unexpected interruptions in 54 days on 16,384 GPUs
(rate per GPU-hour, scaled by GPU count), with the root-cause mix of the Llama 3 paper
(Dubey et al. 2024, Table 5) mapped onto the taxonomy. Optional spot preemptions add
``preemption_notice`` events on top. Pure and seeded: ``random.Random(seed)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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

    def detect_seconds(self, cls: FailureClass) -> float:
        if cls is _F.PREEMPTION_NOTICE and self.uses_notices:
            return 0.0  # the notice arrives before the node goes away
        return self.detect_hang_seconds if cls in HANG_CLASSES else self.detect_crash_seconds

    def downtime(self, cls: FailureClass) -> float:
        detect = self.detect_seconds(cls)
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
    shrunk_seconds: float = 0.0
    """Elastic only: wall time trained on fewer nodes than asked for."""
    shrinks: int = 0
    """Elastic only: node losses answered by a restart on the survivors."""
    grows: int = 0
    """Elastic only: restarts onto a larger set once replacements were ready."""
    waits: int = 0
    """Elastic only: node losses that waited for the full set (no slack left, or a
    shrink that would not pay)."""

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


def _segment(run: float, interval: float | None, save: float) -> tuple[float, float, float]:
    """``run`` seconds of uptime since a restart: (committed, saving, tail).

    ``committed`` is training kept by completed periodic saves; ``tail`` is training
    in the unfinished cycle, which the caller keeps (a save at a grow or at the end)
    or loses (a failure). A cycle cut off inside its save loses the whole interval
    and counts the cut-off part as saving.
    """
    cycle = math.inf if interval is None else interval + save
    full, partial = _split(run, cycle)
    committed = full * (interval or 0.0)
    saving = full * save
    if interval is not None and partial > interval:
        return committed, saving + partial - interval, interval
    return committed, saving, partial


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

    productive = saved = rework = 0.0
    failures = 0
    by_class: dict[FailureClass, int] = {}
    up_since = 0.0  # when the current run segment started (after a recovery)
    for ev in trace:
        if ev.at_seconds < up_since:
            continue  # absorbed by the incident in progress
        # Work in the interrupted cycle: training up to the failure, or a whole interval
        # plus part of a save that did not complete (then the interval is lost too).
        committed, saving, lost = _segment(ev.at_seconds - up_since, interval, save)
        saved += saving
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
        # The run ends here: training in the last partial cycle counts (a final save
        # would keep it), a save cut off by the end is save time.
        committed, saving, tail = _segment(horizon - up_since, interval, save)
        productive += committed + tail
        saved += saving
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


#: Provisioning a replacement, measured on this machine: "submit -> both nodes registered
#: (heartbeating) 72.9 s" through SkyPilot 0.14.1 on the emulated AWS, BENCHMARKS.md,
#: "SkyPilot against the local provisioner in one run (`bench/skypilot_recovery.py`)",
#: 2026-12-02 (the same run's incident `launch` steps took 70.38 s and 69.46 s). One run
#: on an emulator with no capacity limits: a floor for a cloud, not a cloud's figure.
MEASURED_PROVISION_SECONDS = 72.9
#: Longer delays to compare at: a cloud's boot and image pull (300 s) and a capacity
#: crunch (900 s). Assumptions to see how the gain scales, never measurements.
ASSUMED_PROVISION_SECONDS: tuple[float, ...] = (300.0, 900.0)


@dataclass(frozen=True)
class ElasticPlan:
    """How an elastic job may shrink and how long a replacement takes.

    ``min_nodes == nodes`` turns elasticity off: every node loss waits for its
    replacement (provisioning + restart), which is the waiting baseline.
    """

    nodes: int
    """Nodes the job asks for (``num_nodes``)."""
    min_nodes: int
    """Fewest nodes it may train on (a revised global batch below ``nodes``)."""
    gpus_per_node: int = 8
    provision_seconds: float = MEASURED_PROVISION_SECONDS
    """Mean time from asking for a replacement to its agent registered."""
    provision_sigma: float = 0.0
    """Spread of that time, as a lognormal's sigma (mean kept); 0 = always the mean."""
    restart_seconds: float | None = None
    """One restart onto a new node set (re-rendezvous, reload); None = the policy's
    ``restart_in_place_seconds``, the restart cost the policy already models."""

    def __post_init__(self) -> None:
        if self.nodes <= 0 or self.gpus_per_node <= 0:
            raise ValueError("nodes and gpus_per_node must be positive")
        if not 1 <= self.min_nodes <= self.nodes:
            raise ValueError(f"min_nodes must be in 1..{self.nodes}, got {self.min_nodes}")
        if self.provision_seconds < 0 or self.provision_sigma < 0:
            raise ValueError("provision_seconds and provision_sigma must be >= 0")
        if self.restart_seconds is not None and self.restart_seconds < 0:
            raise ValueError("restart_seconds must be >= 0")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def waiting(self) -> ElasticPlan:
        """The same job with no slack: every node loss waits for a full set."""
        return replace(self, min_nodes=self.nodes)

    def restart_for(self, policy: SimPolicy) -> float:
        if self.restart_seconds is None:
            return policy.restart_in_place_seconds
        return self.restart_seconds

    def provision_draws(self, n: int, seed: int) -> list[float]:
        """One provisioning time per failure event, seeded apart from the trace.

        Indexed by the event, so elastic and waiting runs of one seed see the same
        provisioning time for the same failure (common random numbers again).
        """
        if self.provision_sigma == 0:
            return [self.provision_seconds] * n
        if self.provision_seconds == 0:
            return [0.0] * n
        sigma = self.provision_sigma
        mu = math.log(self.provision_seconds) - sigma * sigma / 2  # the mean stays put
        rng = random.Random(f"provision:{seed}")
        return [rng.lognormvariate(mu, sigma) for _ in range(n)]


def waiting_policy(policy: SimPolicy, plan: ElasticPlan) -> SimPolicy:
    """``policy`` with its node replacement made of the plan's provisioning + restart."""
    return replace(policy, replace_node_seconds=plan.provision_seconds + plan.restart_for(policy))


def simulate_elastic(
    policy: SimPolicy,
    plan: ElasticPlan,
    model: FailureModel,
    days: float,
    seed: int = 0,
    price_per_gpu_hour: float = 2.0,
    trace: tuple[FailureEvent, ...] | None = None,
) -> SimResult:
    """Replay a failure trace through ``policy`` run elastically on ``plan``'s nodes.

    Each segment of uptime trains on ``active`` nodes and counts ``active / nodes`` of
    its wall time (productive, saving and rework alike); the missing nodes' share is
    down time. A segment ends at a failure, at a grow (the earliest replacement is
    ready: one blocking save keeps the segment's work, then one restart), or at the
    horizon. Replacements ready by the time a restart begins join that restart.

    Two simplifications, both against elastic: the trace is drawn for the full GPU
    count, so a shrunk job sees the full job's failure rate; and a grow saves at once
    even when a periodic save is due soon.
    """
    if policy.whole_cluster_relaunch:
        raise ValueError(f"{policy.name} relaunches the whole cluster: it cannot shrink")
    horizon = days * 86400.0
    if horizon <= 0:
        raise ValueError(f"days must be positive, got {days}")
    if price_per_gpu_hour < 0:
        raise ValueError("price_per_gpu_hour must be >= 0")
    gpus, nodes = plan.gpus, plan.nodes
    if trace is None:
        trace = failure_trace(model, gpus, horizon, seed)
    provision = plan.provision_draws(len(trace), seed)
    interval = _interval(policy, model, gpus)
    save = policy.blocking_save_seconds
    restart = plan.restart_for(policy)

    productive = saved = rework = shrunk = 0.0
    failures = shrinks = grows = waits = 0
    by_class: dict[FailureClass, int] = {}
    up_since = 0.0  # when the current segment starts training (after a restart)
    pending: list[float] = []  # ready times of replacements still provisioning, sorted
    i = 0
    while True:
        while i < len(trace) and trace[i].at_seconds < up_since:
            i += 1  # absorbed by the incident (or the restart) in progress
        frac = (nodes - len(pending)) / nodes  # every missing node has one pending
        fail_at = trace[i].at_seconds if i < len(trace) else math.inf
        grow_at = max(up_since, pending[0]) if pending else math.inf
        end = min(fail_at, grow_at, horizon)
        committed, saving, tail = _segment(end - up_since, interval, save)
        if frac < 1.0:
            shrunk += end - up_since
        if end >= horizon:
            productive += frac * (committed + tail)  # a final save would keep the tail
            saved += frac * saving
            break
        if grow_at < fail_at:
            # The replacement is ready: save what this segment trained, restart bigger.
            grow_save = min(save, horizon - grow_at)
            productive += frac * (committed + tail)
            saved += frac * (saving + grow_save)
            grows += 1
            begins = grow_at + grow_save
            pending = [t for t in pending if t > begins]
            up_since = min(horizon, begins + restart)
            continue
        ev = trace[i]
        i += 1
        cls = ev.failure_class
        notice_saved = cls is _F.PREEMPTION_NOTICE and policy.uses_notices
        if notice_saved:
            committed += tail
            saving += save
            tail = 0.0
        productive += frac * committed
        saved += frac * saving
        rework += frac * tail
        if cls in ROLLBACK_CLASSES and interval is not None:
            back = min(productive, frac * interval)
            productive -= back
            rework += back
        failures += 1
        by_class[cls] = by_class.get(cls, 0) + 1
        # Recovery begins after detection (and after the emergency save on a notice).
        begins = ev.at_seconds + (save if notice_saved else 0.0) + policy.detect_seconds(cls)
        if cls not in REPLACE_CLASSES:
            # Restart in place on the nodes it has; provisioning carries on meanwhile.
            pending = [t for t in pending if t > begins]
            up_since = min(horizon, begins + policy.restart_in_place_seconds)
            continue
        ready = begins + provision[i - 1]
        left = nodes - len(pending) - 1
        gain = left / nodes * (plan.provision_seconds - restart) - save
        if left >= plan.min_nodes and gain > 0:
            # Restart on the survivors now; the replacement joins at a grow.
            shrinks += 1
            pending = sorted(t for t in [*pending, ready] if t > begins)
            up_since = min(horizon, begins + restart)
        else:
            # No slack left (or a shrink that would not pay): wait for the full set.
            waits += 1
            up_since = min(horizon, max([ready, *pending]) + restart)
            pending = []
    down = horizon - productive - saved - rework
    return SimResult(
        f"{policy.name}-{'elastic' if plan.min_nodes < nodes else 'wait'}", gpus, horizon,
        productive, saved, rework, down, failures, interval, price_per_gpu_hour, by_class,
        shrunk, shrinks, grows, waits,
    )  # fmt: skip


@dataclass(frozen=True)
class ElasticComparison:
    """One plan run elastically and waiting for a full set, on the same trace."""

    plan: ElasticPlan
    waiting: SimResult
    elastic: SimResult

    @property
    def effective_ratio(self) -> float:
        """Elastic's effective training time over waiting's."""
        return self.elastic.productive_seconds / self.waiting.productive_seconds

    @property
    def gained_hours(self) -> float:
        return (self.elastic.productive_seconds - self.waiting.productive_seconds) / 3600

    def to_json_dict(self) -> dict[str, object]:
        e, w = self.elastic, self.waiting
        return {
            "nodes": self.plan.nodes,
            "min_nodes": self.plan.min_nodes,
            "gpus_per_node": self.plan.gpus_per_node,
            "provision_seconds": self.plan.provision_seconds,
            "provision_sigma": self.plan.provision_sigma,
            "waiting_effective_fraction": round(w.effective_fraction, 5),
            "elastic_effective_fraction": round(e.effective_fraction, 5),
            "elastic_over_waiting": round(self.effective_ratio, 5),
            "gained_hours": round(self.gained_hours, 2),
            "gained_usd": round(self.gained_hours * e.gpus * e.price_per_gpu_hour, 2),
            "shrinks": e.shrinks,
            "grows": e.grows,
            "waits": e.waits,
            "shrunk_hours": round(e.shrunk_seconds / 3600, 2),
        }


def compare_elastic(
    policy: SimPolicy,
    plan: ElasticPlan,
    model: FailureModel,
    days: float,
    seed: int = 0,
    price_per_gpu_hour: float = 2.0,
) -> ElasticComparison:
    """``plan`` elastic against the same plan waiting for a full set, one trace, one seed."""
    trace = failure_trace(model, plan.gpus, days * 86400.0, seed)
    run = [
        simulate_elastic(policy, p, model, days, seed, price_per_gpu_hour, trace)
        for p in (plan.waiting(), plan)
    ]
    return ElasticComparison(plan, waiting=run[0], elastic=run[1])
