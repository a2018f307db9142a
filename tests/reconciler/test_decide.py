"""The reconciler's pure decision, on hand-built snapshots at a fixed NOW."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from orchestrator.contract import CommandType
from orchestrator.domain import reconcile as rc
from orchestrator.domain.failures import FailureClass as F
from orchestrator.domain.plan import Placement
from orchestrator.domain.planner import Candidate
from orchestrator.domain.policy import RecoveryAction
from orchestrator.domain.protocol import ProtocolStep as P
from orchestrator.domain.protocol import StepOutcome as O
from orchestrator.domain.spec import validate_job_spec
from orchestrator.domain.status import JobStatus as S

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def ago(s: float) -> datetime:
    return NOW - timedelta(seconds=s)


def node(k: int, *, attempt: int = 1, steps=(50, 50), resumed=(0, 0), hb=1.0, **kw):
    ranks = tuple(
        rc.RankView(rank=2 * k + i, step=st, resumed_step=rs, report_age_s=0.2)
        for i, (st, rs) in enumerate(zip(steps, resumed, strict=True))
    )
    base = dict(
        node_id=f"j-a{attempt}-n{k}",
        node_rank=k,
        last_heartbeat_at=ago(hb),
        alive=True,
        ranks=ranks,
        address=f"10.0.0.{k + 2}",
    )
    return rc.NodeView(**{**base, **kw})


def attempt(
    number=1, *, validated=0, expected=None, nodes=None, started=120.0, state="running", **kw
):
    launched = kw.get("launched", True)
    kw.setdefault("requested_at", ago(started))
    kw.setdefault("up_at", ago(started) if launched else None)
    return rc.AttemptView(
        placement=kw.pop("placement", R1),
        **kw,
        number=number,
        state=state,
        started_at=ago(started),
        num_nodes=2,
        ranks_per_node=2,
        expected_step=expected,
        validated_step=validated,
        nodes=tuple(
            nodes if nodes is not None else (node(0, attempt=number), node(1, attempt=number))
        ),
    )


SPEC = validate_job_spec(
    {
        "name": "j",
        "task": {"template": "local", "command": "python train.py"},
        "num_nodes": 2,
        "ranks_per_node": 2,
        "checkpoint": {"uri": "file:///ckpt"},
        "restarts": {"heartbeat_timeout_s": 30.0, "grace_period_s": 60.0, "max_restarts": 3},
    }
)
CANDIDATES = (
    Candidate("fake", "r1", "cpu", None, 0, None, 1.0, 0.5),
    Candidate("fake", "r2", "cpu", None, 0, None, 2.0, 1.5),
)
R1 = Placement("fake", "r1", "cpu", None, 0, 2, True, price_per_node_hour=0.5)


def snap(**kw) -> rc.JobSnapshot:
    base = dict(
        job_id="j",
        status=S.RUNNING,
        now=NOW,
        spec=SPEC,
        attempt=attempt(),
        candidates=CANDIDATES,
        abilities=rc.LauncherAbilities(restarts_in_place=True),
    )
    return rc.JobSnapshot(**{**base, **kw})


def failure(cls=F.PREEMPTION_NOTICE, kind="preemption_notice", node_id="j-a1-n1", code=None, id_=7):
    return rc.Failure(id_, kind, cls, ago(2), node_id=node_id, exit_code=code, message="m")


def incident(steps: dict, cls=F.PREEMPTION_NOTICE, attempt_=1, **kw) -> rc.IncidentView:
    return rc.IncidentView(event_id=99, attempt=attempt_, failure_class=cls, steps=steps, **kw)


def done(*names: P, at: float = 5.0) -> dict:
    return {p: rc.StepView(ago(at), ago(at - 1), O.OK) for p in names}


def test_a_new_job_is_recorded_as_attempt_one_on_the_cheapest_placement():
    out = rc.decide(snap(status=S.PENDING, attempt=None))
    assert out[0] == rc.SetStatus(S.PROVISIONING, "launching attempt 1")
    rec = out[1]
    assert isinstance(rec, rc.RecordAttempt) and rec.number == 1 and rec.placement.region == "r1"
    assert (rec.resume_step, rec.resume_from) == (None, "latest")


def test_a_recorded_attempt_is_started_on_the_next_tick():
    a = attempt(validated=None, launched=False, state="launching", nodes=())
    assert rc.decide(snap(status=S.PROVISIONING, attempt=a)) == [rc.StartNodes(1, None)]


def test_every_rank_reporting_the_same_resume_step_makes_the_job_running():
    a = attempt(validated=None)
    out = rc.decide(snap(status=S.PROVISIONING, attempt=a))
    assert out[0] == rc.MarkValidated(1, 0)
    assert out[1].status is S.RUNNING


def test_ranks_that_disagree_on_their_resume_step_are_not_validated():
    a = attempt(validated=None, nodes=(node(0, resumed=(0, 0)), node(1, resumed=(0, 10))))
    assert rc.decide(snap(status=S.PROVISIONING, attempt=a)) == []


def test_ranks_at_the_same_step_from_different_manifests_are_not_validated():
    n1 = node(1)
    odd = replace(n1.ranks[1], resumed_digest="other")
    a = attempt(validated=None, nodes=(node(0), replace(n1, ranks=(n1.ranks[0], odd))))
    assert rc.decide(snap(status=S.PROVISIONING, attempt=a)) == []


def test_one_missing_rank_report_is_not_validated():
    a = attempt(validated=None, nodes=(node(0), node(1, resumed=(0, None))))
    assert rc.decide(snap(status=S.PROVISIONING, attempt=a)) == []


def test_a_preemption_notice_opens_an_incident_with_the_last_step_seen():
    out = rc.decide(snap(failures=(failure(),)))
    assert out[0] == rc.OpenIncident(failure(), 1, 50)
    assert out[1].status is S.RECOVERING


def test_a_vanished_node_is_recorded_before_its_peers_crashes_name_the_incident():
    crash = failure(F.NCCL_TRANSPORT, "rank_exit", "j-a1-n1", code=1)
    a = attempt(nodes=(node(0, alive=False), node(1)))
    out = rc.decide(snap(attempt=a, failures=(crash,)))
    assert len(out) == 1 and isinstance(out[0], rc.RecordFailure)
    assert out[0].failure_class is F.NODE_LOST and out[0].node_id == "j-a1-n0"
    lost = failure(F.NODE_LOST, "node_lost", "j-a1-n0", id_=8)
    out = rc.decide(snap(attempt=a, failures=(crash, lost)))
    assert out[0].cause == lost


def test_silence_past_the_heartbeat_timeout_is_a_lost_node():
    a = attempt(nodes=(node(0), node(1, hb=31)))
    (out,) = rc.decide(snap(attempt=a))
    assert out.kind == "node_lost" and "no heartbeat for 31 s" in out.message


def test_silence_while_the_service_itself_was_down_loses_no_node():
    """Every node's last heartbeat is 40 s old because the service restarted 10 s ago:
    they were talking to nobody. Silence counts from the restart, so nothing is lost;
    once the timeout passes with the service up, a node still silent is."""
    a = attempt(nodes=(node(0, hb=40), node(1, hb=40)))
    assert rc.decide(snap(attempt=a, heard_since=ago(10))) == []
    (out,) = rc.decide(snap(attempt=a, heard_since=ago(31)))
    assert out.kind == "node_lost" and "no heartbeat for 31 s" in out.message


def test_a_rank_without_progress_after_validation_is_a_hang():
    stalled = rc.RankView(rank=3, step=50, resumed_step=0, report_age_s=29.5)
    n1 = replace(node(1), ranks=(node(1).ranks[0], stalled))
    (out,) = rc.decide(snap(attempt=attempt(nodes=(node(0), n1))))
    assert out.kind == "rank_hang" and out.rank == 3 and out.failure_class is F.NCCL_TIMEOUT


def test_a_silent_node_is_lost_not_its_peers_hung():
    """A partitioned node: its agent has not been heard for 29 s and its ranks' last
    report was 1.5 s old then (30.5 s of silence, past the 30 s timeout); the other
    node's ranks wait on it. Not a hang: at the timeout the node is lost."""
    stalled = rc.RankView(rank=3, step=50, resumed_step=0, report_age_s=1.5)
    n1 = replace(node(1, hb=29), ranks=(node(1).ranks[0], stalled))
    assert rc.decide(snap(attempt=attempt(nodes=(node(0), n1)))) == []
    n1 = replace(n1, last_heartbeat_at=ago(31))
    (out,) = rc.decide(snap(attempt=attempt(nodes=(node(0), n1))))
    assert out.kind == "node_lost" and out.node_id == "j-a1-n1"


def test_a_rank_still_loading_before_validation_is_not_a_hang():
    slow = rc.RankView(rank=3, step=None, resumed_step=None, report_age_s=100.0)
    n1 = replace(node(1), ranks=(node(1).ranks[0], slow))
    assert (
        rc.decide(snap(status=S.PROVISIONING, attempt=attempt(validated=None, nodes=(node(0), n1))))
        == []
    )


def test_a_node_that_never_registers_is_lost_after_the_register_timeout():
    a = attempt(validated=None, nodes=(node(0),), started=181)
    (out,) = rc.decide(snap(status=S.PROVISIONING, attempt=a))
    assert out.kind == "node_lost" and "node 1 of attempt 1 never registered" in out.message


def test_every_node_exiting_zero_is_success():
    a = attempt(nodes=(node(0, exited=True, exit_code=0), node(1, exited=True, exit_code=0)))
    out = rc.decide(snap(attempt=a))
    assert out[0].status is S.SUCCEEDED and out[1] == rc.Release(1, "finished")


def test_a_rank_refusing_its_checkpoint_fails_the_job_without_retry():
    refusal = failure(F.CHECKPOINT_IO, "rank_exit", code=78)
    out = rc.decide(snap(failures=(refusal,)))
    assert out[0].status is S.FAILED and "refused to resume" in out[0].reason
    assert out[1] == rc.Release(1, out[0].reason)


def test_signal_asks_for_a_save_after_a_notice_and_for_a_stop_after_a_loss():
    out = rc.decide(snap(status=S.RECOVERING, incident=incident(done(P.DETECT))))
    assert out == [
        rc.StartStep(99, P.SIGNAL),
        rc.SendCommand(
            1, CommandType.CHECKPOINT_AND_STOP, {"reason": "preemption_notice", "grace_s": 60.0}
        ),
    ]
    out = rc.decide(snap(status=S.RECOVERING, incident=incident(done(P.DETECT), F.NODE_LOST)))
    assert out[1] == rc.SendCommand(1, CommandType.STOP, {"reason": "node_lost"})


def test_a_hang_is_stopped_only_after_every_rank_s_stack_is_taken():
    out = rc.decide(snap(status=S.RECOVERING, incident=incident(done(P.DETECT), F.NCCL_TIMEOUT)))
    assert out[1] == rc.SendCommand(
        1, CommandType.STOP, {"reason": "nccl_timeout", "capture_stacks": True}
    )


def test_signal_waits_for_every_node_then_finishes():
    started = {**done(P.DETECT), P.SIGNAL: rc.StepView(ago(3))}
    running = snap(status=S.RECOVERING, incident=incident(started))
    assert rc.decide(running) == []
    a = attempt(nodes=(node(0, exited=True, exit_code=75), node(1, alive=False)), state="stopping")
    (out,) = rc.decide(replace(running, attempt=a))
    assert out.step is P.SIGNAL and out.outcome is O.OK


def test_signal_does_not_wait_out_the_grace_of_a_node_that_cannot_hear_it():
    """A cut-off node (alive, silent past the heartbeat timeout) never gets the stop:
    once the others stopped, SIGNAL ends instead of idling them for its grace."""
    started = {**done(P.DETECT), P.SIGNAL: rc.StepView(ago(3))}
    a = attempt(nodes=(node(0, exited=True, exit_code=75), node(1, hb=40.0)), state="stopping")
    (out,) = rc.decide(snap(status=S.RECOVERING, incident=incident(started), attempt=a))
    assert out.step is P.SIGNAL and out.outcome is O.OK
    assert "not waited for, silent past the heartbeat timeout: j-a1-n1" in out.detail
    # a node that still talks is waited for, whatever the other did
    a = attempt(nodes=(node(0, exited=True, exit_code=75), node(1, hb=1.0)), state="stopping")
    assert rc.decide(snap(status=S.RECOVERING, incident=incident(started), attempt=a)) == []


def test_signal_gives_up_waiting_after_the_grace_period_and_names_who_was_left():
    started = {**done(P.DETECT), P.SIGNAL: rc.StepView(ago(76))}
    (out,) = rc.decide(snap(status=S.RECOVERING, incident=incident(started)))
    assert out.outcome is O.OK and "j-a1-n0, j-a1-n1" in out.detail


def test_confirm_takes_the_newest_complete_checkpoint_then_releases_the_nodes():
    listing = rc.CheckpointListing("file:///ckpt", (30, 40))
    inc = incident(done(P.DETECT, P.SIGNAL))
    out = rc.decide(snap(status=S.RECOVERING, incident=inc, listing=listing))
    assert out[0] == rc.StartStep(99, P.CONFIRM_CHECKPOINT)
    assert out[1].result == rc.ConfirmedCheckpoint(40, "file:///ckpt/step_40")
    assert out[2] == rc.Release(1, "incident 99", keep_nodes=False)


def test_an_unreadable_checkpoint_store_is_never_read_as_no_checkpoint():
    listing = rc.CheckpointListing("s3://b/ckpt", error="AccessDenied")
    inc = incident(done(P.DETECT, P.SIGNAL))
    out = rc.decide(snap(status=S.RECOVERING, incident=inc, listing=listing))
    assert out[1].outcome is O.FAILED and "unreadable: AccessDenied" in out[1].detail
    assert out[2].status is S.FAILED


CONFIRMED_40 = rc.ConfirmedCheckpoint(40, "file:///ckpt/step_40")


def _selected(inc_cls=F.PREEMPTION_NOTICE, **kw) -> list:
    steps = {**done(P.DETECT, P.SIGNAL, P.CONFIRM_CHECKPOINT)}
    inc = incident(steps, inc_cls, confirmed=CONFIRMED_40)
    return rc.decide(snap(status=S.RECOVERING, incident=inc, **kw))


def test_select_records_the_placement_that_launch_will_start():
    (start, fin) = _selected()
    assert start == rc.StartStep(99, P.SELECT_REPLACEMENT)
    assert isinstance(fin.result, rc.Selection)
    assert fin.result.placement.region == "r2"  # r1 preempted us: avoided while r2 exists
    assert fin.result.remedy is RecoveryAction.REPLACE_NODE_BLOCK_REGION
    assert fin.result.verb is rc.LaunchVerb.LAUNCH  # new nodes, a new cluster


def test_the_restart_limit_is_decided_at_select():
    (_, fin, status, _release) = _selected(restarts_done=3)
    assert fin.outcome is O.FAILED and "restart limit reached (3 restarts)" in fin.detail
    assert status.status is S.FAILED


KEEPS = rc.LauncherAbilities(restarts_in_place=True, keeps_survivors=True)
KEEPS_AND_RELEASES = rc.LauncherAbilities(keeps_survivors=True, releases_single_nodes=True)


def _preempted_n1(cls=F.PREEMPTION_NOTICE, abilities=KEEPS, **kw) -> rc.JobSnapshot:
    steps = {**done(P.DETECT, P.SIGNAL)}
    inc = rc.IncidentView(event_id=99, attempt=1, failure_class=cls, steps=steps, node_id="j-a1-n1")
    a = attempt(hosts={"j-a1-n0": "h0", "j-a1-n1": "h1"})
    return snap(status=S.RECOVERING, incident=inc, abilities=abilities, attempt=a, **kw)


def test_a_preempted_node_is_replaced_beside_the_healthy_one_which_stays():
    s = _preempted_n1(listing=rc.CheckpointListing("file:///ckpt", (40,), {40: "d"}))
    (_, fin, release) = rc.decide(s)
    assert fin.step is P.CONFIRM_CHECKPOINT
    # the healthy node stays provisioned; the lost one is given back
    assert release == rc.Release(1, "incident 99", keep_nodes=True, release_nodes=("j-a1-n1",))
    steps = {**s.incident.steps, **done(P.CONFIRM_CHECKPOINT)}
    inc = replace(s.incident, steps=steps, confirmed=CONFIRMED_40)
    (_, sel) = rc.decide(replace(s, incident=inc))
    assert sel.result.keep == ("j-a1-n0",) and sel.result.keep_hosts == ("h0",)
    # the replacement joins the survivor: same region, although r1 just preempted us
    assert sel.result.placement.region == "r1"
    assert sel.result.verb is rc.LaunchVerb.JOIN_SURVIVORS
    assert "keep the 1 healthy node (j-a1-n0)" in sel.detail


def test_a_survivor_whose_ranks_died_of_the_lost_peer_is_still_kept():
    """The killed node's peer's ranks exit too (classed after the cause, node_lost):
    what happened to its ranks is not what happened to the node."""
    echo = rc.Failure(8, "rank_exit", F.NODE_LOST, ago(1), node_id="j-a1-n0", rank=0)
    s = _preempted_n1(F.NODE_LOST, failures=(echo,))
    s = replace(s, listing=rc.CheckpointListing("file:///ckpt", (40,), {40: "d"}))
    (_, _, release) = rc.decide(s)
    assert release.release_nodes == ("j-a1-n1",)


def test_an_earlier_straggler_report_does_not_take_a_healthy_node_out():
    noise = rc.Failure(3, "anomaly", F.SLOW_PEER, ago(60), node_id="j-a1-n0", rank=0)
    s = _preempted_n1(F.NODE_LOST, failures=(noise,))
    s = replace(s, listing=rc.CheckpointListing("file:///ckpt", (40,), {40: "d"}))
    (_, _, release) = rc.decide(s)
    assert release.release_nodes == ("j-a1-n1",)


def test_without_a_launcher_that_keeps_survivors_every_node_is_relaunched():
    s = _preempted_n1(abilities=rc.LauncherAbilities(restarts_in_place=True))
    s = replace(s, listing=rc.CheckpointListing("file:///ckpt", (40,), {40: "d"}))
    (_, _, release) = rc.decide(s)
    assert release == rc.Release(1, "incident 99")


def test_a_slow_node_that_still_runs_is_kept_out_only_where_one_node_can_be_given_back():
    listing = rc.CheckpointListing("file:///ckpt", (40,), {40: "d"})
    # SkyPilot: the slow VM would bill on, unreleasable alone: relaunch the whole group
    (_, _, release) = rc.decide(_preempted_n1(F.SLOW_PEER, KEEPS, listing=listing))
    assert release == rc.Release(1, "incident 99")
    (_, _, release) = rc.decide(_preempted_n1(F.SLOW_PEER, KEEPS_AND_RELEASES, listing=listing))
    assert release.keep_nodes and release.release_nodes == ("j-a1-n1",)


def test_a_transport_error_keeps_every_node_in_place_not_some():
    s = _preempted_n1(F.NCCL_TRANSPORT, listing=rc.CheckpointListing("file:///c", (40,), {40: "d"}))
    (_, _, release) = rc.decide(s)
    assert release == rc.Release(1, "incident 99", keep_nodes=True)


def _selected_steps() -> dict:
    return {**done(P.DETECT, P.SIGNAL, P.CONFIRM_CHECKPOINT, P.SELECT_REPLACEMENT)}


#: CONFIRM's and SELECT's results: step 40 on s3, new nodes in r1.
CHOSEN = dict(
    confirmed=rc.ConfirmedCheckpoint(40, "s3://b/ckpt/step_40"),
    selection=rc.Selection(RecoveryAction.REPLACE_NODE_BLOCK_REGION, R1, rc.LaunchVerb.LAUNCH),
)


def test_launch_records_what_select_chose_and_the_node_stages_the_remote_checkpoint():
    (start, status, rec) = rc.decide(
        snap(status=S.RECOVERING, incident=incident(_selected_steps(), **CHOSEN))
    )
    assert start == rc.StartStep(99, P.LAUNCH) and status.status is S.PROVISIONING
    assert rec == rc.RecordAttempt(
        2, 99, R1, 40, "{node_disk}/staged/step_40", stage_from="s3://b/ckpt/step_40"
    )
    assert not rec.resume_from.startswith("s3://")  # never a remote URI as a path


def _provisioning(progress: rc.LaunchProgress | None, *, requested: float, nodes=()):
    steps = {**_selected_steps(), P.LAUNCH: rc.StepView(ago(requested))}
    a2 = attempt(
        2, validated=None, expected=40, nodes=nodes, started=requested, state="launching",
        requested_at=ago(requested), up_at=None, provision=progress,
    )  # fmt: skip
    return snap(status=S.RECOVERING, attempt=a2, incident=incident(steps, **CHOSEN))


def test_a_launch_still_provisioning_is_polled_not_failed_even_past_the_register_timeout():
    slow = rc.LaunchProgress(rc.LaunchPhase.PROVISIONING, "INIT")
    assert rc.decide(_provisioning(slow, requested=400.0)) == []  # 180 s register timeout
    unread = rc.LaunchProgress(rc.LaunchPhase.UNKNOWN, "API server unreachable")
    assert rc.decide(_provisioning(unread, requested=400.0)) == []


def test_a_launch_that_is_up_finishes_launch_and_starts_the_register_clock():
    up = rc.LaunchProgress(rc.LaunchPhase.UP, hosts=("10.0.0.2", "10.0.0.3"))
    (mark, fin) = rc.decide(_provisioning(up, requested=300.0))
    assert mark == rc.MarkProvisioned(2, ("10.0.0.2", "10.0.0.3"))
    assert fin.step is P.LAUNCH and fin.outcome is O.OK and "up in 300.0 s" in fin.detail


def test_a_launch_request_that_failed_in_the_provider_is_recorded_as_a_refused_launch():
    gone = rc.LaunchProgress(rc.LaunchPhase.FAILED, "ResourcesUnavailableError: r1", capacity=True)
    assert rc.decide(_provisioning(gone, requested=30.0)) == [
        rc.LaunchRequestFailed(2, "ResourcesUnavailableError: r1", True)
    ]


def test_a_launch_past_the_provisioning_timeout_is_given_up_like_a_stockout():
    slow = rc.LaunchProgress(rc.LaunchPhase.PROVISIONING, "INIT")
    (failed,) = rc.decide(_provisioning(slow, requested=901.0))
    assert isinstance(failed, rc.LaunchRequestFailed) and failed.capacity
    assert "provision_timeout_s 900" in failed.detail


def test_a_node_that_is_up_but_never_registers_is_lost_after_the_register_timeout():
    a = attempt(validated=None, nodes=(node(0),), started=500.0, up_at=ago(181))
    (lost,) = rc.decide(snap(attempt=a))
    assert lost.kind == "node_lost" and "after it was up" in lost.message
    a = attempt(validated=None, nodes=(node(0),), started=500.0, up_at=ago(100))
    assert rc.decide(snap(attempt=a)) == []


def _staging(staged=(), nodes=None, failures=()):
    steps = {
        **_selected_steps(),
        P.LAUNCH: rc.StepView(ago(3), ago(2), O.OK),
        P.STAGE: rc.StepView(ago(2)),
    }
    a2 = attempt(2, validated=None, expected=40, staged=staged, nodes=nodes, started=3.0)
    inc = incident(steps, **CHOSEN)
    return snap(status=S.RECOVERING, attempt=a2, incident=inc, failures=failures)


def test_stage_waits_for_every_node_to_report_then_says_what_was_copied():
    one = rc.StagedView("j-a2-n0", True, 40, bytes=1000, seconds=1.5)
    assert rc.decide(_staging((one,))) == []
    two = rc.StagedView("j-a2-n1", True, 40, bytes=2000, seconds=2.5)
    (fin,) = rc.decide(_staging((one, two)))
    assert fin.step is P.STAGE and fin.outcome is O.OK
    assert "3000 bytes" in fin.detail and "2.50 s" in fin.detail


def test_a_node_that_cannot_stage_the_checkpoint_fails_the_job_naming_why():
    bad = rc.StagedView("j-a2-n1", False, 40, detail="shard 1: sha256 mismatch")
    (fin, status, _release) = rc.decide(_staging((bad,)))
    assert fin.outcome is O.FAILED and "sha256 mismatch" in fin.detail and "j-a2-n1" in fin.detail
    assert status.status is S.FAILED


def test_a_node_lost_while_staging_ends_the_incident_for_the_next_one():
    nodes = (node(0, attempt=2), node(1, attempt=2, alive=False))
    (stage, validate, lost) = rc.decide(_staging(nodes=nodes))
    assert stage.step is P.STAGE and stage.outcome is O.SKIPPED
    assert validate.step is P.VALIDATE and validate.outcome is O.FAILED
    assert lost.kind == "node_lost"


def _validating(a2: rc.AttemptView, failures=()) -> rc.JobSnapshot:
    steps = {**done(*tuple(P)[:6]), P.VALIDATE: rc.StepView(ago(2))}  # DETECT..STAGE done
    return snap(status=S.PROVISIONING, attempt=a2, incident=incident(steps), failures=failures)


def test_validate_passes_when_every_rank_resumed_at_the_expected_step():
    nodes = (node(0, attempt=2, resumed=(40, 40)), node(1, attempt=2, resumed=(40, 40)))
    a2 = attempt(2, validated=None, expected=40, nodes=nodes)
    out = rc.decide(_validating(a2))
    assert out[0].outcome is O.OK and out[1] == rc.MarkValidated(2, 40)
    assert out[2].status is S.RUNNING


def test_validate_refuses_a_resume_at_another_step_than_the_confirmed_one():
    nodes = (node(0, attempt=2, resumed=(30, 30)), node(1, attempt=2, resumed=(30, 30)))
    a2 = attempt(2, validated=None, expected=40, nodes=nodes, started=5)
    assert rc.decide(_validating(a2)) == []


def test_validate_fails_the_job_when_ranks_refuse_to_resume():
    a2 = attempt(2, validated=None, expected=40, nodes=(), started=5)
    refusal = failure(F.CHECKPOINT_IO, "rank_exit", "j-a2-n0", code=77)
    out = rc.decide(_validating(a2, (refusal,)))
    assert out[0].outcome is O.FAILED
    assert out[1].status is S.FAILED


def test_a_new_failure_before_validation_closes_the_incident_as_failed():
    a2 = attempt(2, validated=None, expected=40, nodes=(), started=5)
    lost = failure(F.NODE_LOST, "node_lost", "j-a2-n1")
    (out,) = rc.decide(_validating(a2, (lost,)))
    assert out.step is P.VALIDATE and out.outcome is O.FAILED


def test_a_terminal_job_releases_its_nodes_once():
    assert rc.decide(snap(status=S.CANCELLED)) == [rc.Release(1, "job CANCELLED")]
    assert rc.decide(snap(status=S.CANCELLED, attempt=attempt(state="ended"))) == []


def test_a_job_that_finishes_before_every_rank_reported_in_still_succeeds():
    a = attempt(
        validated=None, nodes=(node(0, exited=True, exit_code=0), node(1, exited=True, exit_code=0))
    )
    out = rc.decide(snap(status=S.PROVISIONING, attempt=a))
    assert [o.status for o in out if isinstance(o, rc.SetStatus)] == [S.RUNNING, S.SUCCEEDED]


def test_an_attempt_that_ended_without_an_outcome_fails_the_job_instead_of_hanging():
    (out,) = rc.decide(snap(attempt=attempt(state="ended")))
    assert out.status is S.FAILED and "no outcome recorded" in out.reason


@pytest.mark.parametrize(
    "current, step_s, interval_s, expected",
    [
        (100, 1.0, 1000.0, 1000),  # ten times longer: pushed
        (100, 1.0, 110.0, None),  # 10 % off: not worth telling the ranks
        (100, 1.0, 75.0, 75),  # 25 % shorter: pushed
        (100, 2.0, 0.5, 1),  # never below one step
    ],
)
def test_a_new_checkpoint_interval_is_pushed_only_when_it_moves_meaningfully(
    current, step_s, interval_s, expected
):
    assert rc.checkpoint_every_update(current, step_s, interval_s) == expected


def test_a_node_that_exits_before_registering_is_lost_at_once():
    a = replace(attempt(validated=None, nodes=(node(0),), started=5), vanished=("j-a1-n1",))
    (out,) = rc.decide(snap(status=S.PROVISIONING, attempt=a))
    assert out.kind == "node_lost" and out.node_id == "j-a1-n1"
    assert "before it registered" in out.message


def test_rounds_follow_at_once_only_after_one_that_recorded_something_new():
    start = rc.StartStep(1, P.CONFIRM_CHECKPOINT)
    done = rc.FinishStep(1, P.CONFIRM_CHECKPOINT, O.OK, "saved")
    told = rc.SendCommand(1, CommandType.CHECKPOINT_AND_STOP, {})
    assert rc.decides_again_at_once([done, start])
    assert rc.decides_again_at_once([start, told])
    assert not rc.decides_again_at_once([told])  # waits on the ranks, not on the record
    assert not rc.decides_again_at_once([])
    assert not rc.decides_again_at_once([start], previous=[start])  # the same round again
