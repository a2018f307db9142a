"""The remedy table (``policy.POLICY``) and the history rules that can end a job
instead (``remedy.refuse_to_continue``), as ``decide()`` uses them."""

from __future__ import annotations

import pytest

from orchestrator.domain.failures import FailureClass
from orchestrator.domain.policy import POLICY, RecoveryAction
from orchestrator.domain.remedy import PastIncident, refuse_to_continue, remedy_for

F = FailureClass
A = RecoveryAction


def test_every_failure_class_has_a_policy() -> None:
    assert set(POLICY) == set(FailureClass)


@pytest.mark.parametrize(
    ("cls", "action"),
    [
        (F.PREEMPTION_NOTICE, A.REPLACE_NODE_BLOCK_REGION),
        (F.NODE_LOST, A.REPLACE_NODE_BLOCK_REGION),
        (F.NCCL_TRANSPORT, A.RESTART_IN_PLACE),
        (F.NAN_DIVERGENCE, A.ROLLBACK_LAST_GOOD),
        (F.SILENT_CORRUPTION, A.ROLLBACK_LAST_GOOD),
        (F.CUDA_OOM, A.REPLAN_MEMORY),
        (F.GPU_HARDWARE, A.DRAIN_NODE),
        (F.HEALTH_CHECK_FAILED, A.DRAIN_NODE),
        (F.CAPACITY_UNAVAILABLE, A.WAIT_RETRY_ELSEWHERE),
        (F.USER_CODE_ERROR, A.RESTART_THEN_FAIL_FAST),
    ],
    ids=lambda v: str(v),
)
def test_issue_table_is_what_decide_applies(cls: FailureClass, action: RecoveryAction) -> None:
    assert remedy_for(cls) is action


def refused(cls: FailureClass, signature: str | None, past: list[PastIncident]) -> str | None:
    """``refuse_to_continue`` with the spec's defaults (2 identical user errors)."""
    return refuse_to_continue(
        cls, signature, None, past, restarts_done=0, max_restarts=100,
        max_same_user_error=2, max_same_anomaly=3, on_anomaly="rollback",
    )  # fmt: skip


def test_the_first_user_code_error_gets_its_retry() -> None:
    assert refused(F.USER_CODE_ERROR, "KeyError: 'input_ids'", []) is None


def test_the_same_user_code_error_twice_fails_naming_it() -> None:
    past = [PastIncident(F.USER_CODE_ERROR, signature="KeyError: 'input_ids'")]
    reason = refused(F.USER_CODE_ERROR, "KeyError: 'input_ids'", past)
    assert reason == "the same user code error 2 times: KeyError: 'input_ids'"


def test_a_different_user_code_error_is_not_the_same_twice() -> None:
    past = [PastIncident(F.USER_CODE_ERROR, signature="KeyError: 'input_ids'")]
    assert refused(F.USER_CODE_ERROR, "ValueError: bad shape", past) is None


def test_other_failures_between_do_not_hide_the_repeat() -> None:
    past = [
        PastIncident(F.USER_CODE_ERROR, signature="E"),
        PastIncident(F.PREEMPTION_NOTICE),
        PastIncident(F.NCCL_TIMEOUT),
    ]
    assert refused(F.USER_CODE_ERROR, "E", past) == "the same user code error 2 times: E"


def test_repeated_preemptions_never_fail_fast() -> None:
    assert refused(F.PREEMPTION_NOTICE, None, [PastIncident(F.PREEMPTION_NOTICE)] * 20) is None
