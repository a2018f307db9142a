"""Warm survivors of an elastic shrink (issue 20) in the pure core: SIGNAL holds the
survivors whose ranks left the broken group and wait for a membership, and SELECT
carries them warm into the shrunk attempt only when it held every kept node and a
complete checkpoint was confirmed. Hand-built snapshots at a fixed NOW."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from orchestrator.contract import EventKind
from orchestrator.domain import reconcile as rc
from orchestrator.domain.failures import FailureClass as F
from orchestrator.domain.protocol import ProtocolStep as P
from orchestrator.domain.protocol import StepOutcome as O
from orchestrator.domain.status import JobStatus as S
from tests.reconciler.test_elastic_decide import (
    done,
    full_attempt,
    lost_n2,
    node,
    selection,
    snap,
    spec,
)


def waiting(n: rc.NodeView, generation: int = 0) -> rc.NodeView:
    """The node's every rank left generation ``generation`` and waits, alive."""
    return replace(n, ranks=tuple(replace(r, regrouping=generation) for r in n.ranks))


def at_signal(nodes: tuple[rc.NodeView, ...], spec_=None) -> rc.JobSnapshot:
    """Node 2 of attempt 1 was lost (its processes vanished): SIGNAL is next."""
    inc = rc.IncidentView(
        event_id=7, attempt=1, failure_class=F.NODE_LOST, node_id="j-a1-n2",
        steps=done(P.DETECT),
    )  # fmt: skip
    a = replace(full_attempt(), nodes=nodes)
    return snap(status=S.RECOVERING, incident=inc, attempt=a, spec=spec_ or spec())


LOST = replace(node(2), alive=False)


def test_survivors_whose_ranks_wait_for_a_membership_are_held_not_stopped():
    out = rc.decide(at_signal((waiting(node(0)), waiting(node(1)), LOST)))
    assert rc.HoldWarm(1, ("j-a1-n0", "j-a1-n1")) in out
    assert not any(isinstance(x, rc.SendCommand) for x in out)
    fin = next(x for x in out if isinstance(x, rc.FinishStep))
    assert (fin.step, fin.outcome) == (P.SIGNAL, O.OK)
    assert "held warm, not stopped" in fin.detail and "j-a1-n0, j-a1-n1" in fin.detail


def detected(s: rc.JobSnapshot, ago_s: float) -> rc.JobSnapshot:
    at = s.now - timedelta(seconds=ago_s)
    steps = {P.DETECT: rc.StepView(at, at, O.OK)}
    return replace(s, incident=replace(s.incident, steps=steps))


def test_signal_waits_briefly_for_survivors_yet_to_say_they_wait_warm():
    # node 1's rank has not reported leaving the group yet (its next heartbeat will)
    s = at_signal((waiting(node(0)), node(1), LOST))
    assert rc.decide(detected(s, 2.0)) == []  # nothing signalled, nothing started
    out = rc.decide(detected(s, 21.0))  # past warm_wait_s: signalled as before
    assert not any(isinstance(x, rc.HoldWarm) for x in out)
    assert any(isinstance(x, rc.SendCommand) for x in out)
    assert rc.StartStep(7, P.SIGNAL) in out


def test_a_survivor_rank_that_exited_ends_the_wait_at_once():
    gone = replace(node(1), ranks=(replace(node(1).ranks[0], exit_code=1),))
    out = rc.decide(detected(at_signal((waiting(node(0)), gone, LOST)), 1.0))
    assert any(isinstance(x, rc.SendCommand) for x in out)


def test_a_survivor_whose_rank_exited_is_not_held():
    gone = replace(node(1), ranks=(replace(node(1).ranks[0], regrouping=0, exit_code=80),))
    out = rc.decide(at_signal((waiting(node(0)), gone, LOST)))
    assert not any(isinstance(x, rc.HoldWarm) for x in out)


def test_a_job_that_may_not_shrink_never_holds_its_survivors():
    nodes = (waiting(node(0)), waiting(node(1)), LOST)
    for never in (spec(min_nodes=None), spec(shrink="never")):
        out = rc.decide(at_signal(nodes, never))
        assert not any(isinstance(x, rc.HoldWarm) for x in out), never


def held(n: rc.NodeView) -> rc.NodeView:
    return replace(waiting(n), held=True)


def test_a_shrink_of_held_survivors_with_a_confirmed_checkpoint_carries_them_warm():
    s = lost_n2(provision_s=(600.0,))
    s = replace(s, attempt=replace(s.attempt, nodes=(held(node(0)), held(node(1)), LOST)))
    sel = selection(s)
    assert sel.result.verb is rc.LaunchVerb.SHRINK and sel.result.warm
    assert "carried warm" in sel.detail
    steps = {**s.incident.steps, **done(P.SELECT_REPLACEMENT)}
    out = rc.decide(replace(s, incident=replace(s.incident, steps=steps, selection=sel.result)))
    rec = next(x for x in out if isinstance(x, rc.RecordAttempt))
    assert rec.warm and rec.keep == ("j-a1-n0", "j-a1-n1") and rec.resume_step == 40


def test_a_shrink_is_cold_unless_every_kept_node_was_held():
    s = lost_n2(provision_s=(600.0,))
    s = replace(s, attempt=replace(s.attempt, nodes=(held(node(0)), node(1), LOST)))
    assert not selection(s).result.warm


def test_a_shrink_without_a_complete_checkpoint_is_cold():
    s = lost_n2(provision_s=(600.0,))
    s = replace(
        s,
        attempt=replace(s.attempt, nodes=(held(node(0)), held(node(1)), LOST)),
        incident=replace(s.incident, confirmed=rc.ConfirmedCheckpoint(None)),
    )
    assert not selection(s).result.warm  # a re-formed group never starts fresh


def test_held_survivors_that_select_does_not_shrink_onto_are_joined_cold():
    s = lost_n2(provision_s=(30.0,))  # the replacement is expected soon: wait for it
    s = replace(s, attempt=replace(s.attempt, nodes=(held(node(0)), held(node(1)), LOST)))
    sel = selection(s)
    assert sel.result.verb is rc.LaunchVerb.JOIN_SURVIVORS and not sel.result.warm


# --- detect: the peer a warm group lost, before its heartbeat timeout ---------------------


def _running(*nodes: rc.NodeView) -> rc.JobSnapshot:
    return snap(attempt=replace(full_attempt(), nodes=nodes))


def test_a_node_silent_while_every_peer_regroups_is_lost_before_its_heartbeat_timeout():
    # Node 2's VM is gone; the cloud's status does not say so yet (alive unknown).
    silent = replace(node(2, hb=11.0), alive=None)
    (found,) = rc.decide(_running(waiting(node(0)), waiting(node(1)), silent))
    assert isinstance(found, rc.RecordFailure)
    assert (found.kind, found.failure_class, found.node_id) == (
        EventKind.NODE_LOST, F.NODE_LOST, "j-a1-n2",
    )  # fmt: skip
    assert "silent for 11 s while every rank of its 2 peer nodes left the group" in found.message


def test_a_node_heard_lately_is_not_blamed_for_its_peers_regrouping():
    recent = replace(node(2, hb=4.0), alive=None)
    assert rc.decide(_running(waiting(node(0)), waiting(node(1)), recent)) == []


def test_silence_beside_a_peer_that_is_not_regrouping_waits_for_the_heartbeat_timeout():
    silent = replace(node(2, hb=11.0), alive=None)
    assert rc.decide(_running(waiting(node(0)), node(1), silent)) == []


def test_two_silent_nodes_beside_one_regrouping_wait_for_the_heartbeat_timeout():
    a, b = replace(node(1, hb=11.0), alive=None), replace(node(2, hb=11.0), alive=None)
    assert rc.decide(_running(waiting(node(0)), a, b)) == []
