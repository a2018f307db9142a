"""Relative silence and disruption mode (``domain.silence``), decided by ``decide()``
on hand-built snapshots at a fixed NOW."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from orchestrator.contract import EventKind
from orchestrator.domain import reconcile as rc
from orchestrator.domain import silence as sl
from orchestrator.domain.failures import FailureClass as F
from orchestrator.domain.plan import Placement
from orchestrator.domain.spec import validate_job_spec
from orchestrator.domain.status import JobStatus as S

NOW = datetime(2026, 12, 2, 1, 0, 0, tzinfo=UTC)
TIMEOUT = 30.0
R1 = Placement("fake", "r1", "cpu", None, 0, 2, True, price_per_node_hour=0.5)


def ago(s: float) -> datetime:
    return NOW - timedelta(seconds=s)


def spec(num_nodes: int):
    return validate_job_spec(
        {
            "name": "j",
            "task": {"template": "local", "command": "python train.py"},
            "num_nodes": num_nodes,
            "ranks_per_node": 1,
            "checkpoint": {"uri": "file:///ckpt"},
            "restarts": {"heartbeat_timeout_s": TIMEOUT, "grace_period_s": 60.0},
        }
    )


def node(k: int, hb: float, **kw) -> rc.NodeView:
    ranks = (rc.RankView(rank=k, step=50, resumed_step=0, report_age_s=0.2),)
    return rc.NodeView(
        node_id=f"j-a1-n{k}",
        node_rank=k,
        last_heartbeat_at=ago(hb),
        alive=kw.pop("alive", None),
        ranks=ranks,
        **kw,
    )


def snap(silent_s: list[float], intake: tuple[sl.IntakeSample, ...] = (), **kw) -> rc.JobSnapshot:
    """A running, validated job whose node k was last heard ``silent_s[k]`` ago."""
    nodes = tuple(node(k, hb, alive=kw.pop(f"alive{k}", None)) for k, hb in enumerate(silent_s))
    a = rc.AttemptView(
        number=1,
        state="running",
        started_at=ago(600),
        num_nodes=len(nodes),
        ranks_per_node=1,
        validated_step=0,
        nodes=nodes,
        placement=R1,
        requested_at=ago(600),
        up_at=ago(600),
    )
    return rc.JobSnapshot(
        job_id="j",
        status=S.RUNNING,
        now=NOW,
        spec=spec(len(nodes)),
        attempt=a,
        intake=intake,
        **kw,
    )


def samples(*spans: tuple[float, ...], every: float = 1.0, fleet: int = 2048):
    """Intake samples from (from_s_ago, to_s_ago, share heard[, share fresh]) spans, one
    per ``every``; the fresh share is the fleet's nodes heard since the sample before."""
    out = []
    for start, end, share, *fresh in spans:
        t = start
        while t > end - 1e-9:
            new = round(fresh[0] * fleet) if fresh else 0
            out.append(sl.IntakeSample(ago(t), round(share * fleet), fleet, new))
            t -= every
    return tuple(out)


def lost(actions: list[rc.Action]) -> list[str | None]:
    return [
        x.node_id
        for x in actions
        if isinstance(x, rc.RecordFailure) and x.kind == EventKind.NODE_LOST
    ]


def notes(actions: list[rc.Action]) -> list[rc.RecordNote]:
    return [
        x
        for x in actions
        if isinstance(x, rc.RecordNote) and x.kind == EventKind.CONTROL_PLANE_DEGRADED
    ]


HEALTHY = samples((120, 0, 0.999))


def test_a_node_silent_while_its_peers_and_the_fleet_are_heard_is_lost_at_the_timeout():
    out = rc.decide(snap([1, 1, 31, 1], HEALTHY))
    assert lost(out) == ["j-a1-n2"]
    assert rc.decide(snap([1, 1, 29, 1], HEALTHY)) == []


def test_silence_while_the_service_heard_little_of_the_fleet_is_not_held_against_nodes():
    # The service heard a fifth of the fleet for the last 40 s (it was late, starved):
    # every node of this job is past the timeout by the clock, none is lost.
    overload = samples((120, 41, 0.999), (40, 0, 0.2))
    out = rc.decide(snap([45, 50, 44, 41], overload))
    assert lost(out) == []
    (note,) = notes(out)
    assert "heard too little of the fleet" in note.message and note.attempt == 1


def test_a_node_killed_during_an_overload_is_still_found_once_intake_recovers():
    # Deaf from 60 s to 20 s ago; n2 was killed 70 s ago: 70 - 40 deaf = 30 s of heard
    # silence is not yet past the timeout; 75 s ago, 35 s is.
    intake = samples((120, 61, 0.999), (60, 21, 0.1), (20, 0, 0.999))
    assert lost(rc.decide(snap([1, 1, 70, 1], intake))) == []
    assert lost(rc.decide(snap([1, 1, 75, 1], intake))) == ["j-a1-n2"]


# Starved, but hearing: the service hears 30 % of the fleet within the window (deaf),
# yet takes in 2 % of the fleet's nodes each second, so each node is heard about
# every 50 s: 3 beats per node (a timeout's worth) take 150 s.
STARVED = samples((300, 0, 0.3, 0.02))


def test_one_dead_node_amid_a_starved_but_hearing_fleet_is_found():
    # Its job's peers and the fleet kept arriving; after 100 s the fleet had 2 beats
    # per node in (a healthy node may not have been heard yet), after 160 s 3.2.
    assert lost(rc.decide(snap([1, 20, 100, 5], STARVED))) == []
    assert lost(rc.decide(snap([1, 20, 160, 5], STARVED))) == ["j-a1-n2"]


def test_in_a_starved_fleet_nodes_heard_in_turn_are_never_lost():
    # Every node of the job past the 30 s timeout by the clock, none past a turn of
    # the fleet's intake (150 s): none is lost.
    out = rc.decide(snap([31, 60, 100, 140], STARVED))
    assert lost(out) == []
    assert "heard too little of the fleet" in notes(out)[0].message


def test_a_node_whose_job_went_quiet_with_it_is_not_found_by_the_fleets_intake_alone():
    # n2 is past a turn of the fleet, but only one of its three peers was heard after
    # it: the job, not the node, went quiet (a disruption, waited out as one).
    out = rc.decide(snap([170, 165, 160, 1], STARVED))
    assert lost(out) == []
    assert notes(out)[0].message.startswith("3 of 4 nodes silent")


def test_late_reconciler_ticks_that_still_count_beats_are_no_stall_for_a_dead_node():
    # A starved reconciler ticks every 12 s (past stall_gap_s), and each of its samples
    # finds every live node heard since the one before: the service was hearing.
    slow = samples((120, 0, 1.0, 1.0), every=12.0)
    assert lost(rc.decide(snap([1, 1, 45, 1], slow))) == ["j-a1-n2"]
    stopped = samples((120, 0, 1.0, 0.0), every=12.0)  # no beat counted: a stall
    assert lost(rc.decide(snap([1, 1, 45, 1], stopped))) == []


def test_the_beats_per_node_since_count_only_intervals_begun_after_it():
    blind = sl.deafness(samples((10, 0, 1.0, 0.5)), NOW)
    assert blind.beats_per_node_since(ago(4)) == 2.0  # intervals from 4, 3, 2, 1 s ago
    assert blind.beats_per_node_since(ago(3.5)) == 1.5
    assert blind.beats_per_node_since(NOW) == 0.0


def test_the_share_of_peers_heard_after_each_node_counts_only_peers_still_heard():
    blind = sl.deafness(samples((60, 0, 1.0, 0.5)), NOW)  # a turn of the fleet: 6 s
    last = {"a": ago(10), "b": ago(5), "c": ago(1), "d": None}
    # a is quiet through a turn: it counts for nobody; b and c count for those before.
    assert sl.peers_heard_after(last, blind) == {"a": 2 / 3, "b": 1 / 3, "c": 0.0, "d": 2 / 3}
    assert sl.peers_heard_after({"solo": ago(3)}, blind) == {"solo": None}


def test_one_lost_node_of_a_two_node_fleet_leaves_the_service_hearing():
    # Half the fleet heard is no deafness: a real node loss in a small fleet is found.
    intake = samples((120, 0, 0.5), fleet=2)
    assert lost(rc.decide(snap([1, 40], intake))) == ["j-a1-n1"]


def test_a_fleet_too_small_to_judge_by_share_is_never_deaf():
    # Both nodes of a two-node fleet silent (both cut off): the intake cannot say
    # whose fault that is, so silence counts as it is.
    intake = samples((120, 41, 1.0), (40, 0, 0.0), fleet=2)
    assert lost(rc.decide(snap([40, 40], intake))) == ["j-a1-n0"]


def test_a_stalled_service_does_not_turn_its_own_pause_into_lost_nodes():
    # SIGSTOPped for 45 s: no sample between 50 s and 5 s ago. Both nodes (all of a
    # two-node job) were last heard 48 s ago.
    intake = samples((120, 50, 1.0), (5, 0, 1.0), fleet=2)
    out = rc.decide(snap([48, 48], intake))
    assert lost(out) == []
    assert "did not run" in notes(out)[0].message


def test_a_tick_that_started_long_after_its_last_sample_was_stalled_in_between():
    intake = samples((120, 46, 1.0), fleet=2)  # the newest sample is 46 s old
    assert lost(rc.decide(snap([48, 48], intake))) == []


def test_a_stall_forgives_only_its_own_length():
    intake = samples((120, 50, 1.0), (5, 0, 1.0), fleet=2)
    assert lost(rc.decide(snap([1, 80], intake))) == ["j-a1-n1"]  # 80 - 45 = 35 > 30


def test_deaf_time_is_forgiven_up_to_a_cap_so_a_real_mass_loss_is_acted_on():
    intake = samples((1200, 0, 0.1), every=5.0)  # deaf for 20 minutes
    cfg = rc.ReconcileConfig(silence=sl.SilenceConfig(max_forgiven_s=300.0))
    assert lost(rc.decide(snap([1, 1, 320, 1], intake), cfg)) == []
    assert lost(rc.decide(snap([1, 1, 340, 1], intake), cfg)) == ["j-a1-n2"]


def test_most_of_a_job_silent_at_once_opens_no_recovery_and_records_disruption():
    # The fleet is heard, yet 3 of this job's 4 nodes went silent together (a zone
    # cut off from the service): wait, and say so.
    out = rc.decide(snap([40, 41, 42, 1], HEALTHY))
    assert lost(out) == []
    (note,) = notes(out)
    assert note.message.startswith("3 of 4 nodes silent past the 30 s heartbeat timeout")


def test_half_of_a_job_silent_is_a_node_loss_not_a_disruption():
    assert lost(rc.decide(snap([40, 41, 1, 1], HEALTHY))) == ["j-a1-n0"]


def test_a_disruption_is_waited_out_only_up_to_the_cap():
    cfg = rc.ReconcileConfig(silence=sl.SilenceConfig(max_forgiven_s=120.0))
    assert lost(rc.decide(snap([140, 145, 150, 1], HEALTHY), cfg)) == []
    assert lost(rc.decide(snap([160, 145, 140, 1], HEALTHY), cfg)) == ["j-a1-n0"]


@pytest.mark.parametrize(
    "intake",
    [HEALTHY, samples((120, 0, 0.1))],
    ids=["disruption", "deaf-service"],
)
def test_a_zone_wide_loss_the_launcher_witnesses_still_recovers(intake):
    # Every node silent at once, but the launcher says n1 is gone: the second witness.
    out = rc.decide(snap([40, 40, 40, 40], intake, alive1=False))
    assert lost(out) == ["j-a1-n1"]


def test_a_zone_wide_preemption_notice_still_opens_an_incident_in_a_disruption():
    notice = rc.Failure(
        7, EventKind.PREEMPTION_NOTICE, F.PREEMPTION_NOTICE, ago(35), node_id="j-a1-n0"
    )
    out = rc.decide(snap([40, 40, 40, 40], HEALTHY, failures=(notice,)))
    assert any(isinstance(x, rc.OpenIncident) for x in out)


def test_the_disruption_is_noted_once_per_attempt():
    assert rc.decide(snap([40, 41, 42, 1], HEALTHY, degraded_noted=True)) == []


def test_silent_nodes_are_not_called_hung_while_the_service_is_deaf():
    s = snap([45, 45, 45, 45], samples((120, 41, 1.0), (40, 0, 0.1)))
    out = rc.decide(s)
    assert not any(isinstance(x, rc.RecordFailure) for x in out)


def test_without_intake_samples_silence_counts_as_before():
    assert lost(rc.decide(snap([1, 31]))) == ["j-a1-n1"]


@pytest.mark.parametrize(
    ("fleet", "want"),
    [(1, 1.0), (256, 1.0), (512, 2.0), (2048, 8.0), (8192, 10.0)],
    ids=["one", "256", "512", "2048", "capped-at-timeout/3"],
)
def test_the_heartbeat_interval_scales_with_the_fleet_within_the_timeout(fleet, want):
    assert sl.heartbeat_interval_s(fleet, timeout_s=30.0) == want
