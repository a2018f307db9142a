from __future__ import annotations

import pytest

from orchestrator.domain.failures import FailureClass
from orchestrator.domain.policy import (
    POLICY,
    PastFailure,
    RecoveryAction,
    decide_recovery,
)

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
    ],
    ids=lambda v: str(v),
)
def test_issue_table_is_what_decide_returns(cls: FailureClass, action: RecoveryAction) -> None:
    assert decide_recovery(cls, "", []).action is action


def test_first_user_code_error_gets_one_retry() -> None:
    d = decide_recovery(F.USER_CODE_ERROR, "KeyError: 'input_ids'", [])
    assert d.action is A.RESTART_THEN_FAIL_FAST


def test_same_user_code_error_twice_fails_fast() -> None:
    hist = [PastFailure(F.USER_CODE_ERROR, "KeyError: 'input_ids'")]
    d = decide_recovery(F.USER_CODE_ERROR, "KeyError: 'input_ids'", hist)
    assert d.action is A.FAIL_FAST
    assert "KeyError" in d.reason


def test_a_different_user_code_error_is_not_the_same_twice() -> None:
    hist = [PastFailure(F.USER_CODE_ERROR, "KeyError: 'input_ids'")]
    d = decide_recovery(F.USER_CODE_ERROR, "ValueError: bad shape", hist)
    assert d.action is A.RESTART_THEN_FAIL_FAST


def test_other_failures_between_do_not_hide_the_repeat() -> None:
    hist = [
        PastFailure(F.USER_CODE_ERROR, "E"),
        PastFailure(F.PREEMPTION_NOTICE),
        PastFailure(F.NCCL_TIMEOUT),
    ]
    assert decide_recovery(F.USER_CODE_ERROR, "E", hist).action is A.FAIL_FAST


def test_repeated_preemptions_never_fail_fast() -> None:
    hist = [PastFailure(F.PREEMPTION_NOTICE)] * 20
    assert decide_recovery(F.PREEMPTION_NOTICE, "", hist).action is A.REPLACE_NODE_BLOCK_REGION
