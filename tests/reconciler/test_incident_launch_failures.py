"""An incident carries the launches its recovery was refused, with the refusal's own
text: a refused refill's reason was recorded (a launch_failed event) and read by no
one, so why a refill was refused could not be told from the incident (issue 19: the
refill after a termination without notice was refused, and the run could not say why)."""

from __future__ import annotations

from test_launch_verbs import refills  # noqa: F401 - the fixture
from test_protocol_store import preempt_node_1_after_a_save_at_40

from orchestrator.store.incidents import incidents


def test_a_refused_refill_s_reason_is_in_the_incident_it_recovered(refills) -> None:  # noqa: F811
    w = refills
    w.launcher.refuse = True
    preempt_node_1_after_a_save_at_40(w)
    w.run_until_launched(2)
    w.recovered(2, 40)
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
    (failure,) = inc["launch_failures"]
    assert failure["verb"] == "refill" and failure["capacity"] is False
    assert f"{w.job}-a1 is UP, not INIT with fewer nodes" in failure["message"]
    assert failure["region"] == w.launcher.launched[-1].placement.region
