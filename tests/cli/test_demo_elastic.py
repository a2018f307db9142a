"""``skyresume demo --elastic``'s checks, on hand-built records of the REST API: the
demo passes only when the records show the shrink, the standby and the grow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.demo_elastic import Phase, elastic_problems, phases

KILLED = "j-1-a1-n2"


def node(node_id: str, *steps: int) -> dict[str, Any]:
    """A node of an attempt; no steps: a standby node (registered, no ranks)."""
    return {"node_id": node_id, "ranks": [{"rank": 0, "step": s} for s in steps]}


def attempt(
    number: int, verb: str, nodes: list[dict[str, Any]], validated: int | None
) -> dict[str, Any]:
    return {"number": number, "launch_verb": verb, "nodes": nodes,
            "validated_step": validated, "resume_step": validated}  # fmt: skip


def incident(failure_class: str, *, select: str, steps_lost: int, node_id: str | None = None,
             validated: str = "ok") -> dict[str, Any]:  # fmt: skip
    return {
        "id": 1, "failure_class": failure_class, "node_id": node_id, "steps_lost": steps_lost,
        "steps": [{"step": "select_replacement", "detail": select, "outcome": "ok"},
                  {"step": "validate", "detail": "", "outcome": validated}],
    }  # fmt: skip


def run(**over: Any) -> dict[str, Any]:
    """The records of a run that shrank to 2 nodes and grew back to 3."""
    rec = {
        "job": {"status": "SUCCEEDED", "status_reason": "training finished"},
        "incidents": [
            incident("node_lost", select="shrink: the 2 healthy nodes train at once",
                     steps_lost=8, node_id=KILLED),
            incident("elastic_grow", select="grow_back: restart in place as one group of 3",
                     steps_lost=0),
        ],
        "attempts": [
            attempt(1, "launch", [node("a1-n0", 28), node("a1-n1", 28), node(KILLED, 25)], 0),
            attempt(2, "shrink", [node("a2-n0", 86), node("a2-n1", 86), node("a2-n2")], 20),
            attempt(3, "join_survivors",
                    [node("a3-n0", 200), node("a3-n1", 200), node("a3-n2", 200)], 86),
        ],
        "events": [{"kind": "node_lost"}, {"kind": "grow"}],
        "killed_node": KILLED,
    }  # fmt: skip
    rec.update(over)
    return rec


def test_a_run_that_shrank_and_grew_back_passes() -> None:
    assert elastic_problems(**run()) == []


def test_phases_count_the_spare_as_standby_and_start_at_the_resumed_step() -> None:
    assert phases(run()["attempts"]) == [
        Phase(1, "launch", 3, 0, 0, 28),
        Phase(2, "shrink", 2, 1, 20, 86),
        Phase(3, "join_survivors", 3, 0, 86, 200),
    ]


def test_an_attempt_that_never_reported_a_step_is_no_phase() -> None:
    never = attempt(2, "shrink", [node("a2-n0"), node("a2-n1")], None)
    assert [p.attempt for p in phases([run()["attempts"][0], never])] == [1]


WAITED = run(
    incidents=[incident("node_lost", select="wait: replacement expected in 25 s",
                        steps_lost=8, node_id=KILLED)],
    attempts=[run()["attempts"][0],
              attempt(2, "join_survivors", [node("a2-n0", 200), node("a2-n1", 200),
                                            node("a2-n2", 200)], 20)],
    events=[{"kind": "node_lost"}],
)  # fmt: skip


@pytest.mark.parametrize(
    ("records", "said"),
    [
        pytest.param(WAITED, "did not shrink", id="waited-for-a-full-set"),
        pytest.param(WAITED, "no grow was recorded", id="no-standby-came"),
        pytest.param(WAITED, "expected attempts of 3 nodes", id="never-trained-on-2"),
        pytest.param(
            run(incidents=[run()["incidents"][0],
                           incident("elastic_grow", select="grow_back", steps_lost=3)]),
            "the grow lost 3 steps", id="grow-lost-steps",
        ),
        pytest.param(
            run(incidents=[run()["incidents"][0],
                           incident("elastic_grow", select="grow_back", steps_lost=0,
                                    validated="failed")]),
            "did not validate", id="grow-not-validated",
        ),
        pytest.param(run(killed_node="j-1-a1-n0"), "not the killed", id="another-node-lost"),
        pytest.param(run(job={"status": "FAILED", "status_reason": "x"}), "job ended FAILED",
                     id="job-failed"),
    ],
)  # fmt: skip
def test_records_without_the_shrink_and_the_grow_fail_the_demo(
    records: dict[str, Any], said: str
) -> None:
    problems = elastic_problems(**records)
    assert any(said in p for p in problems), problems


def test_elastic_on_the_skypilot_launcher_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "demo", "--elastic", "--launcher", "skypilot",
         "--home", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--elastic runs on the local launcher" in out.stderr
    assert not (tmp_path / "demo").exists()
