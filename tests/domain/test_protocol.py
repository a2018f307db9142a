"""Restart protocol bookkeeping: a restarted service resumes at the right step."""

from __future__ import annotations

from orchestrator.domain.protocol import ORDER, ProtocolStep, StepOutcome, next_step

S, Out = ProtocolStep, StepOutcome


def test_protocol_has_seven_steps_in_order():
    assert [s.value for s in ORDER] == [
        "detect",
        "signal",
        "confirm_checkpoint",
        "select_replacement",
        "launch",  # a request, polled until the nodes are up
        "stage",  # each node stages the checkpoint itself, before torchrun starts
        "validate",
    ]


def test_fresh_incident_starts_at_detect():
    assert next_step({}) is S.DETECT


def test_resumes_at_a_step_that_started_but_never_finished():
    done = {S.DETECT: Out.OK, S.SIGNAL: Out.SKIPPED, S.CONFIRM_CHECKPOINT: None}
    assert next_step(done) is S.CONFIRM_CHECKPOINT


def test_failed_step_is_offered_again():
    done = {S.DETECT: Out.OK, S.SIGNAL: Out.OK, S.CONFIRM_CHECKPOINT: Out.FAILED}
    assert next_step(done) is S.CONFIRM_CHECKPOINT


def test_all_ok_means_done():
    assert next_step(dict.fromkeys(ORDER, Out.OK)) is None
