"""``skyresume incidents`` prints each step's evidence under its table (issue 27)."""

from __future__ import annotations

from orchestrator.incident_report import incident_evidence


def test_each_step_s_evidence_is_printed_not_only_in_the_json():
    items = [
        {
            "id": 7,
            "failure_class": "preemption_notice",
            "message": "aws notice terminate",
            "steps": [
                {"step": "detect", "outcome": "ok", "detail": ""},
                {
                    "step": "signal",
                    "outcome": "ok",
                    "detail": "every rank stopped; no save reported (each node's exit report: "
                    "saved_step none)",
                },
                {"step": "confirm_checkpoint", "outcome": None, "detail": "restarting [x]"},
            ],
        }
    ]
    assert incident_evidence(items) == [
        "incident 7 (preemption_notice): aws notice terminate",
        "  signal [ok]: every rank stopped; no save reported (each node's exit report: "
        "saved_step none)",
        "  confirm_checkpoint [running]: restarting [x]",
    ]
