"""Detectors: persistent loss spikes against the run's own noise, stragglers, silent
corruption. Real runs of the reference script are in test_anomaly_signals.py."""

from __future__ import annotations

import math
import random

import pytest

from training.monitors import (
    SpikeDetector,
    SpikeRule,
    StragglerRun,
    check_reference,
    detect_slow_link,
    detect_straggler,
    spike_threshold,
)


def feed(d: SpikeDetector, values: list[float], start: int = 0) -> list:  # type: ignore[type-arg]
    return [s for i, v in enumerate(values, start) if (s := d.observe(i, v)) is not None]


def noisy(n: int, level: float = 2.0, noise: float = 0.05, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.uniform(-noise, noise)) for _ in range(n)]


def test_a_persistent_jump_is_reported_once_naming_its_onset():
    d = SpikeDetector(SpikeRule(persist=3))
    values = noisy(40) + [20.0] * 6 + noisy(20, seed=1)
    spikes = feed(d, values)
    assert len(spikes) == 1
    s = spikes[0]
    assert (s.onset_step, s.detected_step, s.onset_value, s.peak) == (40, 42, 20.0, 20.0)
    assert 1.9 < s.median < 2.1 and "at step 40" in s.evidence()


def test_a_jump_shorter_than_persist_is_not_a_spike():
    d = SpikeDetector(SpikeRule(persist=5))
    assert feed(d, noisy(40) + [20.0] * 4 + noisy(40, seed=1)) == []


def test_the_demos_grad_norm_blip_is_no_spike_on_a_smooth_curve():
    """0.96 against a median of 0.82 with a tiny spread: 30 robust sigmas, but 17%
    above the median, far below the minimum jump, even when it stays there."""
    d = SpikeDetector()
    smooth = [0.82 + 0.001 * (i % 3) for i in range(50)]
    assert feed(d, smooth + [0.96] * 10) == []
    _med, threshold = spike_threshold(smooth, SpikeRule())
    assert threshold == pytest.approx(1.5 * 0.821, rel=1e-3)  # min_jump decides here


def test_a_noisy_run_needs_a_bigger_jump_than_a_smooth_one():
    smooth, rough = noisy(50, noise=0.01), noisy(50, noise=0.5, seed=2)
    rule = SpikeRule()
    assert spike_threshold(smooth, rule)[1] < spike_threshold(rough, rule)[1]
    d = SpikeDetector(rule)
    assert feed(d, rough + [2.0 * 1.6] * 10) == []  # 1.6x: inside this run's own noise


def test_a_steadily_falling_loss_never_spikes():
    d = SpikeDetector()
    assert feed(d, [5.0 * 0.98**i * (1 + 0.05 * math.sin(i)) for i in range(300)]) == []


def test_an_excursion_that_ends_early_rejoins_the_window():
    d = SpikeDetector(SpikeRule(persist=5))
    feed(d, noisy(40) + [20.0] * 3)
    assert 20.0 not in d.history  # held out while it might still be a spike
    d.observe(43, 2.0)
    assert list(d.history).count(20.0) == 3  # it was noise after all


def test_a_spike_does_not_raise_its_own_baseline_and_the_next_one_is_found():
    d = SpikeDetector(SpikeRule(persist=3))
    spikes = feed(d, noisy(40) + [20.0] * 30 + noisy(10, seed=3) + [25.0] * 3)
    assert [(s.onset_step, s.detected_step) for s in spikes] == [(40, 42), (80, 82)]
    assert 1.9 < spikes[1].median < 2.1


def test_too_little_history_is_never_a_spike():
    d = SpikeDetector(SpikeRule(min_history=20, persist=1))
    assert feed(d, [2.0] * 10 + [50.0] * 10) == []


def test_a_nan_is_not_a_spike_but_an_error_of_the_caller():
    with pytest.raises(ValueError, match="not a spike"):
        SpikeDetector().observe(3, math.nan)


@pytest.mark.parametrize(
    "bad",
    [{"persist": 0}, {"z": 0.0}, {"min_jump": -0.1}, {"window": 2}, {"min_jump": math.inf}],
    ids=["persist", "z", "min_jump", "window", "inf"],
)
def test_a_spike_rule_refuses_bad_values(bad):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        SpikeRule(**bad)


def test_slowest_rank_and_its_ratio_to_the_median():
    slowest, ratio, f = detect_straggler(5, [1.0, 1.1, 0.9, 2.4])
    assert slowest == 3 and round(ratio, 2) == 2.29
    assert f is not None and "rank 3" in f.evidence
    assert detect_straggler(5, [1.0, 1.05, 0.98, 1.02])[2] is None


def test_a_straggler_is_reported_only_when_the_same_rank_stays_slow():
    run = StragglerRun(persist=3)

    def share(*times: float):
        slowest, _ratio, f = detect_straggler(0, list(times))
        return run.observe(slowest, f)

    # Noise: some rank is 1.5x over at every share, a different one each time.
    assert [share(2.0, 1, 1, 1), share(1, 2.0, 1, 1), share(1, 1, 2.0, 1)] == [None] * 3
    # A real straggler: rank 3 three shares running, then every share it stays slow.
    assert [share(1, 1, 1, 3.0), share(1, 1, 1, 3.0)] == [None, None]
    assert share(1, 1, 1, 3.0) is not None and share(1, 1, 1, 3.0) is not None
    # One clean share starts the count again.
    assert share(1, 1, 1, 1) is None and share(1, 1, 1, 3.0) is None
    with pytest.raises(ValueError, match="persist"):
        StragglerRun(persist=0)


def test_reference_drift_is_caught():
    assert check_reference(10, 2.5, 2.5) is None
    assert check_reference(10, 2.5001, 2.5) is not None
    assert check_reference(10, math.inf, 2.5) is not None


# --- a slow link: told apart by each rank's upload rate, not its step time ---------------


def test_the_rank_whose_uploads_crawl_is_named_as_the_slow_link():
    # 1 MB each: three ranks at ~100 MB/s, rank 2 behind a 5 mbit link (~0.6 MB/s)
    uploads = [
        (0, 1_000_000, 0.01),
        (1, 1_000_000, 0.012),
        (2, 1_000_000, 1.6),
        (3, 1_000_000, 0.011),
    ]
    found = detect_slow_link(40, uploads)
    assert found is not None
    rank, finding = found
    assert rank == 2 and finding.kind == "slow_link" and finding.value > 100
    assert "rank 2" in finding.evidence and "1.60 s" in finding.evidence


def test_small_shards_that_only_time_request_latency_are_no_slow_link():
    # 10 KB each: 30 ms against 3 ms is a 10x ratio but 27 ms of latency, not bandwidth
    uploads = [(0, 10_000, 0.003), (1, 10_000, 0.03)]
    assert detect_slow_link(40, uploads) is None


def test_even_uploads_or_a_single_rank_name_nobody():
    assert detect_slow_link(40, [(0, 10**6, 0.5), (1, 10**6, 0.6)]) is None
    assert detect_slow_link(40, [(0, 10**6, 9.0)]) is None
    assert detect_slow_link(40, [(0, 0, 0.0), (1, 10**6, 0.1)]) is None
