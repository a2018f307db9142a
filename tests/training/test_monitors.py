"""Detectors: spikes by robust statistics, stragglers, silent corruption."""

from __future__ import annotations

import math

from training.monitors import SpikeDetector, check_reference, detect_straggler, is_spike


def test_loss_spike_is_found_with_evidence():
    d = SpikeDetector("loss_spike")
    losses = [2.0 + 0.01 * (i % 5) for i in range(30)]
    assert all(d.observe(i, v) is None for i, v in enumerate(losses))
    f = d.observe(30, 9.0)
    assert f is not None and f.kind == "loss_spike" and "median 2.02" in f.evidence


def test_one_spike_does_not_hide_the_next():
    d = SpikeDetector("grad_norm_spike")
    for i in range(20):
        d.observe(i, 1.0 + 0.01 * (i % 3))
    assert d.observe(20, 50.0) is not None
    assert d.observe(21, 40.0) is not None


def test_steady_decrease_is_not_a_spike():
    d = SpikeDetector("loss_spike")
    assert all(d.observe(i, 5.0 * 0.98**i) is None for i in range(100))


def test_short_history_is_never_a_spike_but_nan_always_is():
    assert is_spike(100.0, [1.0, 1.0])[0] is False
    assert is_spike(math.nan, [])[0] is True


def test_slowest_rank_and_its_ratio_to_the_median():
    slowest, ratio, f = detect_straggler(5, [1.0, 1.1, 0.9, 2.4])
    assert slowest == 3 and round(ratio, 2) == 2.29
    assert f is not None and "rank 3" in f.evidence
    assert detect_straggler(5, [1.0, 1.05, 0.98, 1.02])[2] is None


def test_reference_drift_is_caught():
    assert check_reference(10, 2.5, 2.5) is None
    assert check_reference(10, 2.5001, 2.5) is not None
    assert check_reference(10, math.inf, 2.5) is not None
