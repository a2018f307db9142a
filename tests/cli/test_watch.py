"""``skyresume watch``'s frame: the job, each node with its address, heartbeat age,
health and ranks, and the incident's steps as they stand (rendered by Rich)."""

from __future__ import annotations

from rich.console import Console

from orchestrator.commands.operator import render_live

LIVE = {
    "job": {"id": "j-1", "name": "gpt", "status": "RECOVERING", "reason": "node lost"},
    "step": 412,
    "attempt": {
        "number": 2, "state": "launching", "cloud": "aws", "region": "us-east-1",
        "instance_type": "p4d.24xlarge",
    },
    "nodes": [
        {
            "node_id": "n0", "node_rank": 0, "address": "10.0.0.5", "state": "running",
            "heartbeat_age_s": 1.4, "health": {"ok": True, "message": "passed (3 pass)"},
            "ranks": [{"rank": 0, "step": 412, "loss": 2.3456}, {"rank": 1, "step": 411}],
        },
        {
            "node_id": "n1", "node_rank": 1, "address": None, "state": "registered",
            "heartbeat_age_s": None, "health": {"ok": False, "message": "gpu: Xid 79"},
            "ranks": [],
        },
    ],
    "incident": {
        "id": 7, "failure_class": "node_lost", "ongoing": True,
        "steps": [
            {"step": "detect", "started_at": "2026-12-02T01:00:00+00:00",
             "finished_at": "2026-12-02T01:00:01+00:00", "outcome": "ok", "detail": None},
            {"step": "launch", "started_at": "2026-12-02T01:00:05+00:00",
             "finished_at": None, "outcome": None, "detail": "[red]not markup[/red]"},
            {"step": "validate", "started_at": None, "finished_at": None, "outcome": None,
             "detail": None},
        ],
    },
}  # fmt: skip


def frame(data: dict) -> str:  # type: ignore[type-arg]
    console = Console(width=160, record=True, color_system=None)
    console.print(render_live(data))
    return console.export_text()


def test_the_frame_shows_each_node_and_the_incident_as_it_stands():
    text = frame(LIVE)
    assert "gpt (j-1) RECOVERING  step 412  attempt 2 (launching) aws us-east-1" in text
    n0 = next(line for line in text.splitlines() if " n0 " in line)
    assert "10.0.0.5" in n0 and "1 s" in n0 and "passed" in n0 and "r0:412/2.346" in n0
    n1 = next(line for line in text.splitlines() if " n1 " in line)
    assert "never" in n1 and "FAILED: gpu: Xid 79" in n1
    assert "incident #7 node_lost (in progress)" in text
    launch = next(line for line in text.splitlines() if "│ launch " in line)
    assert "01:00:05" in launch and "running" in launch
    assert "[red]not markup[/red]" in launch  # outside text is shown, never interpreted
    assert "not started" in next(line for line in text.splitlines() if "│ validate " in line)


def test_a_job_without_attempt_or_incident_still_renders():
    bare = {**LIVE, "attempt": None, "incident": None, "nodes": [], "step": None}
    text = frame(bare)
    assert "step -" in text and "incident" not in text
