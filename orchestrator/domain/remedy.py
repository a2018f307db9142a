"""What each failure class gets: the remedy's choices, as pure functions.

``domain.reconcile.decide`` walks the restart protocol; at each step that needs a
choice it asks this module, with facts the store and the launcher gathered first:

* CONFIRM: which complete checkpoint to resume from (:func:`choose_checkpoint`);
  an anomaly rolls back to the newest one *older than its onset*, because the
  newest may already hold the diverged state.
* SELECT: whether the job may go on at all (:func:`refuse_to_continue`: restart
  limit, a repeated user error, the same anomaly at the same step again), then the
  knobs (:func:`knobs_after_oom`) and the placement (:func:`select_placement`):
  the same nodes for a transport error, another host after a hardware fault or a
  slow node, another region after a preemption, a cooled region after a stockout.
* LAUNCH: how long to wait before trying again (:func:`backoff_s`).

Example sequences (``R`` = attempt)::

    R1 cuda_oom (micro-batch 8) -> R2 micro-batch 4 x 2 accumulation -> ok
    R1 nccl_transport -> R2 same placement after 5 s -> ok
    R1 loss_spike onset 47 (checkpoints 20, 40, 60) -> R2 from step 40 -> ok
    R1 gpu_hardware on host h3 -> R2 on hosts without h3 -> ok
    R1 launch: capacity in r1 -> r1 cools 30 min -> R1 in r2 -> ok
    R1 KeyError: 'input_ids' -> R2 KeyError: 'input_ids' -> FAILED (same error twice)

Pure: no I/O, no clock; ``now`` comes in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from orchestrator.domain.failures import FailureClass
from orchestrator.domain.memory import next_smaller_setting
from orchestrator.domain.plan import Placement, TrainingKnobs
from orchestrator.domain.planner import Candidate, FailureRecord, rank
from orchestrator.domain.policy import BLAMES_REGION, POLICY, RecoveryAction
from orchestrator.domain.spec import JobSpec

_F = FailureClass
_A = RecoveryAction

#: Classes whose node is never relaunched into: its host is excluded for good.
BLAMES_HOST = frozenset({_F.GPU_HARDWARE, _F.HEALTH_CHECK_FAILED, _F.SLOW_PEER})
#: Classes whose ranks roll back to before the anomaly's onset.
ANOMALIES = frozenset({_F.NAN_DIVERGENCE, _F.LOSS_SPIKE, _F.SILENT_CORRUPTION})


def remedy_for(failure_class: FailureClass) -> RecoveryAction:
    return POLICY[failure_class]


# --- CONFIRM ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointChoice:
    step: int | None
    """None: no complete checkpoint qualifies, start from step 0."""
    reason: str


def choose_checkpoint(
    complete: Sequence[int], failure_class: FailureClass, onset_step: int | None
) -> CheckpointChoice:
    """The newest complete checkpoint, or for an anomaly the newest one saved before
    its onset (a checkpoint at the onset step was saved from the state that already
    diverged). ``complete`` are the steps of verified-complete checkpoints."""
    steps = sorted(set(complete))
    if failure_class in ANOMALIES and onset_step is not None:
        older = [s for s in steps if s < onset_step]
        if older:
            return CheckpointChoice(
                older[-1],
                f"rolling back to step_{older[-1]}, the newest complete checkpoint older "
                f"than the {failure_class} onset at step {onset_step}",
            )
        return CheckpointChoice(
            None, f"no complete checkpoint older than the onset at step {onset_step}"
        )
    if steps:
        return CheckpointChoice(steps[-1], f"newest complete checkpoint step_{steps[-1]}")
    return CheckpointChoice(None, "no complete checkpoint")


# --- SELECT: may the job go on? ---------------------------------------------------------------


@dataclass(frozen=True)
class PastIncident:
    """An earlier incident of the same job, as the remedies need it."""

    failure_class: FailureClass
    signature: str | None = None
    """For a user error: the exception signature (type and normalised message)."""
    onset_step: int | None = None
    """For an anomaly: the step it began at."""


def refuse_to_continue(
    failure_class: FailureClass,
    signature: str | None,
    onset_step: int | None,
    past: Sequence[PastIncident],
    *,
    restarts_done: int,
    max_restarts: int,
    max_same_user_error: int,
    max_same_anomaly: int,
    on_anomaly: str,
) -> str | None:
    """Why the job must stop instead of recovering, or None to go on."""
    if failure_class is _F.USER_CODE_ERROR and signature:
        seen = 1 + sum(
            1 for p in past if p.failure_class is _F.USER_CODE_ERROR and p.signature == signature
        )
        if seen >= max_same_user_error:
            return f"the same user code error {seen} times: {signature}"
    if failure_class in ANOMALIES:
        if on_anomaly == "fail":
            where = f" at step {onset_step}" if onset_step is not None else ""
            return f"{failure_class}{where} and the spec says on_anomaly: fail"
        if onset_step is not None:
            seen = 1 + sum(
                1 for p in past if p.failure_class is failure_class and p.onset_step == onset_step
            )
            if seen >= max_same_anomaly:
                return (
                    f"{failure_class} at step {onset_step} {seen} times: rolling back "
                    "reproduces it (try on_anomaly: rollback_skip)"
                )
    if restarts_done >= max_restarts and failure_class is not _F.ELASTIC_GROW:
        # A grow is no failure: it never ends the job (a failure after it may).
        return f"restart limit reached ({max_restarts} restarts)"
    return None


# --- SELECT: knobs --------------------------------------------------------------------------


@dataclass(frozen=True)
class KnobsChoice:
    knobs: TrainingKnobs | None
    reason: str
    refused: bool = False
    """True when nothing smaller exists: the job fails with ``reason``."""


def knobs_after_oom(spec: JobSpec, current: TrainingKnobs | None, dp_ranks: int) -> KnobsChoice:
    """The next setting with a smaller memory estimate, cheapest recompute first, the
    global batch unchanged. Refused at the smallest setting or without a model."""
    if spec.model is None:
        return KnobsChoice(
            None,
            "out of memory, and the spec has no model profile (model:) for the memory "
            "planner to re-plan with",
            refused=True,
        )
    now = current or TrainingKnobs(
        micro_batch=spec.model.micro_batch,
        grad_accum=max(1, spec.model.global_batch // (spec.model.micro_batch * dp_ranks)),
    )
    nxt = next_smaller_setting(spec.model, now, dp_ranks)
    if nxt is None:
        return KnobsChoice(
            None,
            f"out of memory again at the smallest setting (micro-batch {now.micro_batch}, "
            f"activation checkpointing every {now.activation_checkpoint_every or '-'} "
            "block): nothing smaller keeps the global batch",
            refused=True,
        )
    return KnobsChoice(
        nxt,
        f"re-planned after OOM: micro-batch {now.micro_batch} x {now.grad_accum} -> "
        f"{nxt.micro_batch} x {nxt.grad_accum} accumulation, activation checkpointing "
        f"every {nxt.activation_checkpoint_every or '-'} (global batch "
        f"{spec.model.global_batch} kept)",
    )


# --- SELECT: placement ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementChoice:
    placement: Placement | None
    reason: str
    tried: tuple[str, ...] = ()
    """What was ruled out and why (listed when nothing is left)."""


def select_placement(
    spec: JobSpec,
    candidates: Sequence[Candidate],
    history: Sequence[FailureRecord],
    now: datetime,
    *,
    exclude_regions: Sequence[str] = (),
) -> PlacementChoice:
    """The planner's first choice. A region that just preempted us is avoided while
    another candidate exists (a preference, as on one-region setups there is no
    other); a region out of capacity for an instance type is a hard no until its
    cool-down ends."""
    ranking = rank(spec, candidates, history, now, exclude_regions=exclude_regions)
    soft = ""
    if not ranking.ranked and (exclude_regions or history):
        hard = [h for h in history if h.failure_class == _F.CAPACITY_UNAVAILABLE]
        retry = rank(spec, candidates, hard, now)
        if retry.ranked:
            ranking, soft = retry, " (no other region: the one that failed is used again)"
    if not ranking.ranked:
        tried = tuple(
            f"{r.candidate.cloud}/{r.candidate.region}/{r.candidate.instance_type}: {r.reason}"
            for r in ranking.rejected
        )
        return PlacementChoice(None, f"no placement left: {ranking.why_empty()}", tried)
    best = ranking.ranked[0]
    p = best.placement
    return PlacementChoice(p, f"{p.num_nodes} x {p.instance_type} ({p.cloud}/{p.region}){soft}")


def regions_to_avoid(failure_class: FailureClass, failed: Placement | None) -> tuple[str, ...]:
    if failed is None or failure_class not in BLAMES_REGION:
        return ()
    return (failed.region,)


def same_placement(failed: Placement, knobs: TrainingKnobs | None) -> Placement:
    """A restart in place: the nodes it ran on, nothing re-provisioned."""
    return replace(failed, knobs=knobs if knobs is not None else failed.knobs)


# --- LAUNCH ----------------------------------------------------------------------------------


def backoff_s(
    job_id: str, tries: int, *, base_s: float = 5.0, cap_s: float = 300.0, jitter: float = 0.5
) -> float:
    """Exponential backoff with deterministic jitter: ``base * 2**(tries-1)`` capped,
    times ``1 + jitter * u`` with ``u`` in [0, 1) from the job and the try (replicas
    and restarts agree on it; jobs stocked out together do not retry in step)."""
    if tries <= 0:
        return 0.0
    raw = min(cap_s, base_s * 2.0 ** (tries - 1))
    digest = hashlib.sha256(f"{job_id}:{tries}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return float(raw * (1 + jitter * u))
