"""Goodput of an elastic run (issue 20), gathered from SQLite and PostgreSQL: each
phase's training nodes, wall and training time, throughput and node-hours, the spare
billed apart, the time spent shrunk, and the grow as a planned reshape.

The histories are in elastic_history.py; each figure below is derived from them."""

from __future__ import annotations

import pytest
from elastic_history import (
    END,
    GROW_AT,
    GROW_STEPS,
    GROWN_START,
    PRICE,
    SHRINK_STEPS,
    SHRUNK_END,
    SHRUNK_START,
    SPARE_ASKED_AGAIN_AT,
    SPARE_LOST_AT,
    grown_job,
    spare_asked_again_job,
    spare_lost_job,
    spare_refused_job,
)
from goodput_history import reread, steps_end, two_incident_job
from sqlalchemy.orm import Session

from orchestrator.store.goodput import job_goodput

#: Attempt 2 trains from the end of the node loss's protocol (3,666 s) ...
SHRUNK_TRAINS_FROM = steps_end(3600, SHRINK_STEPS)
#: ... to the grow's detection (5,000 s), though it ends only after the save (5,030 s).
SHRUNK_TRAINING_S = GROW_AT - SHRUNK_TRAINS_FROM  # 1,334 s
SHRUNK_WALL_S = SHRUNK_END - SHRUNK_START  # 1,393.5 s


def _report(session: Session, build):  # type: ignore[no-untyped-def]
    h = build(session)
    reread(session)
    return job_goodput(session, h.id)


def test_each_phase_says_the_nodes_it_trained_on_and_keeps_the_size_it_was_placed_for(session):
    r = _report(session, grown_job)
    shape = [(a.num_nodes, a.training_nodes, a.shrunk, a.spare_nodes) for a in r.attempts]
    assert shape == [(3, 3, False, 0), (3, 2, True, 1), (3, 3, False, 0)]


def test_a_shrunk_phases_node_hours_count_its_training_nodes_and_its_spare_apart(session):
    r = _report(session, grown_job)
    shrunk = r.attempts[1]
    assert shrunk.wall_seconds == pytest.approx(SHRUNK_WALL_S)
    assert shrunk.node_hours == pytest.approx(2 * SHRUNK_WALL_S / 3600)
    # The spare bills from the launch request (it boots meanwhile) until the grow
    # ended the attempt: from then on it is a training node of attempt 3.
    assert shrunk.spare_node_hours == pytest.approx(1 * SHRUNK_WALL_S / 3600)
    assert shrunk.usd == pytest.approx((2 + 1) * SHRUNK_WALL_S / 3600 * PRICE)
    assert r.spare_node_hours == pytest.approx(shrunk.spare_node_hours)
    assert r.node_hours == pytest.approx(sum(a.node_hours for a in r.attempts))


def test_a_spare_given_back_bills_only_until_it_was_released(session):
    r = _report(session, spare_lost_job)
    shrunk = r.attempts[1]
    assert shrunk.spare_released is not None and shrunk.spare_released.endswith("is gone")
    assert shrunk.spare_node_hours == pytest.approx((SPARE_LOST_AT - SHRUNK_START) / 3600)
    held = shrunk.node_hours + shrunk.spare_node_hours
    assert shrunk.usd == pytest.approx(held * PRICE)


def test_a_standby_launch_the_launcher_refused_bills_nothing(session):
    r = _report(session, spare_refused_job)
    shrunk = r.attempts[1]
    assert shrunk.shrunk and shrunk.spare_nodes == 1
    assert shrunk.spare_node_hours == 0.0 and r.spare_node_hours == 0.0
    assert shrunk.usd == pytest.approx(shrunk.node_hours * PRICE)


def test_a_spare_asked_for_again_bills_the_earlier_try_until_its_release_and_this_one_since(
    session,
):
    r = _report(session, spare_asked_again_job)
    shrunk = r.attempts[1]
    assert shrunk.shrunk and shrunk.spare_nodes == 1 and shrunk.training_nodes == 2
    first = SPARE_LOST_AT - SHRUNK_START
    second = END - SPARE_ASKED_AGAIN_AT
    assert shrunk.spare_node_hours == pytest.approx((first + second) / 3600)
    assert shrunk.usd == pytest.approx((shrunk.node_hours + shrunk.spare_node_hours) * PRICE)


def test_time_spent_shrunk_is_the_training_time_of_the_phases_on_fewer_nodes(session):
    grown = _report(session, grown_job)
    assert grown.attempts[1].training_seconds == pytest.approx(SHRUNK_TRAINING_S)
    assert grown.shrunk_seconds == pytest.approx(SHRUNK_TRAINING_S)
    # Never grown back: shrunk from the end of the node loss's protocol to the end.
    lost = _report(session, spare_lost_job)
    assert lost.shrunk_seconds == pytest.approx(9000 - SHRUNK_TRAINS_FROM)


def test_each_phases_throughput_comes_from_the_series_else_from_its_step_time(session):
    r = _report(session, grown_job)
    rates = [(a.steps_per_second, a.throughput_source) for a in r.attempts]
    assert rates[0] == (pytest.approx(0.5), "progress_samples")  # 3 nodes
    assert rates[1] == (pytest.approx(1 / 3), "progress_samples")  # 2 nodes
    assert rates[2] == (pytest.approx(1 / 1.9), "step_time")  # no samples: heartbeats


def test_a_grow_is_a_planned_reshape_whose_pause_is_restart_protocol_time(session):
    r = _report(session, grown_job)
    lost, grow = r.incidents
    assert (lost.failure_class, lost.planned) == ("node_lost", False)
    assert (grow.failure_class, grow.planned) == ("elastic_grow", True)
    grow_s = sum(s for _, s in GROW_STEPS)
    assert grow.mttr_seconds == pytest.approx(grow_s)
    assert r.reshape_seconds == pytest.approx(grow_s)
    assert r.failure_seconds == pytest.approx(sum(s for _, s in SHRINK_STEPS) + grow_s)
    # While it ran the group and its spare were both held: 3 nodes' price.
    assert grow.usd == pytest.approx(grow_s * 3 * PRICE / 3600)
    assert grow.steps_lost == 0  # saved at the step boundary
    assert (grow.failed_attempt, grow.recovered_by) == (2, 3)
    assert r.attempts[2].started_at.timestamp() == pytest.approx(
        r.started_at.timestamp() + GROWN_START
    )


def test_a_job_that_never_shrank_has_no_shrunk_time_and_bills_every_node(session):
    r = _report(session, two_incident_job)
    assert r.shrunk_seconds == 0.0 and r.reshape_seconds == 0.0 and r.spare_node_hours == 0.0
    assert all(a.training_nodes == a.num_nodes and not a.shrunk for a in r.attempts)
    assert not any(i.planned for i in r.incidents)
    for a in r.attempts:
        assert a.node_hours == pytest.approx(a.num_nodes * a.wall_seconds / 3600)
        assert a.usd == pytest.approx(a.node_hours * a.price_per_node_hour)
