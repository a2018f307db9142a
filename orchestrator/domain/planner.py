"""The replacement planner: rank concrete placements for a job, best first.

SkyPilot's optimizer picks the cheapest feasible resources and, on a preemption,
may try the next region; it never looks at how often a region preempted us and
(its issue 10021) does not actually keep away from the region that just did. The
reconciler needs more than the price: this module scores each candidate the catalog
offers (:class:`Candidate`, gathered by ``orchestrator.launchers.catalog``) with

* **price** for the whole job: node price (spot or on-demand) times nodes;
* **recent preemptions** of that instance type in that region, from the failure
  history, each weighing ``0.5 ** (age / half_life)`` (a preemption an hour ago
  counts, one last week hardly does); together with a base spot rate they give an
  expected preemption rate, and with the hours each preemption costs (restart plus
  redone work) an **expected lost fraction** of the run;
* a **cool-down**: a region that preempted (or lost a node of) the job within
  ``cooldown`` is not a candidate at all, whatever its price;
* **fit**: the memory planner (:mod:`orchestrator.domain.memory`) must find knobs
  for the model on that GPU; the recompute it needs is extra compute, and a
  candidate where nothing fits is rejected with the planner's reason;
* **nodes**: with ``min_nodes`` below ``num_nodes``, a candidate whose capacity is
  known to be short (``available_nodes``) may run on fewer nodes, down to
  ``min_nodes``, at a proportional loss of throughput and a penalty for finishing
  later; node counts whose ranks do not divide the global batch are skipped.

The score is the expected price of one job-hour of useful work, with fewer nodes
priced for the time they add::

    price_per_job_hour * (1 + fewer_nodes_penalty * (1 - node_fraction))
        / (node_fraction / (1 + recompute) * (1 - expected_lost))

Lower is better; ties go to the job's own order of accelerator preference, then
to the name, so the ranking is deterministic. Pure: no I/O, no SkyPilot; the
caller passes the catalog rows, the history and ``now``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from orchestrator.domain.memory import BatchNotDivisible, DoesNotFit, MemoryPlan, plan_memory
from orchestrator.domain.plan import Placement
from orchestrator.domain.spec import JobSpec


@dataclass(frozen=True)
class Candidate:
    """One offering from the catalog: an instance type in a region, per node."""

    cloud: str
    """Lower case: aws, gcp, azure..."""
    region: str
    instance_type: str
    accelerator: str | None
    accelerator_count: int
    gpu_memory_gib: float | None
    price_per_node_hour: float
    """On-demand, USD."""
    spot_price_per_node_hour: float | None
    """USD; None where the catalog has no spot offering."""
    zone: str | None = None
    preference: int = 0
    """Index of the job's accelerator entry this came from (0 = most preferred)."""
    spot: bool | None = None
    """The task option's own ``use_spot`` (an ``any_of`` entry may say spot while
    another says on-demand); None: the job's ``spot`` decides."""

    def wants_spot(self, job_spot: bool | None) -> bool:
        """The job's explicit ``spot`` wins; else the option's own; else spot."""
        if job_spot is not None:
            return job_spot
        return True if self.spot is None else self.spot


#: Failure classes that say "this placement took the nodes away" (see
#: ``orchestrator.domain.failures.FailureClass``); other failures are the job's own.
PLACEMENT_FAILURES = frozenset({"preemption_notice", "node_lost", "capacity_unavailable"})


@dataclass(frozen=True)
class FailureRecord:
    """One failure from the history, where it happened and when."""

    cloud: str
    region: str
    instance_type: str
    at: datetime
    failure_class: str = "preemption_notice"
    num_nodes: int | None = None
    """A capacity refusal: how many nodes the refused launch asked for (None: not
    known). An elastic job may still get fewer there (:func:`capacity_short`)."""


@dataclass(frozen=True)
class PlannerPolicy:
    """The scoring constants; defaults are documented in docs/planner.md."""

    half_life: timedelta = timedelta(hours=6)
    """A preemption's weight halves every ``half_life``."""
    cooldown: timedelta = timedelta(minutes=30)
    """A region that took nodes away this recently is not a candidate."""
    base_spot_rate_per_hour: float = 0.05
    """Preemptions per node-hour assumed for spot with no history (about one a day
    for a single node, which is what public spot advisors report for GPUs)."""
    rate_per_recent_preemption: float = 1.0
    """Preemptions per hour added by each (fully weighted) recent preemption: spot
    reclaims come in waves, so a region that just took nodes is expected to take
    more within the hour."""
    lost_hours_per_preemption: float = 0.25
    """Restart (detect, replace, stage, relaunch) plus half a checkpoint interval of
    redone work; the advisor's measured figures replace it when the caller has them."""
    max_lost_fraction: float = 0.95
    fewer_nodes_penalty: float = 0.5
    """Fewer nodes cost the same per unit of work but the job finishes later; running
    on half the nodes makes the score ``1 + 0.5 * 0.5`` times worse."""

    def __post_init__(self) -> None:
        if self.half_life <= timedelta(0):
            raise ValueError("half_life must be positive")
        if self.cooldown < timedelta(0):
            raise ValueError("cooldown must be >= 0")
        for name in (
            "base_spot_rate_per_hour",
            "rate_per_recent_preemption",
            "fewer_nodes_penalty",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.lost_hours_per_preemption < 0:
            raise ValueError("lost_hours_per_preemption must be >= 0")
        if not 0 < self.max_lost_fraction < 1:
            raise ValueError("max_lost_fraction must be in (0, 1)")


@dataclass(frozen=True)
class Ranked:
    placement: Placement
    score: float
    """Expected USD per job-hour of useful work; lower is better."""
    price_per_job_hour: float
    expected_lost_fraction: float
    recent_preemptions: float
    """Decayed count of this instance type's recent preemptions in this region."""
    memory: MemoryPlan | None = None
    preference: int = 0


class Constraint(StrEnum):
    """The rule that rejected a candidate."""

    CLOUD = "cloud"  # not one of the job's clouds
    REGION = "region"  # not one of the job's regions
    EXCLUDED = "excluded"  # excluded by the caller (--exclude-region)
    SPOT = "spot"  # the job wants spot and there is no spot offering
    COOLDOWN = "cooldown"  # the region took nodes away within the cool-down
    NODES = "nodes"  # fewer nodes available than min_nodes
    BATCH = "batch"  # no allowed node count splits the global batch
    FIT = "fit"  # the model fits no knobs on this GPU (or its memory is unknown)


@dataclass(frozen=True)
class Rejection:
    candidate: Candidate
    reason: str
    constraint: Constraint


@dataclass(frozen=True)
class Ranking:
    ranked: tuple[Ranked, ...]
    rejected: tuple[Rejection, ...] = field(default=())

    @property
    def placements(self) -> list[Placement]:
        return [r.placement for r in self.ranked]

    def why_empty(self) -> str:
        """One sentence naming the constraints that removed every candidate."""
        if self.ranked:
            return ""
        if not self.rejected:
            return "the catalog offered no candidates for the job's accelerators"
        counts = Counter(r.constraint for r in self.rejected)
        parts = []
        for constraint, n in counts.most_common():
            example = next(r for r in self.rejected if r.constraint == constraint)
            c = example.candidate
            parts.append(
                f"{n} by {constraint} (e.g. {c.cloud}/{c.region} {c.instance_type}: "
                f"{example.reason})"
            )
        return f"all {len(self.rejected)} candidates were rejected: " + "; ".join(parts)


def _matches_region(rule: str, candidate: Candidate) -> bool:
    """``us-east-1``, ``aws/us-east-1`` (also ``aws:us-east-1``) or ``aws/*``."""
    rule = rule.strip().lower().replace(":", "/")
    if "/" in rule:
        cloud, region = rule.split("/", 1)
        return cloud == candidate.cloud.lower() and region in ("*", candidate.region.lower())
    return rule == candidate.region.lower()


def _weight(age: timedelta, half_life: timedelta) -> float:
    if age < timedelta(0):
        age = timedelta(0)  # a record from the future (clock skew) counts as now
    return float(0.5 ** (age / half_life))


def recent_preemptions(
    candidate: Candidate,
    history: Iterable[FailureRecord],
    now: datetime,
    policy: PlannerPolicy,
) -> float:
    """Decayed count of placement failures of this instance type in this region."""
    total = 0.0
    for f in history:
        if (
            f.failure_class in PLACEMENT_FAILURES
            and f.cloud.lower() == candidate.cloud.lower()
            and f.region == candidate.region
            and f.instance_type == candidate.instance_type
        ):
            total += _weight(now - f.at, policy.half_life)
    return total


def cooled_down_regions(
    history: Iterable[FailureRecord], now: datetime, policy: PlannerPolicy
) -> dict[tuple[str, str], datetime]:
    """(cloud, region) -> until when it is blocked, for regions that took nodes away
    (a preemption, a lost node) within the cool-down, whatever the instance type."""
    blocked: dict[tuple[str, str], datetime] = {}
    for f in history:
        if f.failure_class not in PLACEMENT_FAILURES or f.failure_class == "capacity_unavailable":
            continue
        until = f.at + policy.cooldown
        if until > now:
            key = (f.cloud.lower(), f.region)
            blocked[key] = max(until, blocked.get(key, until))
    return blocked


def stocked_out(
    history: Iterable[FailureRecord], now: datetime, policy: PlannerPolicy
) -> dict[tuple[str, str, str], datetime]:
    """(cloud, region, instance type) -> until when it is blocked, after the cloud
    refused a launch for lack of capacity or quota: only that type cools down there,
    since another type in the same region may well have capacity."""
    blocked: dict[tuple[str, str, str], datetime] = {}
    for f in history:
        if f.failure_class != "capacity_unavailable":
            continue
        until = f.at + policy.cooldown
        if until > now:
            key = (f.cloud.lower(), f.region, f.instance_type)
            blocked[key] = max(until, blocked.get(key, until))
    return blocked


def capacity_short(
    history: Iterable[FailureRecord], now: datetime, policy: PlannerPolicy
) -> dict[tuple[str, str, str], int]:
    """(cloud, region, instance type) -> the fewest nodes a launch there was refused
    for lack of capacity within the cool-down, where the refusal says how many it
    asked for: fewer than that may well fit (a cloud that cannot find 4 VMs often
    finds 3), which an elastic job can train on."""
    short: dict[tuple[str, str, str], int] = {}
    for f in history:
        if f.failure_class != "capacity_unavailable" or f.num_nodes is None:
            continue
        if f.at + policy.cooldown > now:
            key = (f.cloud.lower(), f.region, f.instance_type)
            short[key] = min(f.num_nodes, short.get(key, f.num_nodes))
    return short


def _node_counts(spec: JobSpec, available: int | None) -> list[int]:
    top = spec.num_nodes if available is None else min(spec.num_nodes, available)
    return list(range(top, spec.effective_min_nodes - 1, -1))


def _data_parallel(spec: JobSpec, candidate: Candidate, nodes: int) -> int:
    per_node = candidate.accelerator_count if candidate.accelerator else spec.ranks_per_node
    return nodes * max(per_node, 1)


def rank(
    spec: JobSpec,
    candidates: Iterable[Candidate],
    history: Iterable[FailureRecord],
    now: datetime,
    *,
    exclude_regions: Sequence[str] = (),
    available_nodes: Mapping[tuple[str, str, str], int] | None = None,
    policy: PlannerPolicy | None = None,
    headroom: float = 0.1,
    strict_preference: bool | None = None,
) -> Ranking:
    """Score every candidate; the :class:`Ranking` keeps the rejected ones and why.

    ``available_nodes`` maps (cloud, region, instance type) to how many nodes the
    caller knows it can get there (e.g. after a launch that came up short); absent
    means enough.
    """
    policy = policy or PlannerPolicy()
    history = list(history)
    blocked = cooled_down_regions(history, now, policy)
    no_capacity = stocked_out(history, now, policy)
    # An elastic job is offered fewer nodes than a capacity refusal asked for, down to
    # min_nodes, rather than losing the placement for the cool-down.
    short = capacity_short(history, now, policy) if spec.elastic_nodes else {}
    allowed_clouds = {c.lower() for c in spec.clouds}
    ranked: list[Ranked] = []
    rejected: list[Rejection] = []

    def reject(c: Candidate, constraint: Constraint, reason: str) -> None:
        rejected.append(Rejection(c, reason, constraint))

    for c in candidates:
        if allowed_clouds and c.cloud.lower() not in allowed_clouds:
            reject(
                c,
                Constraint.CLOUD,
                f"cloud {c.cloud} not in the job's clouds {sorted(allowed_clouds)}",
            )
            continue
        if spec.regions and not any(_matches_region(r, c) for r in spec.regions):
            reject(
                c, Constraint.REGION, f"region {c.region} not in the job's regions {spec.regions}"
            )
            continue
        if any(_matches_region(r, c) for r in exclude_regions):
            reject(c, Constraint.EXCLUDED, f"region {c.region} excluded")
            continue
        if c.wants_spot(spec.spot) and c.spot_price_per_node_hour is None:
            reject(c, Constraint.SPOT, "no spot offering")
            continue
        until = blocked.get((c.cloud.lower(), c.region))
        if until is not None:
            reject(
                c,
                Constraint.COOLDOWN,
                f"{c.cloud}/{c.region} took nodes away recently; blocked until "
                f"{until.isoformat(timespec='minutes')}",
            )
            continue
        key = (c.cloud.lower(), c.region, c.instance_type)
        until = no_capacity.get(key)
        fewer = short.get(key, 0) - 1
        if until is not None and fewer >= spec.effective_min_nodes:
            given = (available_nodes or {}).get(key)
            available_nodes = {**(available_nodes or {}), key: min(fewer, given or fewer)}
        elif until is not None:
            reject(
                c,
                Constraint.COOLDOWN,
                f"{c.cloud}/{c.region} had no capacity for {c.instance_type}; blocked until "
                f"{until.isoformat(timespec='minutes')}",
            )
            continue
        avail = (available_nodes or {}).get((c.cloud.lower(), c.region, c.instance_type))
        counts = _node_counts(spec, avail)
        if not counts:
            reject(
                c,
                Constraint.NODES,
                f"only {avail} node(s) available, the job needs at least "
                f"{spec.effective_min_nodes}",
            )
            continue
        chosen: tuple[int, MemoryPlan | None] | None = None
        last_reason: tuple[Constraint, str] = (Constraint.BATCH, "")
        for nodes in counts:
            dp = _data_parallel(spec, c, nodes)
            if spec.model is None:
                chosen = (nodes, None)
                break
            if spec.model.global_batch % dp:
                last_reason = (
                    Constraint.BATCH,
                    f"global batch {spec.model.global_batch} does not split over {dp} ranks",
                )
                continue
            if c.gpu_memory_gib is None:
                last_reason = (
                    Constraint.FIT,
                    "GPU memory unknown, so the model's fit cannot be checked",
                )
                break
            try:
                chosen = (nodes, plan_memory(spec.model, c.gpu_memory_gib, dp, headroom=headroom))
                break
            except DoesNotFit as e:
                last_reason = (Constraint.FIT, str(e))
                break  # fewer nodes only make a sharded model fit worse
            except BatchNotDivisible as e:  # pragma: no cover - checked above
                last_reason = (Constraint.BATCH, str(e))
        if chosen is None:
            reject(c, *last_reason)
            continue
        nodes, memory = chosen
        ranked.append(_score(spec, c, nodes, memory, history, now, policy))

    if strict_preference is None:
        # SkyPilot's semantics: ``ordered:`` options (the job's own, or its task
        # YAML's, which the catalog numbers) are a strict preference; a plain list
        # or ``any_of:`` is ranked by cost, the order only breaking ties.
        strict_preference = spec.accelerators_ordered or bool(
            spec.task.skypilot_yaml and not spec.accelerator_names
        )
    ranked.sort(
        key=lambda r: (
            r.preference if strict_preference else 0,
            r.score,
            r.preference,
            r.placement.cloud,
            r.placement.region,
            r.placement.instance_type,
        )
    )
    return Ranking(tuple(ranked), tuple(rejected))


def _score(
    spec: JobSpec,
    c: Candidate,
    nodes: int,
    memory: MemoryPlan | None,
    history: list[FailureRecord],
    now: datetime,
    policy: PlannerPolicy,
) -> Ranked:
    spot = c.wants_spot(spec.spot)
    node_price = c.spot_price_per_node_hour if spot else c.price_per_node_hour
    assert node_price is not None  # spot without a spot price was rejected
    job_price = node_price * nodes
    recent = recent_preemptions(c, history, now, policy)
    rate = (policy.base_spot_rate_per_hour if spot else 0.0) * nodes
    rate += recent * policy.rate_per_recent_preemption
    lost = min(policy.max_lost_fraction, rate * policy.lost_hours_per_preemption)
    recompute = memory.compute_overhead if memory else 0.0
    throughput = (nodes / spec.num_nodes) / (1.0 + recompute)
    later = 1.0 + policy.fewer_nodes_penalty * (1.0 - nodes / spec.num_nodes)
    score = job_price * later / (throughput * (1.0 - lost))
    kind = "spot" if spot else "on-demand"
    reasons = [
        f"{kind} ${node_price:.2f}/node-h x {nodes} = ${job_price:.2f}/h",
        (
            f"{recent:.2f} recent preemption(s) of {c.instance_type} here"
            if recent >= 0.01
            else "no recent preemptions here"
        )
        + f"; expected lost {lost:.0%}",
    ]
    if nodes < spec.num_nodes:
        reasons.append(
            f"fewer nodes ({nodes} of {spec.num_nodes}, min {spec.effective_min_nodes}): "
            "capacity short"
        )
    if memory is not None:
        reasons.extend(memory.reasons)
    if c.preference:
        reasons.append(f"the job's accelerator choice #{c.preference + 1}")
    placement = Placement(
        cloud=c.cloud.lower(),
        region=c.region,
        zone=c.zone,
        instance_type=c.instance_type,
        accelerator=c.accelerator,
        accelerator_count=c.accelerator_count,
        num_nodes=nodes,
        spot=spot,
        gpu_memory_gib=c.gpu_memory_gib,
        price_per_node_hour=node_price,
        knobs=memory.knobs if memory else None,
        reasons=tuple(reasons),
    )
    if not math.isfinite(score):  # pragma: no cover - guarded by max_lost_fraction
        score = math.inf
    return Ranked(placement, score, job_price, lost, recent, memory, c.preference)


def rank_candidates(
    spec: JobSpec,
    candidates: Iterable[Candidate],
    history: Iterable[FailureRecord],
    now: datetime,
    *,
    exclude_regions: Sequence[str] = (),
    available_nodes: Mapping[tuple[str, str, str], int] | None = None,
    policy: PlannerPolicy | None = None,
) -> list[Placement]:
    """Placements best first; empty when nothing qualifies (see :func:`rank` for why)."""
    return rank(
        spec,
        candidates,
        history,
        now,
        exclude_regions=exclude_regions,
        available_nodes=available_nodes,
        policy=policy,
    ).placements


def replacement_after_preemption(
    spec: JobSpec,
    candidates: Sequence[Candidate],
    history: Sequence[FailureRecord],
    now: datetime,
    preempted: Placement,
    *,
    exclude_regions: Sequence[str] = (),
    policy: PlannerPolicy | None = None,
) -> Ranking:
    """The ranking the reconciler would see right after ``preempted`` lost its nodes."""
    record = FailureRecord(preempted.cloud, preempted.region, preempted.instance_type, now)
    return rank(
        spec,
        candidates,
        [*history, record],
        now,
        exclude_regions=exclude_regions,
        policy=policy,
    )
