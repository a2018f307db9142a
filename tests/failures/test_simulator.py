from __future__ import annotations

import statistics

import pytest

from orchestrator.domain.advisor import advise
from orchestrator.domain.failures import FailureClass
from orchestrator.domain.simulator import (
    LLAMA3_MIX,
    POLICIES,
    SimPolicy,
    compare,
    failure_model,
    failure_trace,
    simulate,
)

LLAMA3 = failure_model("llama3")


def _mean_fraction(policy: SimPolicy, multiplier: float, gpus: int, days: float) -> float:
    model = failure_model("llama3", rate_multiplier=multiplier)
    return statistics.mean(
        simulate(policy, model, gpus, days, seed=s).effective_fraction for s in range(5)
    )


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_failures_gives_100_percent(name: str) -> None:
    r = simulate(POLICIES[name], failure_model("none"), 16_384, 54)
    assert r.effective_fraction == 1.0
    assert r.failures == 0


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_more_failures_never_give_more_goodput(name: str) -> None:
    fractions = [_mean_fraction(POLICIES[name], m, 2048, 54) for m in (0.5, 1, 2, 4)]
    assert fractions == sorted(fractions, reverse=True)
    assert fractions[0] > fractions[-1]


def test_time_is_fully_accounted_for() -> None:
    for r in compare(POLICIES, LLAMA3, 16_384, 54, seed=3):
        parts = r.productive_seconds + r.save_seconds + r.rework_seconds + r.down_seconds
        assert parts == pytest.approx(r.wall_seconds)
        assert min(r.productive_seconds, r.save_seconds, r.rework_seconds) >= 0
        assert r.down_seconds >= -1e-6


def test_llama3_trace_matches_the_published_rate_and_mix() -> None:
    counts = [len(failure_trace(LLAMA3, 16_384, 54 * 86400, seed=s)) for s in range(20)]
    assert statistics.mean(counts) == pytest.approx(419, rel=0.05)
    trace = [e for s in range(20) for e in failure_trace(LLAMA3, 16_384, 54 * 86400, seed=s)]
    hw = sum(e.failure_class is FailureClass.GPU_HARDWARE for e in trace) / len(trace)
    assert hw == pytest.approx(LLAMA3_MIX[FailureClass.GPU_HARDWARE] / 419, abs=0.03)


def test_same_seed_same_result_different_seed_different_trace() -> None:
    a = simulate(POLICIES["skyresume"], LLAMA3, 16_384, 54, seed=7)
    b = simulate(POLICIES["skyresume"], LLAMA3, 16_384, 54, seed=7)
    c = simulate(POLICIES["skyresume"], LLAMA3, 16_384, 54, seed=8)
    assert a == b
    assert a.productive_seconds != c.productive_seconds


def test_skyresume_beats_both_baselines_at_llama3_scale() -> None:
    by = {r.policy: r for r in compare(POLICIES, LLAMA3, 16_384, 54, seed=0)}
    assert by["skyresume"].effective_fraction > by["skypilot-managed"].effective_fraction
    assert by["skyresume"].effective_fraction > by["torchrun"].effective_fraction
    assert by["skyresume"].lost_cost < by["skypilot-managed"].lost_cost


def test_notices_save_the_work_of_spot_preemptions() -> None:
    model = failure_model("none", spot_preemptions_per_day=6)
    with_notice = POLICIES["skyresume"]
    without = SimPolicy(**{**with_notice.__dict__, "name": "blind", "uses_notices": False})
    a = simulate(with_notice, model, 64, 30, seed=1)
    b = simulate(without, model, 64, 30, seed=1)
    assert a.rework_seconds == 0
    assert b.rework_seconds > 0
    assert a.effective_fraction > b.effective_fraction


@pytest.mark.parametrize(("save", "lost"), [(60, 0.020), (5, 0.007)], ids=["60s", "5s"])
def test_advisor_figures_reproduce_in_simulation(save: float, lost: float) -> None:
    # The advisor's model: uniform 10-minute restarts, no notices, Young's interval.
    p = SimPolicy("young", save, 0, 0, 600, 600, uses_notices=False)
    sim_lost = 1 - _mean_fraction(p, 1, 512, 3650)
    assert sim_lost == pytest.approx(lost, abs=0.0015)
    assert sim_lost == pytest.approx(advise(512, save, 600).lost.total, abs=0.0015)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="days"):
        simulate(POLICIES["skyresume"], LLAMA3, 8, 0)
    with pytest.raises(ValueError, match="gpus"):
        simulate(POLICIES["skyresume"], LLAMA3, 0, 1)
    with pytest.raises(ValueError):
        failure_model("weibull")


def test_history_replaces_the_llama3_model_when_plentiful() -> None:
    from orchestrator.domain.simulator import failure_model_from_history

    # 10x Llama 3's rate, all NCCL transport: the history dominates rate and mix.
    hours = 1e7
    n = round(10 * LLAMA3.rate_per_gpu_hour * hours)
    m = failure_model_from_history({FailureClass.NCCL_TRANSPORT: n}, hours)
    assert m.rate_per_gpu_hour == pytest.approx(10 * LLAMA3.rate_per_gpu_hour, rel=0.02)
    share = m.mix[FailureClass.NCCL_TRANSPORT] / sum(m.mix.values())
    assert share > 0.99
    # No history at all: the Llama 3 model.
    empty = failure_model_from_history({}, 0)
    assert empty.rate_per_gpu_hour == pytest.approx(LLAMA3.rate_per_gpu_hour)
