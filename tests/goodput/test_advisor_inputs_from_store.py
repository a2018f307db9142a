"""The interval advisor's inputs as the service gathers them (``work.interval_facts``):
exposure in GPU-hours and failures per placement, from the attempts and incidents the
reconciler records; replayed on issue 27's history, they give minutes of MTBF."""

from __future__ import annotations

import pytest
from goodput_history import LOST_STEPS, JobHistory, at, reread
from sqlalchemy.orm import Session

from orchestrator.domain.advisor import PlacementKey, advise_from_history, next_checkpoint_every
from orchestrator.store.incidents import fleet_incidents
from orchestrator.store.work import interval_facts

KEY = PlacementKey("local", "local", "netns")


def _issue_history(session: Session) -> JobHistory:
    """Six attempts of 2 nodes x 2 ranks, 195 s each (1.3 GPU-hours in all), each ended
    by an incident; a seventh running, with checkpoints blocking 17 ms."""
    h = JobHistory(session, "minimal")
    t = 0.0
    for n in range(1, 8):
        end = t + 195 if n < 7 else None
        a = h.attempt(n, t, end, cloud="local", region="local", instance_type="netns",
                      step_time=0.0153, last_step=1000)  # fmt: skip
        a.knobs = {"ranks_per_node": 2}
        if end is not None:
            h.incident(end, "node_lost", LOST_STEPS, last_step=1000, attempt=n)
            t = end
    for step in (100, 200, 300):
        h.event(t + step / 10, "checkpoint", None, details={"blocking_s": 0.017})
    session.flush()
    return h


def test_the_store_feeds_the_advisor_exposure_and_failures_per_placement(session) -> None:
    h = _issue_history(session)
    now = at(6 * 195)  # the seventh attempt has just started
    facts = interval_facts(session, h.id, 7, 100, now)
    (exposure,) = [x for x in facts.exposures if x.key == KEY]
    assert exposure.failures == 6
    assert exposure.gpu_hours == pytest.approx(1.3)
    assert facts.saves == [0.017] * 3
    assert max(facts.step_times) == pytest.approx(0.0153)
    assert facts.current_every == 100

    advice, est = advise_from_history(KEY, facts.exposures, 4, 0.017, facts.restart_seconds)
    assert est.observed_failures == 6
    assert advice.mtbf_hours * 60 < 5  # minutes, as the run saw, not 3,000 hours
    new = next_checkpoint_every(100, max(facts.step_times), advice.interval_seconds)
    assert new is not None and 100 < new < 250


def test_a_failure_counts_against_the_placement_the_fleet_page_places_it_on(session) -> None:
    # The incident does not name its attempt: the read model blames the one started
    # last before it (on GCP), and so do the fleet page and the advisor's count.
    h = JobHistory(session)
    h.attempt(1, 0, 1000, cloud="aws", region="us-east-1", instance_type="p4d.24xlarge")
    h.attempt(2, 1000, 2000, cloud="gcp", region="us-central1", instance_type="a2-highgpu-8g")
    h.incident(1500, "node_lost", LOST_STEPS, last_step=None)
    reread(session)

    (placed,) = fleet_incidents(session)
    facts = interval_facts(session, h.id, 2, 100, at(2000))
    failures = {(x.key.cloud, x.key.region): x.failures for x in facts.exposures}
    assert (placed.cloud, placed.region) == ("gcp", "us-central1")
    assert failures == {("aws", "us-east-1"): 0, ("gcp", "us-central1"): 1}
