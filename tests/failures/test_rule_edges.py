"""Every rule of the classifier matches whole words only (issue 23).

A hardware rule that matched ``AER`` inside ``cudaError`` called a user's CUDA error
``gpu_hardware`` at 0.97, which drains a healthy host. Each rule is tried here inside
longer words: a shortest text the rule matches is built from the pattern itself
(:func:`example`), then glued to letters and digits on each side whose edge is a
letter or digit, and the rule must no longer match.
"""

from __future__ import annotations

import re
from re import _constants as sre_c  # type: ignore[attr-defined]  # 3.11+: the re parser
from re import _parser as sre_p  # type: ignore[attr-defined]
from typing import Any

import pytest

from orchestrator.domain import failures as fm
from orchestrator.domain.failures import FailureClass, classify_failure

F = FailureClass

_CATEGORY_CHAR = {
    sre_c.CATEGORY_DIGIT: "7",
    sre_c.CATEGORY_WORD: "w",
    sre_c.CATEGORY_SPACE: " ",
    sre_c.CATEGORY_NOT_DIGIT: "x",
    sre_c.CATEGORY_NOT_WORD: " ",
    sre_c.CATEGORY_NOT_SPACE: "x",
}


def _in_char(items: list[tuple[Any, Any]]) -> str:
    """A character the class ``[...]`` accepts."""
    if items and items[0][0] is sre_c.NEGATE:
        banned = re.compile("[" + "".join(_in_source(items[1:])) + "]")
        return next(c for c in " x7#-" if not banned.match(c))
    op, av = items[0]
    if op is sre_c.LITERAL:
        return chr(av)
    if op is sre_c.RANGE:
        return chr(av[0])
    if op is sre_c.CATEGORY:
        return _CATEGORY_CHAR[av]
    raise AssertionError(f"unhandled class item {op}")


def _in_source(items: list[tuple[Any, Any]]) -> list[str]:
    out = []
    for op, av in items:
        if op is sre_c.LITERAL:
            out.append(re.escape(chr(av)))
        elif op is sre_c.RANGE:
            out.append(f"{re.escape(chr(av[0]))}-{re.escape(chr(av[1]))}")
        elif op is sre_c.CATEGORY:
            out.append({sre_c.CATEGORY_DIGIT: r"\d", sre_c.CATEGORY_WORD: r"\w",
                        sre_c.CATEGORY_SPACE: r"\s"}.get(av, ""))  # fmt: skip
    return out


def _gen(parsed: Any, least: int, branch: int) -> str:
    out: list[str] = []
    for op, av in parsed:
        if op is sre_c.LITERAL:
            out.append(chr(av))
        elif op is sre_c.NOT_LITERAL:
            out.append("x" if chr(av) != "x" else "y")
        elif op is sre_c.ANY:
            out.append(" ")
        elif op is sre_c.IN:
            out.append(_in_char(av))
        elif op is sre_c.BRANCH:
            options = av[1]
            out.append(_gen(options[min(branch, len(options) - 1)], least, branch))
        elif op is sre_c.SUBPATTERN:
            out.append(_gen(av[-1], least, branch))
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            n = max(lo, min(least, hi))
            out.append(_gen(sub, least, branch) * n)
        elif op in (sre_c.AT, sre_c.ASSERT, sre_c.ASSERT_NOT):
            continue  # zero-width
        else:
            raise AssertionError(f"unhandled regex op {op}")
    return "".join(out)


def example(rule: Any) -> str:
    """A short text the rule matches, built from its pattern (first branches, fewest
    repeats; one repeat, and other branches, where that does not match)."""
    parsed = sre_p.parse(rule.text, re.IGNORECASE)
    for least in (0, 1, 2):
        for branch in range(4):
            text = _gen(parsed, least, branch)
            if rule.pattern.search(text):
                return text
    raise AssertionError(f"no example found for {rule.text!r}")


#: Rules that accept a longer word on purpose: their pattern ends in ``\w*``/``\w+``
#: (or starts with one) because the word they name takes endings ("GPU0000:03:00.0",
#: "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "checkpoints", "miscompared").
def _open_ended(text: str) -> tuple[bool, bool]:
    starts = re.match(r"^\(?(\\w[*+]|\[\w*\\w\])", text) is not None
    ends = re.search(r"\\w[*+]\)?\??(\$)?$", text) is not None
    return starts, ends


RULES = [r for r in fm._RULES]


@pytest.mark.parametrize("rule", RULES, ids=[f"{i}:{r.text[:40]}" for i, r in enumerate(RULES)])
def test_no_rule_matches_inside_a_longer_word(rule: Any) -> None:
    text = example(rule)
    anchored = rule.text.startswith("^") or rule.text.endswith("$")
    spaced = text if anchored else f" {text} "
    assert rule.pattern.search(spaced), f"{rule.text!r} must match {spaced!r}"
    open_start, open_end = _open_ended(rule.text)
    if text[:1].isalnum() and not open_start:
        glued = "q7" + text
        assert not rule.pattern.search(glued), f"{rule.text!r} matched inside {glued!r}"
    if text[-1:].isalnum() and not open_end:
        glued = text + "7q"
        assert not rule.pattern.search(glued), f"{rule.text!r} matched inside {glued!r}"
    if text[:1].isalnum() and text[-1:].isalnum() and not (open_start or open_end):
        glued = "cuda" + text + "Error"
        assert not rule.pattern.search(glued), f"{rule.text!r} matched inside {glued!r}"


def test_most_rules_have_a_word_at_an_edge_to_try() -> None:
    """The test above is not vacuous: most rules start or end with a letter or digit."""
    tried = sum(1 for r in RULES if example(r)[:1].isalnum() or example(r)[-1:].isalnum())
    assert tried >= 0.9 * len(RULES)


def test_aer_inside_cuda_error_is_not_gpu_hardware() -> None:
    # The held-out miss of issue 23: "AER" inside "cudaError...Timeout" read as a PCIe
    # Advanced Error Reporting line.
    log = (
        "RuntimeError: CUDA error: the launch timed out and was terminated\n"
        "CUDA kernel errors might be asynchronously reported at some other API call\n"
        "cudaErrorLaunchTimeout: the launch timed out and was terminated"
    )
    c = classify_failure(1, None, log)
    assert c.failure_class is not F.GPU_HARDWARE
    # A real AER line still is hardware.
    aer = "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0"
    assert classify_failure(None, None, aer).failure_class is F.GPU_HARDWARE


def test_snake_case_parts_are_words() -> None:
    c = classify_failure(None, None, "error: CUDA_ERROR_ECC_UNCORRECTABLE on device 3")
    assert c.failure_class is F.GPU_HARDWARE
    assert not re.search(fm.WORD_EDGE + "ECC" + fm.WORD_EDGE, "cudaErrorECCUncorrectable")
