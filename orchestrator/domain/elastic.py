"""Elastic runs: whether a job that lost nodes trains on the survivors while the
replacement comes (shrink), or waits for a full set. Pure: the reconciler's
``decide()`` asks :func:`choose_shrink` at SELECT, from the snapshot.

The weighing, in node-seconds of training (the unit the goodput counts in)::

    wait:    the whole group idles while the replacement provisions (P), then
             restarts at full size (R)
    shrink:  the k survivors restart at once (R) and train at k/N of the full
             throughput until the replacement is up, then every node pauses once
             more to grow back (G: a save at the step boundary and a restart)

    shrink gains   k/N * max(0, P - R)   of full-speed training time
    shrink costs   G                     of full-speed training time (the grow)

so the survivors train when ``k/N * (P - R) > margin * G``. With nothing measured
for ``P`` the spec's ``elastic.expected_provision_s`` is used, then
:attr:`ElasticConfig.default_provision_s`; ``R`` and ``G`` are the job's measured
start-ups (``JobSnapshot.startup_s``) when it has any. A job whose remaining work
(``steps_left`` at the measured step time) ends on the shrunk group before the
replacement would be up shrinks whatever the grow would cost: it never grows.

Below ``min_nodes`` there is nothing to decide: the job waits, as a job without
``min_nodes`` always does.

A job that trains on fewer nodes than ``num_nodes`` with no replacement coming (its
standby launch was refused or given back, or it was first placed on fewer nodes)
asks again (:func:`choose_ask_again`): after ``spare_retry_s``, doubling with each
try up to ``spare_retry_cap_s`` (capacity that was short a minute ago is often back
within minutes, and a provider that keeps refusing is not asked every tick), unless
the work left ends on the nodes it has before a replacement would be up.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.domain.spec import JobSpec


@dataclass(frozen=True)
class ElasticConfig:
    default_provision_s: float = 180.0
    """A replacement's provisioning time when neither the placement history nor the
    spec says (a cloud VM with setup: minutes; SkyPilot on the emulated AWS here
    registered in 72.9 s, BENCHMARKS.md)."""
    default_restart_s: float = 30.0
    """A restart's cost when the job measured no start-up yet."""
    margin: float = 1.5
    """The shrunk phase must gain this many times what the grow costs: a guess that
    is wrong by half still gains."""
    spare_retry_s: float = 60.0
    """The wait before a job short of nodes asks for its replacements again, from the
    refusal, the release, or (placed on fewer) the attempt's validation."""
    spare_retry_cap_s: float = 900.0
    """The longest of those waits: they double with each try up to this."""


@dataclass(frozen=True)
class ShrinkChoice:
    shrink: bool
    nodes: int
    """The nodes to train on now: the survivors when shrinking, else the full count."""
    reason: str
    """One line: the figures weighed, for the incident's SELECT step."""
    provision_s: float
    """The expected provisioning time the choice was made with."""


def expected_provision_s(
    measured: Sequence[float], spec: JobSpec, cfg: ElasticConfig
) -> tuple[float, str]:
    """The replacement's expected provisioning time and where it came from: the median
    of the measured launches of this placement (request to every node up), else the
    spec's, else the service's default."""
    usable = [m for m in measured if m >= 0]
    if usable:
        return statistics.median(usable), f"median of {len(usable)} measured launches"
    if spec.elastic.expected_provision_s is not None:
        return spec.elastic.expected_provision_s, "the spec's elastic.expected_provision_s"
    return cfg.default_provision_s, "nothing measured: the service's default"


def choose_shrink(
    spec: JobSpec,
    survivors: int,
    *,
    provision_s: Sequence[float] = (),
    startup_s: Sequence[float] = (),
    steps_left: int | None = None,
    step_time_s: float | None = None,
    cfg: ElasticConfig | None = None,
) -> ShrinkChoice:
    """Whether ``survivors`` healthy nodes of a job that lost the others train now
    (see the module's weighing). Never shrinks below ``min_nodes``, nor a job
    without one, nor one whose spec says ``elastic.shrink: never``."""
    cfg = cfg or ElasticConfig()
    n = spec.num_nodes
    p, source = expected_provision_s(provision_s, spec, cfg)
    if not spec.elastic_nodes:
        why = "not an elastic job (min_nodes is num_nodes): waiting for a full set"
        return ShrinkChoice(False, n, why, p)
    if survivors not in spec.elastic_nodes:
        lost = n - survivors
        why = (
            f"{survivors} survivor{'s' if survivors != 1 else ''}, below min_nodes "
            f"{spec.effective_min_nodes}: waiting for {lost} replacement{'s' if lost > 1 else ''}"
        )
        return ShrinkChoice(False, n, why, p)
    if spec.elastic.shrink == "never":
        return ShrinkChoice(False, n, "elastic.shrink: never: waiting for a full set", p)
    r = max(startup_s) if startup_s else cfg.default_restart_s
    share = survivors / n
    gain = share * max(0.0, p - r)
    figures = (
        f"replacement expected in {p:.0f} s ({source}); restart {r:.0f} s; "
        f"{survivors}/{n} nodes train {gain:.0f} s of full-speed work meanwhile, "
        f"the grow back costs {r:.0f} s"
    )
    if spec.elastic.shrink == "always":
        return ShrinkChoice(True, survivors, f"elastic.shrink: always; {figures}", p)
    if steps_left is not None and step_time_s:
        on_survivors = steps_left * step_time_s / share
        if on_survivors < p - r:
            return ShrinkChoice(
                True,
                survivors,
                f"the {steps_left} steps left end on {survivors} nodes in "
                f"{on_survivors:.0f} s, before the replacement ({p:.0f} s): no grow needed",
                p,
            )
    if gain > cfg.margin * r:
        return ShrinkChoice(True, survivors, f"shrink: {figures}", p)
    return ShrinkChoice(False, n, f"wait: {figures} (gain under {cfg.margin:g}x the grow)", p)


@dataclass(frozen=True)
class AskAgain:
    ask: bool
    reason: str
    """One line: why, or why not yet (the figures weighed)."""
    wait_s: float
    """The wait this try needed (``spare_retry_s`` doubled per try, capped)."""


def spare_wait_s(tries: int, cfg: ElasticConfig) -> float:
    """The wait before try ``tries + 1`` of a job's replacements: ``spare_retry_s``
    after the first (or none yet), doubling with each one after, up to the cap."""
    return min(cfg.spare_retry_cap_s, cfg.spare_retry_s * 2.0 ** max(0, tries - 1))


def choose_ask_again(
    spec: JobSpec,
    training: int,
    *,
    tries: int,
    waited_s: float,
    provision_s: Sequence[float] = (),
    steps_left: int | None = None,
    step_time_s: float | None = None,
    cfg: ElasticConfig | None = None,
) -> AskAgain:
    """Whether a job training on ``training`` nodes, with no replacement coming, asks
    for ``num_nodes - training`` again now: ``tries`` asks were made since its group
    formed (the shrink's own standby is the first), the last ended ``waited_s`` ago
    (see the module's docstring)."""
    cfg = cfg or ElasticConfig()
    missing = spec.num_nodes - training
    wait = spare_wait_s(tries, cfg)
    if missing <= 0 or not spec.elastic_nodes:
        return AskAgain(False, f"{training} of {spec.num_nodes} nodes: nothing to ask for", wait)
    p, source = expected_provision_s(provision_s, spec, cfg)
    if steps_left is not None and step_time_s:
        ends = steps_left * step_time_s
        if ends < p:
            return AskAgain(
                False,
                f"the {steps_left} steps left end on {training} nodes in {ends:.0f} s, before "
                f"a replacement would be up ({p:.0f} s, {source}): running on at {training}",
                wait,
            )
    what = f"{missing} replacement{'s' if missing > 1 else ''}"
    if waited_s < wait:
        return AskAgain(False, f"asking again for {what} in {wait - waited_s:.0f} s", wait)
    return AskAgain(
        True,
        f"asking again for {what} (try {tries + 1}, {waited_s:.0f} s after the last; "
        f"expected up in {p:.0f} s, {source})",
        wait,
    )
