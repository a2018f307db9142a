from __future__ import annotations

import math

import pytest

from orchestrator.domain.advisor import (
    LLAMA3_RATE_PER_GPU_HOUR,
    MAX_FACTOR_PER_PUSH,
    MAX_INTERVAL_S,
    MIN_INTERVAL_S,
    Exposure,
    PlacementKey,
    advise,
    advise_from_history,
    daly_interval_seconds,
    estimate_rate,
    interval_changed_meaningfully,
    llama3_mtbf_hours,
    next_checkpoint_every,
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
    assert a.interval_seconds == pytest.approx(daly_interval_seconds(60, 36_000))
    assert a.interval_seconds == pytest.approx(math.sqrt(2 * 60 * 36_000), rel=0.03)


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
    assert est.rate_per_gpu_hour == pytest.approx(LLAMA3_RATE_PER_GPU_HOUR, rel=1e-4)
    assert est.prior_weight == pytest.approx(1.0)


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
    assert est.rate_per_gpu_hour == pytest.approx(LLAMA3_RATE_PER_GPU_HOUR, rel=1e-4)


def test_more_failures_mean_shorter_mtbf() -> None:
    few = estimate_rate(KEY, [Exposure(KEY, 1e5, 1)]).mtbf_hours(512)
    many = estimate_rate(KEY, [Exposure(KEY, 1e5, 50)]).mtbf_hours(512)
    assert many < few


def test_small_interval_changes_are_not_pushed() -> None:
    assert not interval_changed_meaningfully(6000, 6500)
    assert interval_changed_meaningfully(6000, 3000)


def test_flaky_placement_gets_a_shorter_interval_than_a_quiet_one() -> None:
    flaky = PlacementKey("aws", "us-east-1", "p5.48xlarge")
    quiet = PlacementKey("gcp", "europe-west4", "a3-highgpu-8g")
    hist = [Exposure(flaky, 5e5, 200), Exposure(quiet, 5e5, 1)]
    a_flaky, e_flaky = advise_from_history(flaky, hist, 512, 60, 600)
    a_quiet, _ = advise_from_history(quiet, hist, 512, 60, 600)
    assert a_flaky.interval_seconds < a_quiet.interval_seconds
    assert e_flaky.observed_failures == 200
    assert interval_changed_meaningfully(a_quiet.interval_seconds, a_flaky.interval_seconds)


# --- the measured rate wins (issue 27) ------------------------------------------------------
# The minimal.py run of issue 27: 2 nodes x 2 ranks; after 6 failures in 1.3 GPU-hours of
# its placement's history the service pushed "checkpoint every 40,719 steps (was 100)".
# Save time: minimal.py's blocking save, measured here (median of 5 saves under torchrun:
# 0.017 s). Step time: the one that, with that save and the old prior, gives exactly the
# 40,719 steps pushed (0.0153 s; minimal.py steps at 0.003-0.009 s on 2 idle ranks here).
ISSUE_RANKS = 4
ISSUE_SAVE_S = 0.017
ISSUE_STEP_S = 0.0153
ISSUE_HISTORY = [Exposure(KEY, 1.3, 6)]


def _old_prior_interval_steps() -> float:
    """What the previous advisor computed: one gamma prior worth 2 Llama 3 failures."""
    b = 2.0 / LLAMA3_RATE_PER_GPU_HOUR
    mtbf_s = 3600.0 / ((2.0 + 6) / (b + 1.3) * ISSUE_RANKS)
    return young_interval_seconds(ISSUE_SAVE_S, mtbf_s) / ISSUE_STEP_S


def test_the_issue_figures_are_those_of_the_old_prior() -> None:
    assert _old_prior_interval_steps() == pytest.approx(40_719, rel=0.01)


def test_the_issue_run_replayed_follows_its_failures_not_the_prior() -> None:
    advice, est = advise_from_history(KEY, ISSUE_HISTORY, ISSUE_RANKS, ISSUE_SAVE_S, 60)
    # The data's own rate (6 / 1.3 per GPU-hour) is what the estimate says now.
    assert est.rate_per_gpu_hour == pytest.approx(6 / 1.3, rel=0.25)
    assert est.prior_weight < 1e-6
    # An MTBF of minutes (6 failures in 19.5 minutes on 4 ranks), not 3,000 hours.
    assert 150 < advice.mtbf_hours * 3600 < 300
    steps = advice.interval_seconds / ISSUE_STEP_S
    # Young's optimum for a 17 ms save and a ~4-minute MTBF is ~190 steps of 15 ms:
    # 200 times shorter than the push, within a factor of 2 of the 100 the job ran.
    assert 100 < steps < 250 < _old_prior_interval_steps() / 150
    assert next_checkpoint_every(100, ISSUE_STEP_S, advice.interval_seconds) == round(steps)
    # From the 40,719 the old advisor pushed, the way back is a factor per push.
    assert next_checkpoint_every(40_719, ISSUE_STEP_S, advice.interval_seconds) == round(
        40_719 / MAX_FACTOR_PER_PUSH
    )


def test_the_interval_goes_below_100_steps_once_the_mtbf_is_under_a_minute() -> None:
    # 40 failures in 1.3 GPU-h on 4 ranks: one every ~40 s; Young's is ~75 steps.
    hist = [Exposure(KEY, 1.3, 40)]
    advice, _ = advise_from_history(KEY, hist, ISSUE_RANKS, ISSUE_SAVE_S, 60)
    assert advice.mtbf_hours * 3600 < 60
    new = next_checkpoint_every(100, ISSUE_STEP_S, advice.interval_seconds)
    assert new is not None and new < 100


@pytest.mark.parametrize(
    ("failures", "data_wins"),
    [(0, False), (1, False), (3, True), (6, True)],
    ids=["none", "one", "three", "six"],
)
def test_a_third_failure_within_a_gpu_hour_hands_the_estimate_to_the_data(
    failures: int, data_wins: bool
) -> None:
    est = estimate_rate(KEY, [Exposure(KEY, 1.0, failures)])
    if data_wins:
        assert est.rate_per_gpu_hour > 0.5 * failures / 1.0
        assert est.prior_weight < 0.01
    else:
        assert est.rate_per_gpu_hour < 5 * LLAMA3_RATE_PER_GPU_HOUR
        assert est.prior_weight > 0.99


def test_daly_is_young_for_small_saves_and_the_mtbf_for_huge_ones() -> None:
    assert daly_interval_seconds(1, 1e6) == pytest.approx(young_interval_seconds(1, 1e6), rel=1e-3)
    assert daly_interval_seconds(100, 40) == 40
    assert daly_interval_seconds(30, 60) < young_interval_seconds(30, 60)


def test_the_advised_interval_is_bounded() -> None:
    # Llama 3's rate on one GPU with a 10-minute save: Young says ~15 days.
    assert advise(1, 600, RESTART).interval_seconds == MAX_INTERVAL_S
    assert advise(8, 1e-6, RESTART, mtbf_hours=1e-6).interval_seconds == MIN_INTERVAL_S


@pytest.mark.parametrize(
    ("current", "interval_s", "want"),
    [
        (100, 1.0e6, 400),  # far longer advised: at most x4 per push
        (100, 0.1, 25),  # far shorter: at most /4
        (100, 2.2, 220),  # within the factor: the advice itself
        (100, 1.1, None),  # 10 % off: not worth telling the job
        (1, 0.0001, None),  # never below one step
    ],
    ids=["up-x4", "down-x4", "within", "small-change", "floor"],
)
def test_an_interval_moves_at_most_a_factor_per_push(
    current: int, interval_s: float, want: int | None
) -> None:
    assert next_checkpoint_every(current, 0.01, interval_s) == want


@pytest.mark.parametrize(
    "args",
    [(0, 0.01, 1.0), (10, 0.0, 1.0), (10, 0.01, -1.0), (10, 0.01, float("nan"))],
    ids=["every", "step", "interval", "nan"],
)
def test_next_checkpoint_every_refuses_bad_input(args: tuple[int, float, float]) -> None:
    with pytest.raises(ValueError):
        next_checkpoint_every(*args)
