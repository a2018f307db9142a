"""The job state machine: the transition table is the only way a status changes."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from orchestrator.domain.status import (
    ALLOWED,
    TERMINAL,
    IllegalTransition,
    JobStatus,
    can_transition,
    transition,
)


def test_every_status_has_a_row_in_the_table():
    assert set(ALLOWED) == set(JobStatus)


@pytest.mark.parametrize("status", sorted(TERMINAL), ids=str)
def test_terminal_statuses_allow_no_move(status):
    assert status.is_terminal()
    for target in JobStatus:
        with pytest.raises(IllegalTransition):
            transition(status, target)


def test_a_recovery_goes_back_through_provisioning():
    s = JobStatus.PENDING
    for nxt in ["PROVISIONING", "RUNNING", "RECOVERING", "PROVISIONING", "RUNNING", "SUCCEEDED"]:
        s = transition(s, JobStatus(nxt))
    assert s is JobStatus.SUCCEEDED


def test_illegal_move_names_both_statuses_and_the_allowed_ones():
    with pytest.raises(IllegalTransition, match=r"PENDING -> SUCCEEDED; allowed: CANCELLED"):
        transition(JobStatus.PENDING, JobStatus.SUCCEEDED)


class JobLifecycle(RuleBasedStateMachine):
    """Random legal and illegal moves: legal ones apply, illegal ones change nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.status = JobStatus.PENDING
        self.history = [JobStatus.PENDING]

    @rule(to=st.sampled_from(list(JobStatus)))
    def move(self, to: JobStatus) -> None:
        before = self.status
        if can_transition(before, to):
            self.status = transition(before, to)
            self.history.append(to)
        else:
            with pytest.raises(IllegalTransition):
                transition(before, to)
            assert self.status is before

    @invariant()
    def once_terminal_always_terminal(self) -> None:
        firsts = [i for i, s in enumerate(self.history) if s.is_terminal()]
        if firsts:
            assert firsts[0] == len(self.history) - 1

    @invariant()
    def history_only_has_allowed_steps(self) -> None:
        for a, b in zip(self.history, self.history[1:], strict=False):
            assert b in ALLOWED[a]


TestJobLifecycle = JobLifecycle.TestCase
