"""Every rank must resume at the same step from the same manifest, or nobody trains."""

from __future__ import annotations

import pytest

from training.resume import RankResume, ResumeMismatch, check_agreement

D1, D2 = "a" * 64, "b" * 64


def test_agreeing_ranks_resume_at_their_step():
    assert check_agreement([RankResume(r, 100, D1) for r in range(4)]) == 100


def test_fresh_start_everywhere_is_agreement():
    assert check_agreement([RankResume(r, None, None) for r in range(2)]) is None


def test_one_tampered_rank_is_named_with_its_step():
    views = [RankResume(r, 100, D1) for r in range(4)]
    views[2] = RankResume(2, 90, D2)
    with pytest.raises(ResumeMismatch) as info:
        check_agreement(views)
    msg = str(info.value)
    assert "ranks 0-1,3 at step 100" in msg and "ranks 2 at step 90" in msg


def test_same_step_different_manifest_is_a_mismatch():
    with pytest.raises(ResumeMismatch, match=r"manifest aaaaaaaaaaaa.*manifest bbbbbbbbbbbb"):
        check_agreement([RankResume(0, 100, D1), RankResume(1, 100, D2)])


def test_a_rank_that_found_nothing_is_a_mismatch():
    with pytest.raises(ResumeMismatch, match=r"ranks 1 at step none \(fresh start\)"):
        check_agreement([RankResume(0, 100, D1), RankResume(1, None, None)])


def test_step_other_than_the_staged_one_is_refused():
    with pytest.raises(ResumeMismatch, match="orchestrator staged step 120"):
        check_agreement([RankResume(0, 100, D1)], expected_step=120)


def test_a_fresh_start_is_what_an_expected_step_of_zero_means():
    """A rollback with no checkpoint old enough relaunches from scratch: RESUME_FROM
    none, expected step 0; the ranks load nothing, and that agrees."""
    check_agreement([RankResume(0, None, None), RankResume(1, None, None)], expected_step=0)
    with pytest.raises(ResumeMismatch, match="orchestrator staged step 10"):
        check_agreement([RankResume(0, None, None)], expected_step=10)
