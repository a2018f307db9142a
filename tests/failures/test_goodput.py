from __future__ import annotations

import pytest

from orchestrator.domain.failures import FailureClass
from orchestrator.domain.goodput import (
    Incident,
    JobRun,
    ProtocolStep,
    StepTiming,
    account_goodput,
)

P = ProtocolStep


def _incident(start: float, *, lost: int = 0, cls: FailureClass = FailureClass.NODE_LOST):
    # detect 5 s, signal+confirm 20 s, select 10 s, stage 60 s, launch 120 s, validate 5 s
    t = start
    steps = []
    for step, d in [
        (P.DETECT, 5),
        (P.SIGNAL, 10),
        (P.CONFIRM_CHECKPOINT, 10),
        (P.SELECT_REPLACEMENT, 10),
        (P.STAGE, 60),
        (P.LAUNCH, 120),
        (P.VALIDATE, 5),
    ]:
        steps.append(StepTiming(step, t, t + d))
        t += d
    return Incident(cls, tuple(steps), lost)


def test_run_without_incidents_is_all_productive() -> None:
    r = account_goodput(JobRun(0, 3600, 8, 1.0, 2.0))
    assert r.effective_fraction == 1.0
    assert r.lost_dollars == 0
    assert r.total_dollars == pytest.approx(16.0)


def test_incident_splits_into_mttr_steps_lost_work_and_dollars() -> None:
    run = JobRun(0, 36_000, 16, 2.0, 3.0, (_incident(1000, lost=30),), 100.0)
    r = account_goodput(run)
    inc = r.incidents[0]
    assert inc.mttr_seconds == 220
    assert inc.step_seconds[P.STAGE] == 60
    assert inc.lost_work_seconds == 60  # 30 steps x 2 s
    assert inc.dollars == pytest.approx((220 + 60) * 16 * 3.0 / 3600)
    assert r.productive_seconds == 36_000 - 220 - 60 - 100
    assert r.lost_dollars == pytest.approx(inc.dollars)


def test_overlapping_incidents_do_not_count_time_twice() -> None:
    run = JobRun(0, 10_000, 8, 1.0, 1.0, (_incident(1000), _incident(1100)))
    assert account_goodput(run).failure_seconds == 320


def test_more_lost_steps_never_raise_goodput() -> None:
    a = account_goodput(JobRun(0, 10_000, 8, 1.0, 1.0, (_incident(100, lost=10),)))
    b = account_goodput(JobRun(0, 10_000, 8, 1.0, 1.0, (_incident(100, lost=500),)))
    assert b.effective_fraction < a.effective_fraction


def test_impossible_accounting_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="exceed"):
        account_goodput(JobRun(0, 300, 8, 10.0, 1.0, (_incident(0, lost=100),)))
    with pytest.raises(ValueError, match="ends"):
        StepTiming(P.DETECT, 10, 5)
    with pytest.raises(ValueError, match="outside"):
        JobRun(0, 100, 8, 1.0, 1.0, (_incident(50),))
