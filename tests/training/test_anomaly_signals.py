"""Anomaly signals on real runs of the reference script (``train_gpt``, one process,
no checkpoints): clean runs raise no finding whatever the seed, an injected spike is
found at its onset step, an injected NaN on its step.

The runs report through the progress channel, as they do to the agent; the
listener reads what the agent would forward. ``--global-batch 2`` is what each rank
of the demo (4 ranks, global batch 8) computes its loss over, and a noisier run
than the default: both are run. 300 steps reach the plateau where the loss only
wanders (the demo's false finding came after ~100 steps).

The 20-seed sweep is marked ``long`` (about 2.5 min here); the default suite runs
two seeds of each batch size.
"""

from __future__ import annotations

import statistics

import pytest
from datagrams import Listener

from orchestrator.contract import Env, ExitCode
from training import chaos
from training.examples import train_gpt
from training.monitors import MAD_TO_SIGMA, SpikeRule

STEPS = 300
BATCHES = (8, 2)


def run_reference(monkeypatch, *args: str) -> tuple[list[dict], int]:  # type: ignore[no-untyped-def,type-arg]
    """(datagrams, exit code) of one in-process run of the reference script."""
    agent = Listener()
    monkeypatch.setenv(Env.PROGRESS_ADDR, agent.addr)
    for var in (Env.CONTROL_FILE, Env.CHECKPOINT_URI, Env.MICRO_BATCH):
        monkeypatch.delenv(var, raising=False)
    try:
        code = train_gpt.main(["--checkpoint-uri", "", "--straggler-every", "0", *args])
    except SystemExit as e:  # RunExit: the contract's code
        code = int(e.code or 0)
    finally:
        got = agent.close()
    return got, code


def z_alone_flags(values: list[float], z: float = 6.0, window: int = 50) -> int:
    """Steps the old rule would have flagged: robust z alone, no minimum jump, no
    persistence (what called a grad norm of 0.96 against 0.82 a divergence)."""
    flags = 0
    for i in range(8, len(values)):
        w = values[max(0, i - window) : i]
        med = statistics.median(w)
        mad = statistics.median(abs(x - med) for x in w)
        scale = max(MAD_TO_SIGMA * mad, 1e-3 * abs(med), 1e-12)
        flags += (values[i] - med) / scale > z
    return flags


def margins(values: list[float], rule: SpikeRule) -> tuple[float, float, float]:
    """How close a clean loss came to a spike: (largest value over its trailing
    median, largest robust z, largest ratio held for ``persist`` steps)."""
    ratios, zs = [], []
    for i in range(rule.min_history, len(values)):
        w = values[max(0, i - rule.window) : i]
        med = statistics.median(w)
        mad = statistics.median(abs(x - med) for x in w)
        ratios.append(values[i] / med)
        zs.append((values[i] - med) / max(MAD_TO_SIGMA * mad, 1e-12))
    k = rule.persist
    held = max(min(ratios[i : i + k]) for i in range(len(ratios) - k + 1))
    return max(ratios), max(zs), held


def clean_runs(monkeypatch, seeds: range) -> tuple[list[tuple[int, int, dict]], int]:  # type: ignore[no-untyped-def,type-arg]
    findings, old_rule, close = [], 0, []
    for batch in BATCHES:
        for seed in seeds:
            got, code = run_reference(
                monkeypatch, "--seed", str(seed), "--global-batch", str(batch),
                "--max-steps", str(STEPS),
            )  # fmt: skip
            assert code == 0
            progress = [d for d in got if d["type"] == "progress"]
            assert [d["step"] for d in progress] == list(range(1, STEPS + 1))
            findings += [(batch, seed, d) for d in got if d["type"] == "anomaly"]
            old_rule += z_alone_flags([d["grad_norm"] for d in progress])
            close.append(margins([d["loss"] for d in progress], SpikeRule()))
    # For the record (pytest -s): how close the clean losses came to each bound.
    r = SpikeRule()
    print(
        f"{len(close)} clean runs x {STEPS} steps: {len(findings)} findings; largest loss "
        f"over its median {max(c[0] for c in close):.2f}x (bound {1 + r.min_jump:.2f}x), "
        f"robust z {max(c[1] for c in close):.1f} (bound {r.z:g}), held for {r.persist} "
        f"steps {max(c[2] for c in close):.2f}x; the z-alone rule flagged {old_rule} grad norms"
    )
    return findings, old_rule


def test_clean_runs_of_the_reference_script_raise_no_finding(monkeypatch):
    findings, _ = clean_runs(monkeypatch, range(2))
    assert findings == []


@pytest.mark.long
def test_twenty_clean_seeds_raise_no_finding_where_the_old_rule_raised_some(monkeypatch):
    findings, old_rule = clean_runs(monkeypatch, range(20))
    assert findings == []
    assert old_rule > 0  # the runs are noisy enough to have fooled the old rule


def test_an_injected_spike_is_found_at_its_onset_and_training_goes_on(monkeypatch):
    got, code = run_reference(monkeypatch, "--max-steps", "200", "--inject-spike-at", "120")
    assert code == 0
    spikes = [d for d in got if d["type"] == "anomaly"]
    assert len(spikes) == 1, spikes
    s = spikes[0]
    persist = SpikeRule().persist
    assert (s["kind"], s["step"], s["onset_step"]) == ("spike", 120, 120)
    assert (s["detected_step"], s["persist"], s["metric"]) == (120 + persist - 1, persist, "loss")
    assert s["value"] > 5 * s["median"] and s["peak"] >= s["value"]
    # The forward was scaled, so the gradients were too: the evidence shows it.
    assert s["grad_norm"] > 5 * s["grad_norm_median"]
    progress = {d["step"]: d["loss"] for d in got if d["type"] == "progress"}
    assert len(progress) == 200  # the rank reports and keeps training
    # progress step N + 1 is step N's loss: x10 from the onset, for SPIKE_STEPS steps
    assert progress[121] > 5 * progress[120]
    assert progress[121 + chaos.SPIKE_STEPS] < 2 * progress[120]


def test_an_injected_nan_is_found_on_its_step_and_is_not_a_spike(monkeypatch):
    got, code = run_reference(monkeypatch, "--max-steps", "200", "--inject-nan-at", "120")
    assert code == ExitCode.NAN_DETECTED
    anomalies = [d for d in got if d["type"] == "anomaly"]
    assert [(a["kind"], a["step"], a["onset_step"]) for a in anomalies] == [("nan", 120, 120)]
    assert max(d["step"] for d in got if d["type"] == "progress") == 120  # no update applied
