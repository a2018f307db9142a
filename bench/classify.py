"""The failure classifier measured on real log excerpts (issue #13).

    .venv/bin/python bench/classify.py            # held-out figures, then one JSON line
    .venv/bin/python bench/classify.py --dev      # development part only, with its misses

The corpus is ``tests/failures/corpus/*.jsonl``: excerpts quoted in public issue threads
and forums, each labelled with the root cause the thread concluded. It is split BY
SOURCE PROJECT (:func:`split_of`): every project lies wholly in the development part or
wholly in the held-out part, so the held-out figure measures how the classifier does on
projects, log formats and wordings it was never developed against. ``--dev`` is the
development loop: it scores and lists the development part only and never touches the
held-out part, whose misses are not for reading one by one.

Two classifiers are measured: the rules with the learned fallback of
``orchestrator/domain/failure_model.py`` where they say ``unknown``
(``model_fallback=True``; the main result) and the rules alone
(``model_fallback=False``); ``classify_failure``'s default is whichever the
training script's grouped cross-validation on dev found better
(``failure_model.ON_BY_DEFAULT``). Prints accuracy overall and per class for both and
the confusion matrix of rules + fallback on the held-out part (dev accuracy for
contrast; the fallback was trained on the dev part, so its dev figure is not a
measurement), and ends with one JSON line ``{"bench": "classify", ...}``. Pure CPU, a
few seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from orchestrator.domain import failure_model  # noqa: E402
from orchestrator.domain.failures import CLASSIFIABLE, FailureClass, classify_failure  # noqa: E402

CORPUS_DIR = _ROOT / "tests" / "failures" / "corpus"

#: Salt of the project hash. Fixed, so a project keeps its side while the corpus grows
#: (a new project lands on the side its own hash says); changed only if the split
#: stops meeting :func:`split_problems` and never to move a project the classifier
#: gets wrong.
SPLIT_SALT = "skyresume-13"
#: Share of projects (by hash) in the held-out part.
HELD_OUT_PERMILLE = 300
HELD_OUT = "held_out"
DEV = "dev"


@dataclass(frozen=True)
class Excerpt:
    id: str
    label: str
    source: str
    project: str
    reason: str
    excerpt: str
    exit_code: int | None
    signal: int | str | None
    file: str
    line: int


def load_corpus(directory: Path = CORPUS_DIR) -> list[Excerpt]:
    """Every excerpt of every ``*.jsonl`` file, in file and line order."""
    out: list[Excerpt] = []
    for path in sorted(directory.glob("*.jsonl")):
        for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not raw.strip():
                continue
            d = json.loads(raw)
            out.append(
                Excerpt(
                    id=d["id"],
                    label=d["label"],
                    source=d["source"],
                    project=d["project"],
                    reason=d.get("reason", ""),
                    excerpt=d["excerpt"],
                    exit_code=d.get("exit_code"),
                    signal=d.get("signal"),
                    file=path.name,
                    line=n,
                )
            )
    return out


def project_key(project: str) -> str:
    """One spelling per project: ``PyTorch/PyTorch`` and ``pytorch/pytorch `` agree."""
    p = project.strip().lower().removeprefix("https://").removeprefix("github.com/")
    return p.removeprefix("www.").rstrip("/")


def split_of(project: str, salt: str = SPLIT_SALT) -> str:
    """``held_out`` or ``dev`` for a project, from a hash of its name alone."""
    h = hashlib.sha256(f"{salt}:{project_key(project)}".encode()).digest()
    return HELD_OUT if int.from_bytes(h[:4], "big") % 1000 < HELD_OUT_PERMILLE else DEV


def split(corpus: Iterable[Excerpt]) -> tuple[list[Excerpt], list[Excerpt]]:
    """(development, held-out)."""
    dev: list[Excerpt] = []
    held: list[Excerpt] = []
    for e in corpus:
        (held if split_of(e.project) == HELD_OUT else dev).append(e)
    return dev, held


#: A class seen in at least this many projects must have held-out examples.
MIN_PROJECTS_FOR_HELD_OUT = 8


def split_problems(corpus: Sequence[Excerpt]) -> list[str]:
    """What is wrong with the split of this corpus (empty when it is fine)."""
    problems: list[str] = []
    projects: dict[str, set[str]] = defaultdict(set)
    held: Counter[str] = Counter()
    for e in corpus:
        projects[e.label].add(project_key(e.project))
        if split_of(e.project) == HELD_OUT:
            held[e.label] += 1
    for label, ps in sorted(projects.items()):
        if len(ps) >= MIN_PROJECTS_FOR_HELD_OUT and held[label] == 0:
            problems.append(f"{label}: {len(ps)} projects, none held out")
    if corpus:
        share = sum(held.values()) / len(corpus)
        if not 0.15 <= share <= 0.45:
            problems.append(f"held-out share of excerpts is {share:.0%}, want 15-45%")
    return problems


def predict(e: Excerpt) -> str:
    """``classify_failure`` as it ships (``failure_model.ON_BY_DEFAULT`` decides whether
    the learned fallback is on)."""
    return str(classify_failure(e.exit_code, e.signal, e.excerpt).failure_class)


def predict_rules(e: Excerpt) -> str:
    """The rules alone."""
    c = classify_failure(e.exit_code, e.signal, e.excerpt, model_fallback=False)
    return str(c.failure_class)


def predict_hybrid(e: Excerpt) -> str:
    """The rules, then the learned fallback where they say ``unknown``."""
    c = classify_failure(e.exit_code, e.signal, e.excerpt, model_fallback=True)
    return str(c.failure_class)


def decided_by_model(e: Excerpt) -> bool:
    c = classify_failure(e.exit_code, e.signal, e.excerpt, model_fallback=True)
    return bool(c.evidence) and c.evidence[0].startswith("model:")


# --- the learned alternative, for contrast -------------------------------------------

_TOKEN = re.compile(r"[a-z][a-z_]{2,}")


def _tokens(text: str) -> set[str]:
    return set(_TOKEN.findall(text.lower()))


class NaiveBayes:
    """Multinomial naive Bayes over the words of an excerpt (presence, Laplace
    smoothing), trained on the development part: the small learned model the issue
    allows, measured here to show what learning from ~300 excerpts buys over rules."""

    def __init__(self, items: Sequence[Excerpt]) -> None:
        self.prior: Counter[str] = Counter(e.label for e in items)
        self.words: dict[str, Counter[str]] = defaultdict(Counter)
        for e in items:
            self.words[e.label].update(_tokens(e.excerpt))
        self.vocab = {w for c in self.words.values() for w in c}
        self.total = {k: sum(c.values()) for k, c in self.words.items()}

    def __call__(self, e: Excerpt) -> str:
        toks = [t for t in _tokens(e.excerpt) if t in self.vocab]
        n = sum(self.prior.values())
        v = len(self.vocab)

        def logp(label: str) -> float:
            c, t = self.words[label], self.total[label]
            return math.log(self.prior[label] / n) + sum(
                math.log((c[w] + 1) / (t + v)) for w in toks
            )

        return max(sorted(self.prior), key=logp)


@dataclass(frozen=True)
class Score:
    n: int
    correct: int
    per_class: dict[str, tuple[int, int]]
    """label -> (correct, n)"""
    confusion: dict[tuple[str, str], int]
    """(label, predicted) -> count"""
    misses: list[tuple[Excerpt, str]]

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0


def score(items: Sequence[Excerpt], model: Callable[[Excerpt], str] = predict) -> Score:
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    confusion: Counter[tuple[str, str]] = Counter()
    misses: list[tuple[Excerpt, str]] = []
    for e in items:
        got = model(e)
        per[e.label][1] += 1
        confusion[(e.label, got)] += 1
        if got == e.label:
            per[e.label][0] += 1
        else:
            misses.append((e, got))
    correct = sum(c for c, _ in per.values())
    return Score(
        len(items),
        correct,
        {k: (c, n) for k, (c, n) in per.items()},
        dict(confusion),
        misses,
    )


_ABBREV = {str(c): "".join(w[0] for w in str(c).split("_")) for c in CLASSIFIABLE}
_ABBREV.update({"nccl_timeout": "nt", "nccl_transport": "ntr", "node_lost": "nl"})


def _print_confusion(s: Score) -> None:
    labels = [str(c) for c in CLASSIFIABLE]
    rows = [lab for lab in labels if any(k[0] == lab for k in s.confusion)]
    cols = [lab for lab in labels if any(k[1] == lab for k in s.confusion)]
    print("confusion (rows: label, columns: predicted)")
    print(" " * 22 + "".join(f"{_ABBREV[c]:>5}" for c in cols))
    for r in rows:
        cells = "".join(f"{s.confusion.get((r, c), 0) or '.':>5}" for c in cols)
        print(f"{r:22}{cells}")
    print("  " + ", ".join(f"{_ABBREV[c]}={c}" for c in cols))


def sources_markdown(corpus: Sequence[Excerpt]) -> str:
    """tests/failures/corpus/SOURCES.md: every project, its side of the split, its
    excerpts per class and the threads they were quoted from."""
    by_project: dict[str, list[Excerpt]] = defaultdict(list)
    for e in corpus:
        by_project[project_key(e.project)].append(e)
    labels = Counter(e.label for e in corpus)
    out = [
        "# Sources of the failure corpus",
        "",
        "Generated by `.venv/bin/python bench/classify.py --write-sources`; do not edit.",
        f"{len(corpus)} excerpts from {len(by_project)} projects. Split: `held_out` or "
        "`dev` by a hash of the project name (`bench/classify.py`, `split_of`).",
        "",
        "| class | excerpts | projects |",
        "|---|---|---|",
    ]
    for c in CLASSIFIABLE:
        ps = {project_key(e.project) for e in corpus if e.label == str(c)}
        out.append(f"| `{c}` | {labels[str(c)]} | {len(ps)} |")
    out += ["", "| project | split | excerpts | classes | threads |", "|---|---|---|---|---|"]
    order = sorted(by_project.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    for key, items in order:
        classes = Counter(e.label for e in items)
        cls = ", ".join(f"{k} {n}" for k, n in sorted(classes.items()))
        threads = " ".join(sorted({e.source for e in items}))
        out.append(f"| {items[0].project} | {split_of(key)} | {len(items)} | {cls} | {threads} |")
    return "\n".join(out) + "\n"


def examples_markdown(items: Sequence[Excerpt]) -> str:
    """One real excerpt per class (the shortest that the classifier gets right), for
    docs/failures.md."""
    out: list[str] = []
    for c in CLASSIFIABLE:
        mine = sorted(
            (e for e in items if e.label == str(c) and predict(e) == e.label),
            key=lambda e: (len(e.excerpt), e.id),
        )
        if not mine:
            continue
        e = mine[0]
        text = "\n".join(e.excerpt.strip().splitlines()[-12:])
        out += [f"- `{c}` ({e.source}):", "", "  ```text"]
        out += [f"  {line[:160]}" for line in text.splitlines()]
        out += ["  ```", ""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dev", action="store_true", help="score and list the development part only")
    ap.add_argument(
        "--write-sources", action="store_true", help="(re)write corpus/SOURCES.md and exit"
    )
    ap.add_argument(
        "--examples", action="store_true", help="print one dev excerpt per class (markdown)"
    )
    args = ap.parse_args(argv)

    corpus = load_corpus()
    dev, held = split(corpus)
    if args.write_sources:
        (CORPUS_DIR / "SOURCES.md").write_text(sources_markdown(corpus), encoding="utf-8")
        return 0
    if args.examples:
        print(examples_markdown(dev))
        return 0
    if args.dev:
        d, r = score(dev, predict_hybrid), score(dev, predict_rules)
        print(
            f"dev accuracy, rules + fallback: {d.accuracy:.1%} ({d.correct}/{d.n}); rules alone "
            f"{r.accuracy:.1%} ({r.correct}/{r.n}) (the fallback was trained on this part: "
            "scripts/train_classifier.py prints its cross-validated figure)"
        )
        for c in CLASSIFIABLE:
            dc, dn = d.per_class.get(str(c), (0, 0))
            if dn:
                print(f"{c!s:22} {dc}/{dn} {dc / dn:4.0%}")
        for e, got in d.misses:
            tail = e.excerpt[-300:].replace("\n", " | ")
            print(f"- {e.id} ({e.project}) {e.label} -> {got}\n    {tail}")
        return 0
    t0 = time.perf_counter()
    d, h = score(dev, predict_hybrid), score(held, predict_hybrid)
    per_item_ms = (time.perf_counter() - t0) / max(1, len(corpus)) * 1000
    t0 = time.perf_counter()
    dr, hr = score(dev, predict_rules), score(held, predict_rules)
    rules_ms = (time.perf_counter() - t0) / max(1, len(corpus)) * 1000
    spoke = [e for e in held if decided_by_model(e)]
    spoke_right = sum(predict_hybrid(e) == e.label for e in spoke)
    projects = {project_key(e.project) for e in corpus}
    held_projects = {project_key(e.project) for e in held}
    print(
        f"corpus: {len(corpus)} excerpts from {len(projects)} projects; "
        f"held out: {len(held)} excerpts from {len(held_projects)} projects"
    )
    for problem in split_problems(corpus):
        print(f"split problem: {problem}")
    default = "rules+model" if failure_model.ON_BY_DEFAULT else "rules"
    print(f"classify_failure's default: {default} (failure_model.ON_BY_DEFAULT)")
    print("rules + learned fallback (model_fallback=True):")
    print(f"  held-out accuracy: {h.accuracy:.1%} ({h.correct}/{h.n})")
    print(f"  dev accuracy:      {d.accuracy:.1%} ({d.correct}/{d.n}) (fallback trained here)")
    print(f"  the model decided {len(spoke)} held-out excerpts, {spoke_right} of them right")
    print("rules alone (model_fallback=False):")
    print(f"  held-out accuracy: {hr.accuracy:.1%} ({hr.correct}/{hr.n})")
    print(f"  dev accuracy:      {dr.accuracy:.1%} ({dr.correct}/{dr.n})")

    def cell(sc: Score, c: FailureClass) -> str:
        k, n = sc.per_class.get(str(c), (0, 0))
        return f"{k}/{n} {k / n:4.0%}" if n else "-"

    print(f"{'class':22} {'held-out':>14} {'rules alone':>14} {'dev':>14} {'rules alone':>14}")
    for c in CLASSIFIABLE:
        if str(c) in h.per_class or str(c) in d.per_class:
            print(f"{c!s:22} {cell(h, c):>14} {cell(hr, c):>14} {cell(d, c):>14} {cell(dr, c):>14}")
    print("held out, rules + learned fallback:")
    _print_confusion(h)
    nb = NaiveBayes(dev)
    nb_held = score(held, nb)
    print(
        f"for contrast, naive Bayes trained on dev: held-out {nb_held.accuracy:.1%} "
        f"({nb_held.correct}/{nb_held.n}), dev {score(dev, nb).accuracy:.1%}"
    )
    print(
        f"time per excerpt: {per_item_ms:.2f} ms with the fallback, {rules_ms:.2f} ms rules alone"
    )

    def per_class(sc: Score) -> dict[str, float]:
        return {k: round(c / n, 3) for k, (c, n) in sorted(sc.per_class.items())}

    def min_class(sc: Score) -> str | None:
        pc = per_class(sc)
        return min(pc.items(), key=lambda kv: kv[1])[0] if pc else None

    print(
        json.dumps(
            {
                "bench": "classify",
                "default": default,
                "classifier": "rules+model",
                "corpus": len(corpus),
                "projects": len(projects),
                "held_out": h.n,
                "held_out_projects": len(held_projects),
                "held_out_accuracy": round(h.accuracy, 4),
                "held_out_min_class": min_class(h),
                "held_out_per_class": per_class(h),
                "held_out_model_decisions": len(spoke),
                "held_out_model_decisions_right": spoke_right,
                "dev": d.n,
                "dev_accuracy": round(d.accuracy, 4),
                "ms_per_excerpt": round(per_item_ms, 3),
                "rules_held_out_accuracy": round(hr.accuracy, 4),
                "rules_held_out_min_class": min_class(hr),
                "rules_held_out_per_class": per_class(hr),
                "rules_dev_accuracy": round(dr.accuracy, 4),
                "rules_ms_per_excerpt": round(rules_ms, 3),
                "naive_bayes_held_out_accuracy": round(nb_held.accuracy, 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
