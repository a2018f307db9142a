"""The corpus of real failure excerpts (tests/failures/corpus/*.jsonl) and its split.

The classifier's figures in BENCHMARKS.md are only as good as this data: every line
must parse, carry a taxonomy label and a source, appear once, and the development /
held-out split must keep each source project on one side.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from types import ModuleType

import pytest

from orchestrator.domain.failures import CLASSIFIABLE, FailureClass

_ROOT = Path(__file__).resolve().parents[2]


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_classify", _ROOT / "bench/classify.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()
CORPUS = bench.load_corpus()
FIELDS = {"id", "label", "source", "project", "reason", "excerpt", "exit_code", "signal"}
_GITHUB = re.compile(r"^https?://github\.com/([^/\s]+/[^/\s#?]+)")


def test_every_line_is_one_json_object_with_the_corpus_fields() -> None:
    files = sorted(bench.CORPUS_DIR.glob("*.jsonl"))
    assert files, "no corpus files"
    for path in files:
        for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not raw.strip():
                continue
            d = json.loads(raw)
            where = f"{path.name}:{n}"
            assert isinstance(d, dict), where
            assert set(d) >= FIELDS, f"{where}: missing {FIELDS - set(d)}"
            for key in ("id", "label", "source", "project", "reason", "excerpt"):
                assert isinstance(d[key], str) and d[key].strip(), f"{where}: empty {key}"
            assert d["exit_code"] is None or isinstance(d["exit_code"], int), where
            assert d["signal"] is None or isinstance(d["signal"], int | str), where
            assert d["source"].startswith(("http://", "https://")), where


def test_labels_are_taxonomy_values() -> None:
    values = {c.value for c in FailureClass}
    bad = [(e.file, e.line, e.label) for e in CORPUS if e.label not in values]
    assert not bad


def test_signals_parse_as_the_classifier_reads_them() -> None:
    """Every signal an excerpt names is one the classifier reads as a number (an
    unknown name raises): the excerpt's exit is scored as it happened."""
    import signal as signals

    from orchestrator.domain.failures import effective_signal

    named = [e for e in CORPUS if e.signal is not None]
    assert named, "the corpus names no signal: this claim checks nothing"
    for e in named:
        sig = effective_signal(e.exit_code, e.signal)
        assert sig is not None and sig in {int(s) for s in signals.Signals}, (e.signal, sig)


def test_no_excerpt_appears_twice() -> None:
    seen: dict[str, str] = {}
    dupes = []
    for e in CORPUS:
        key = " ".join(e.excerpt.split())
        if key in seen:
            dupes.append((seen[key], f"{e.file}:{e.line}"))
        seen.setdefault(key, f"{e.file}:{e.line}")
    assert not dupes


def test_ids_are_unique() -> None:
    ids = Counter(e.id for e in CORPUS)
    assert [i for i, n in ids.items() if n > 1] == []


def test_excerpts_are_short_quotes() -> None:
    long = [(e.file, e.line, len(e.excerpt)) for e in CORPUS if len(e.excerpt) > 1500]
    assert not long


def test_a_github_source_names_its_own_project() -> None:
    # The split is by project: a thread filed under another project's name would put
    # one project on both sides.
    wrong = []
    for e in CORPUS:
        m = _GITHUB.match(e.source)
        if m and bench.project_key(m.group(1)) != bench.project_key(e.project):
            wrong.append((e.file, e.line, e.project, e.source))
    assert not wrong


def test_split_keeps_every_project_on_one_side() -> None:
    dev, held = bench.split(CORPUS)
    assert len(dev) + len(held) == len(CORPUS)
    dev_projects = {bench.project_key(e.project) for e in dev}
    held_projects = {bench.project_key(e.project) for e in held}
    assert dev_projects and held_projects
    assert dev_projects.isdisjoint(held_projects)


def test_split_is_a_function_of_the_project_name_alone() -> None:
    # Stable while the corpus grows: adding excerpts never moves a project.
    assert bench.split_of("pytorch/pytorch") == bench.split_of(" PyTorch/PyTorch/")
    sides = {bench.split_of(f"owner{i}/repo{i}") for i in range(200)}
    assert sides == {bench.HELD_OUT, bench.DEV}
    share = sum(bench.split_of(f"owner{i}/repo{i}") == bench.HELD_OUT for i in range(2000))
    assert 0.25 <= share / 2000 <= 0.35


def test_split_holds_out_every_well_sourced_class_and_about_a_third() -> None:
    assert bench.split_problems(CORPUS) == []


# --- how much the corpus holds (issue #13: >= 400 excerpts, >= 20 per class where the
# class occurs in the wild, from >= 8 projects per class) ---

#: Classes public threads rarely quote as log text, with the counts the collectors
#: actually found: (excerpts, projects). Each is the real number, checked exactly, so
#: the shortfall is stated here rather than hidden by a lower bar.
RARE: dict[str, tuple[int, int]] = {}


def _counts() -> tuple[Counter[str], dict[str, set[str]]]:
    n: Counter[str] = Counter()
    projects: dict[str, set[str]] = defaultdict(set)
    for e in CORPUS:
        n[e.label] += 1
        projects[e.label].add(bench.project_key(e.project))
    return n, projects


def test_corpus_has_at_least_400_excerpts() -> None:
    assert len(CORPUS) >= 400, f"{len(CORPUS)} excerpts"


@pytest.mark.parametrize("label", [c.value for c in CLASSIFIABLE])
def test_each_class_has_20_excerpts_from_8_projects_or_its_real_count_is_recorded(
    label: str,
) -> None:
    n, projects = _counts()
    got = (n[label], len(projects[label]))
    if label in RARE:
        assert got == RARE[label], f"{label}: corpus has {got}, RARE records {RARE[label]}"
        assert got[0] < 20 or got[1] < 8, f"{label} meets the bar now: drop it from RARE"
    else:
        assert got[0] >= 20 and got[1] >= 8, f"{label}: {got[0]} excerpts, {got[1]} projects"


def test_sources_md_lists_the_corpus_as_it_is() -> None:
    # Regenerate with: .venv/bin/python bench/classify.py --write-sources
    path = bench.CORPUS_DIR / "SOURCES.md"
    assert path.read_text(encoding="utf-8") == bench.sources_markdown(CORPUS)


# --- the classifier on the corpus ---

#: Floors against regressions at the measured figures (BENCHMARKS.md), below the
#: issue's target (>= 95% held-out, no class under 85%), which is not met yet.
#: ``classify_failure``'s default is the rules alone (the learned fallback did not beat
#: them in grouped cross-validation on dev): 87.7% held out (143/163) in round 5's one
#: measurement, 98.2% dev; round 6's one measurement the same 143/163, 98.9% dev. (The
#: floor was 0.88 at 136/154: the 9 held-out excerpts round 5 added score 7/9, and the
#: 154 older ones are unchanged.)
#: Round 7's one measurement: 85.8% held out (145/169), 98.8% dev. The floor fell from
#: 0.87: the 163 older held-out excerpts score the same 143 (no rule change moved one),
#: and of the 6 that round 7's new projects added 2 are right.
HELD_OUT_FLOOR = 0.85
DEV_FLOOR = 0.98
#: Rules + learned fallback (``model_fallback=True``): 88.3% held out (144/163), 98.9%
#: dev (its training data), regenerated on round 6's development part. (The floor was
#: 0.89 at round 5's 146/163: the regenerated model speaks on 1 held-out excerpt, not
#: 3; the rules alone are unchanged at 143/163.)
#: Round 7 (not regenerated): 86.4% held out (146/169), 98.8% dev.
FALLBACK_HELD_OUT_FLOOR = 0.86
FALLBACK_DEV_FLOOR = 0.98


def test_classifier_holds_its_measured_accuracy_on_both_parts() -> None:
    dev, held = bench.split(CORPUS)
    d, h = bench.score(dev), bench.score(held)
    assert d.accuracy >= DEV_FLOOR, f"dev {d.accuracy:.1%}"
    assert h.accuracy >= HELD_OUT_FLOOR, f"held out {h.accuracy:.1%}"


def test_rules_with_the_learned_fallback_hold_their_measured_accuracy() -> None:
    dev, held = bench.split(CORPUS)
    d, h = bench.score(dev, bench.predict_hybrid), bench.score(held, bench.predict_hybrid)
    assert d.accuracy >= FALLBACK_DEV_FLOOR, f"dev {d.accuracy:.1%}"
    assert h.accuracy >= FALLBACK_HELD_OUT_FLOOR, f"held out {h.accuracy:.1%}"


#: None since round 6: the user's own AssertionError comparing two tensors, where NCCL
#: had zeroed the tail of one (NVIDIA/nccl#1950), is now read as a truncated copy.
KNOWN_FALSE_USER_ERRORS: set[str] = set()


def test_no_other_failure_is_called_a_user_error() -> None:
    # The one class that is not retried: a wrong user_code_error fails a job that a
    # restart would have saved.
    for predict in (bench.predict_rules, bench.predict_hybrid):
        wrong = {
            e.id for e in CORPUS if e.label != "user_code_error" and predict(e) == "user_code_error"
        }
        assert wrong <= KNOWN_FALSE_USER_ERRORS
