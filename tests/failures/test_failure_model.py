"""The classifier's learned fallback (orchestrator/domain/failure_model.py, issue #13).

Claims: the committed model is exactly what scripts/train_classifier.py writes from the
development part; ``classify_failure`` uses it by default only if cross-validation said
so; it speaks only where the rules say ``unknown``, only when sure, never as
``user_code_error`` or a class whose cause is a fact about numbers; and when it speaks
the evidence says so.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from orchestrator.domain import failure_model
from orchestrator.domain.failures import (
    MODEL_MAX_CONFIDENCE,
    MODEL_NEVER,
    FailureClass,
    classify_failure,
    failure_features,
)

F = FailureClass
_ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, rel: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _ROOT / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def sure_of(monkeypatch: pytest.MonkeyPatch, cls: FailureClass, margin: float = 20.0) -> None:
    """Replace the model by one that says ``cls`` for any input (p ~ 1 at margin 20)."""
    classes = tuple(str(c) for c in FailureClass)
    bias = tuple(margin if c == str(cls) else 0.0 for c in classes)
    monkeypatch.setattr(failure_model, "CLASSES", classes)
    monkeypatch.setattr(failure_model, "BIAS", bias)
    monkeypatch.setattr(failure_model, "WEIGHTS", {})


UNRECOGNISED = "epoch 3 finished\nverification of the output: MISMATCH"


@pytest.mark.long  # about 90 s: it retrains (5-fold CV); run with -m long
def test_the_committed_model_is_what_the_script_writes_from_the_dev_part() -> None:
    # Regenerate with: .venv/bin/python scripts/train_classifier.py
    train = _load("train_classifier", "scripts/train_classifier.py")
    source, _ = train.build()
    assert (_ROOT / "orchestrator/domain/failure_model.py").read_text(encoding="utf-8") == source


def test_a_sure_model_names_the_class_where_the_rules_say_unknown_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sure_of(monkeypatch, F.GPU_HARDWARE)
    assert classify_failure(1, None, UNRECOGNISED, model_fallback=False).failure_class is F.UNKNOWN
    got = classify_failure(1, None, UNRECOGNISED, model_fallback=True)
    assert got.failure_class is F.GPU_HARDWARE
    assert got.evidence[0].startswith("model: p=1.00 gpu_hardware from words")
    assert "rules alone: unknown" in got.evidence[0]
    assert got.evidence[1] == "verification of the output: MISMATCH"
    # Never as sure as a rule: an operator reads it as a guess with reasons.
    assert got.confidence <= MODEL_MAX_CONFIDENCE


@pytest.mark.parametrize(
    ("exit_code", "signal", "log", "notice", "want"),
    [
        pytest.param(1, None, "RuntimeError: CUDA out of memory.", None, F.CUDA_OOM, id="rule"),
        pytest.param(1, None, "KeyError: 'input_ids'", None, F.USER_CODE_ERROR, id="user-error"),
        pytest.param(None, None, UNRECOGNISED, "terminate", F.PREEMPTION_NOTICE, id="notice"),
        pytest.param(76, None, UNRECOGNISED, None, F.NAN_DIVERGENCE, id="exit-code"),
        pytest.param(None, "SIGKILL", UNRECOGNISED, None, F.HOST_OOM_KILLED, id="bare-sigkill"),
        pytest.param(None, "SIGTERM", UNRECOGNISED, None, F.EXTERNAL_TERMINATION, id="sigterm"),
        pytest.param(1, None, "", None, F.UNKNOWN, id="empty-log"),
    ],
)
def test_the_model_never_overrules_evidence_the_rules_have(
    monkeypatch: pytest.MonkeyPatch,
    exit_code: int | None,
    signal: str | None,
    log: str,
    notice: str | None,
    want: FailureClass,
) -> None:
    sure_of(monkeypatch, F.GPU_HARDWARE)
    assert failure_model.RULES_BELOW < 0.4  # the signal-only guesses (0.4) stand
    got = classify_failure(exit_code, signal, log, notice_kind=notice, model_fallback=True)
    assert got.failure_class is want, got


def test_the_model_never_says_user_code_error_nor_a_numeric_class() -> None:
    # user_code_error is the one class that is not retried: only a rule may say it. A
    # spike, a straggler, wrong numbers are facts about numbers the model cannot read.
    assert {F.USER_CODE_ERROR, F.UNKNOWN, F.LOSS_SPIKE, F.SLOW_PEER, F.SILENT_CORRUPTION} <= (
        MODEL_NEVER
    )


@pytest.mark.parametrize("cls", sorted(MODEL_NEVER), ids=str)
def test_a_class_the_model_may_not_give_stays_unknown_even_when_it_is_sure(
    monkeypatch: pytest.MonkeyPatch, cls: FailureClass
) -> None:
    sure_of(monkeypatch, cls)
    got = classify_failure(1, None, UNRECOGNISED, model_fallback=True)
    assert got.failure_class is F.UNKNOWN
    assert not got.evidence[0].startswith("model:")


def test_an_unsure_model_leaves_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    # 18 classes, one a little ahead: p well under MIN_POSTERIOR.
    sure_of(monkeypatch, F.NCCL_TIMEOUT, margin=1.0)
    assert classify_failure(1, None, UNRECOGNISED, model_fallback=True).failure_class is F.UNKNOWN


@pytest.mark.parametrize("on", [False, True])
def test_the_default_is_what_cross_validation_chose(
    monkeypatch: pytest.MonkeyPatch, on: bool
) -> None:
    sure_of(monkeypatch, F.GPU_HARDWARE)
    monkeypatch.setattr(failure_model, "ON_BY_DEFAULT", on)
    got = classify_failure(1, None, UNRECOGNISED)
    assert got.failure_class is (F.GPU_HARDWARE if on else F.UNKNOWN)


@pytest.mark.parametrize(
    "log",
    [
        "rank 1: chaos: hang at step 40",
        "rank 0: chaos: kill at step 40",
        "resumed from step 0 (none)\nrank 0: skipped: batches 10-20",
        "\n".join(f"step {i} loss: {2.3 - i / 100}" for i in range(8)),
        "\n".join(f"rank {r} step time {t} s" for r, t in enumerate([1, 1.1, 1])),
    ],
    ids=["chaos-hang", "chaos-kill", "skipped", "healthy-loss", "even-ranks"],
)
def test_the_shipped_model_leaves_this_repo_s_own_healthy_lines_unknown(log: str) -> None:
    # Bags of "rank <n> step <n>": a model open to the numeric classes called each of
    # the first three a slow peer at p >= 0.91 and the fourth a loss spike.
    assert classify_failure(None, None, log, model_fallback=True).failure_class is F.UNKNOWN


def test_features_normalise_numbers_paths_and_hex_ids() -> None:
    feats = failure_features(
        ["[rank3]: step 1200 loss 2.31 reading /data/shard_7.bin at 0xdeadbeef"], 1, 9
    )
    assert {"w:<n>", "w:<path>", "w:<hex>", "w:rank#", "b:loss <n>", "exit:1", "sig:9"} <= feats
    assert not any(ch.isdigit() for f in feats if f.startswith(("w:", "b:")) for ch in f)
    assert {"p:process", "p:group", "p:nccl"} <= failure_features(["ProcessGroupNCCL"], None, None)


def test_on_the_corpus_the_model_speaks_only_where_the_rules_said_unknown() -> None:
    bench = _load("bench_classify_model", "bench/classify.py")
    for e in bench.load_corpus():
        got = classify_failure(e.exit_code, e.signal, e.excerpt, model_fallback=True)
        if got.evidence and got.evidence[0].startswith("model:"):
            rules = classify_failure(e.exit_code, e.signal, e.excerpt, model_fallback=False)
            assert rules.failure_class is F.UNKNOWN, e.id
            assert got.failure_class not in MODEL_NEVER, e.id
            assert got.confidence <= MODEL_MAX_CONFIDENCE, e.id
