"""The checkpoint-interval advisor's inputs from an elastic run (``work.interval_facts``):
a grow is a planned reshape, so it is neither one of the placement's failures (the
MTBF) nor a failure's restart time, and a shrunk phase is exposed to failure on the
nodes that trained (a standby spare that fails is given back: no incident)."""

from __future__ import annotations

import pytest
from elastic_history import END, GROWN_START, SHRINK_STEPS, SHRUNK_END, SHRUNK_START, grown_job
from goodput_history import at

from orchestrator.domain.advisor import PlacementKey
from orchestrator.store.work import interval_facts

KEY = PlacementKey("aws", "us-east-1", "p4d.24xlarge")


def test_a_grow_is_no_failure_of_the_placement_nor_a_failures_restart(session) -> None:
    h = grown_job(session)
    session.commit()
    facts = interval_facts(session, h.id, 3, 100, at(END))
    (exposure,) = [x for x in facts.exposures if x.key == KEY]
    assert exposure.failures == 1  # the node loss; the grow is not counted
    assert facts.restart_seconds == pytest.approx(sum(s for _, s in SHRINK_STEPS))


def test_a_shrunk_phase_is_exposed_on_its_training_nodes_only(session) -> None:
    h = grown_job(session)
    session.commit()
    facts = interval_facts(session, h.id, 3, 100, at(END))
    (exposure,) = [x for x in facts.exposures if x.key == KEY]
    # Attempts 1 and 3 on 3 nodes, attempt 2 on its 2 training nodes (1 rank each).
    spans = [(3, 3620 - 100), (2, SHRUNK_END - SHRUNK_START), (3, END - GROWN_START)]
    assert exposure.gpu_hours == pytest.approx(sum(n * s for n, s in spans) / 3600)
