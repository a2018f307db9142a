from __future__ import annotations

import math

import pytest

from orchestrator.domain.advisor import (
    LLAMA3_RATE_PER_GPU_HOUR,
    Exposure,
    PlacementKey,
    advise,
    estimate_rate,
    interval_changed_meaningfully,
    llama3_mtbf_hours,
    young_interval_seconds,
)

# The figures the issue gives, with a 10-minute restart.
RESTART = 600.0


def test_llama3_rate_is_one_interruption_every_3_1_hours_at_full_scale() -> None:
    assert llama3_mtbf_hours(16_384) == pytest.approx(54 * 24 / 419)
    assert llama3_mtbf_hours(16_384) == pytest.approx(3.09, abs=0.01)


def test_mtbf_scales_inversely_with_gpu_count() -> None:
    assert llama3_mtbf_hours(512) == pytest.approx(32 * llama3_mtbf_hours(16_384))


def test_512_gpus_60s_saves_give_109_minutes_and_2_percent() -> None:
    a = advise(512, 60, RESTART)
    assert a.interval_minutes == pytest.approx(109, abs=1)
    assert a.lost.total == pytest.approx(0.020, abs=0.001)


def test_512_gpus_5s_saves_give_31_minutes_and_0_7_percent() -> None:
    a = advise(512, 5, RESTART)
    assert a.interval_minutes == pytest.approx(31, abs=1)
    assert a.lost.total == pytest.approx(0.007, abs=0.0005)


def test_young_interval_minimises_the_first_order_loss() -> None:
    m = 100 * 3600.0
    best = young_interval_seconds(60, m)

    def loss(t: float) -> float:
        return 60 / t + t / (2 * m)

    assert loss(best) < loss(best * 0.8)
    assert loss(best) < loss(best * 1.25)


def test_explicit_mtbf_overrides_the_llama3_rate() -> None:
    a = advise(512, 60, RESTART, mtbf_hours=10)
    assert a.interval_seconds == pytest.approx(math.sqrt(2 * 60 * 36_000))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpus": 0, "save_seconds": 60, "restart_seconds": 1},
        {"gpus": 8, "save_seconds": 0, "restart_seconds": 1},
        {"gpus": 8, "save_seconds": 60, "restart_seconds": -1},
        {"gpus": 8, "save_seconds": 60, "restart_seconds": 1, "mtbf_hours": -2},
    ],
    ids=["gpus", "save", "restart", "mtbf"],
)
def test_bad_inputs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        advise(**kwargs)  # type: ignore[arg-type]


KEY = PlacementKey("aws", "us-east-1", "p4d.24xlarge")
OTHER = PlacementKey("gcp", "us-central1", "a2-highgpu-8g")


def test_no_history_gives_the_prior() -> None:
    est = estimate_rate(KEY, [])
    assert est.rate_per_gpu_hour == pytest.approx(LLAMA3_RATE_PER_GPU_HOUR)
    assert est.prior_weight == 1.0


def test_plenty_of_history_outweighs_the_prior() -> None:
    rate = 10 * LLAMA3_RATE_PER_GPU_HOUR
    hours = 1e7
    est = estimate_rate(KEY, [Exposure(KEY, hours, round(rate * hours))])
    assert est.rate_per_gpu_hour == pytest.approx(rate, rel=0.01)
    assert est.prior_weight < 0.02


def test_thin_history_stays_near_the_prior() -> None:
    # One lucky day of 64 GPUs without failures must not claim a perfect region.
    est = estimate_rate(KEY, [Exposure(KEY, 64 * 24, 0)])
    assert est.rate_per_gpu_hour > 0.9 * LLAMA3_RATE_PER_GPU_HOUR


def test_history_of_other_placements_is_ignored() -> None:
    est = estimate_rate(KEY, [Exposure(OTHER, 1e7, 10_000)])
    assert est.rate_per_gpu_hour == pytest.approx(LLAMA3_RATE_PER_GPU_HOUR)


def test_more_failures_mean_shorter_mtbf() -> None:
    few = estimate_rate(KEY, [Exposure(KEY, 1e5, 1)]).mtbf_hours(512)
    many = estimate_rate(KEY, [Exposure(KEY, 1e5, 50)]).mtbf_hours(512)
    assert many < few


def test_small_interval_changes_are_not_pushed() -> None:
    assert not interval_changed_meaningfully(6000, 6500)
    assert interval_changed_meaningfully(6000, 3000)


def test_flaky_placement_gets_a_shorter_interval_than_a_quiet_one() -> None:
    from orchestrator.domain.advisor import advise_from_history

    flaky = PlacementKey("aws", "us-east-1", "p5.48xlarge")
    quiet = PlacementKey("gcp", "europe-west4", "a3-highgpu-8g")
    hist = [Exposure(flaky, 5e5, 200), Exposure(quiet, 5e5, 1)]
    a_flaky, e_flaky = advise_from_history(flaky, hist, 512, 60, 600)
    a_quiet, _ = advise_from_history(quiet, hist, 512, 60, 600)
    assert a_flaky.interval_seconds < a_quiet.interval_seconds
    assert e_flaky.observed_failures == 200
    assert interval_changed_meaningfully(a_quiet.interval_seconds, a_flaky.interval_seconds)
