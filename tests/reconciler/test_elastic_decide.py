"""Elastic runs (issue 20) in the pure core: whether a job that lost a node shrinks
onto its survivors or waits, and the grow back once the replacement is up, decided
by ``decide()`` on hand-built snapshots at a fixed NOW."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from orchestrator.contract import CommandType, EventKind
from orchestrator.domain import elastic as el
from orchestrator.domain import reconcile as rc
from orchestrator.domain import remedy as rm
from orchestrator.domain.failures import FailureClass as F
from orchestrator.domain.plan import Placement, TrainingKnobs
from orchestrator.domain.policy import RecoveryAction
from orchestrator.domain.protocol import ProtocolStep as P
from orchestrator.domain.protocol import StepOutcome as O
from orchestrator.domain.spec import SpecError, validate_job_spec
from orchestrator.domain.status import JobStatus as S

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
KEEPS = rc.LauncherAbilities(
    restarts_in_place=True, keeps_survivors=True, releases_single_nodes=True
)


def ago(s: float) -> datetime:
    return NOW - timedelta(seconds=s)


def spec(min_nodes: int | None = 2, **elastic: object):
    return validate_job_spec(
        {
            "name": "j",
            "task": {"template": "local", "command": "python train.py"},
            "num_nodes": 3,
            "min_nodes": min_nodes,
            "ranks_per_node": 1,
            "model": {"parameters": 1000, "layers": 2, "hidden_size": 64, "heads": 4,
                      "seq_len": 32, "global_batch": 12, "micro_batch": 2},
            "checkpoint": {"uri": "file:///ckpt"},
            "restarts": {"heartbeat_timeout_s": 30.0, "max_restarts": 3},
            "elastic": elastic,
        }
    )  # fmt: skip


KNOBS = TrainingKnobs(micro_batch=2, grad_accum=2)  # 12 = 2 x 2 x 3 ranks
R1 = Placement("fake", "r1", "cpu", None, 0, 3, True, price_per_node_hour=0.5, knobs=KNOBS)


def node(k: int, attempt: int = 1, *, hb: float = 1.0, ranks: bool = True) -> rc.NodeView:
    return rc.NodeView(
        node_id=f"j-a{attempt}-n{k}",
        node_rank=k,
        last_heartbeat_at=ago(hb),
        alive=True,
        ranks=(rc.RankView(rank=k, step=50, resumed_step=40, step_time=0.5),) if ranks else (),
        address=f"10.0.0.{k + 2}",
    )


def full_attempt(**kw) -> rc.AttemptView:
    return rc.AttemptView(
        number=1, state="running", started_at=ago(300), num_nodes=3, ranks_per_node=1,
        validated_step=0, placement=R1, requested_at=ago(300), up_at=ago(280),
        nodes=(node(0), node(1), node(2)), **kw,
    )  # fmt: skip


def shrunk_attempt(spare_nodes=(), **spare_kw) -> rc.AttemptView:
    """Attempt 2: j-a2-n0, j-a2-n1 train; one spare (node rank 2) launched beside."""
    return rc.AttemptView(
        number=2, state="running", started_at=ago(60), num_nodes=2, ranks_per_node=1,
        validated_step=40, expected_step=40, placement=R1, requested_at=ago(60),
        up_at=ago(50), nodes=(node(0, 2), node(1, 2)), verb=rc.LaunchVerb.SHRINK,
        keep=("j-a1-n0", "j-a1-n1"), launches=2, full_nodes=3,
        spare=rc.SpareView(count=1, nodes=tuple(spare_nodes), **spare_kw),
    )  # fmt: skip


def snap(**kw) -> rc.JobSnapshot:
    base = dict(
        job_id="j", status=S.RUNNING, now=NOW, spec=spec(), attempt=full_attempt(),
        abilities=KEEPS, startup_s=(20.0,),
    )  # fmt: skip
    return rc.JobSnapshot(**{**base, **kw})


def done(*names: P) -> dict:
    return {p: rc.StepView(ago(5), ago(4), O.OK) for p in names}


CONFIRMED = rc.ConfirmedCheckpoint(40, "file:///ckpt/step_40")


def lost_n2(spec_=None, *, lost=("j-a1-n2",), **kw) -> rc.JobSnapshot:
    """Node 2 of attempt 1 was lost; CONFIRM found step 40: SELECT is next."""
    inc = rc.IncidentView(
        event_id=99, attempt=1, failure_class=F.NODE_LOST, node_id=lost[0],
        steps=done(P.DETECT, P.SIGNAL, P.CONFIRM_CHECKPOINT), confirmed=CONFIRMED,
    )  # fmt: skip
    a = full_attempt(vanished=lost[1:])
    return snap(status=S.RECOVERING, incident=inc, attempt=a, spec=spec_ or spec(), **kw)


def selection(s: rc.JobSnapshot) -> rc.FinishStep:
    out = rc.decide(s)
    fin = next(x for x in out if isinstance(x, rc.FinishStep))
    assert fin.step is P.SELECT_REPLACEMENT
    return fin


# --- the weighing ---------------------------------------------------------------------------


def test_a_long_expected_provisioning_shrinks_onto_the_survivors():
    got = el.choose_shrink(spec(), 2, provision_s=(600.0,), startup_s=(30.0,))
    assert got.shrink and got.nodes == 2
    # 2/3 of (600 - 30) s trains meanwhile: 380 s, against a 30 s grow
    assert "train 380 s of full-speed work" in got.reason and "600 s" in got.reason


def test_a_replacement_expected_sooner_than_the_reshapes_pay_for_is_waited_for():
    got = el.choose_shrink(spec(), 2, provision_s=(40.0,), startup_s=(30.0,))
    assert not got.shrink and got.nodes == 3 and got.reason.startswith("wait:")


def test_the_expected_provisioning_is_the_median_of_the_measured_launches():
    p, source = el.expected_provision_s((50.0, 400.0, 90.0), spec(), el.ElasticConfig())
    assert (p, source) == (90.0, "median of 3 measured launches")


def test_with_nothing_measured_the_specs_expected_provisioning_is_used_then_the_default():
    mine = spec(expected_provision_s=900.0)
    assert el.expected_provision_s((), mine, el.ElasticConfig())[0] == 900.0
    assert (
        el.expected_provision_s((), spec(), el.ElasticConfig(default_provision_s=77.0))[0] == 77.0
    )


def test_below_min_nodes_the_job_waits_whatever_the_provisioning_costs():
    got = el.choose_shrink(spec(), 1, provision_s=(3600.0,))
    assert not got.shrink and "below min_nodes 2" in got.reason


def test_a_job_without_min_nodes_never_shrinks():
    got = el.choose_shrink(spec(min_nodes=None), 2, provision_s=(3600.0,))
    assert not got.shrink and "not an elastic job" in got.reason


def test_the_spec_can_say_always_or_never():
    assert el.choose_shrink(spec(shrink="always"), 2, provision_s=(1.0,)).shrink
    assert not el.choose_shrink(spec(shrink="never"), 2, provision_s=(3600.0,)).shrink


def test_work_that_ends_on_the_survivors_before_the_replacement_comes_shrinks_without_a_grow():
    # 10 steps of 0.5 s on 2/3 of the nodes: 7.5 s, long before a 100 s replacement,
    # although the 2/3 x 80 s gained would not pay 1.5x a 60 s grow
    got = el.choose_shrink(
        spec(), 2, provision_s=(100.0,), startup_s=(20.0,), steps_left=10, step_time_s=0.5,
        cfg=el.ElasticConfig(margin=10.0),
    )  # fmt: skip
    assert got.shrink and "no grow needed" in got.reason


# --- SELECT --------------------------------------------------------------------------------


def test_a_lost_node_of_an_elastic_job_shrinks_the_group_and_launches_its_replacement_as_standby():
    sel = selection(lost_n2(provision_s=(600.0,)))
    r = sel.result
    assert isinstance(r, rc.Selection)
    assert r.verb is rc.LaunchVerb.SHRINK
    assert r.keep == ("j-a1-n0", "j-a1-n1") and r.train_nodes == 2
    assert r.placement.num_nodes == 3  # the full size: the third is the standby
    # the global batch 12 is kept: 6 per rank on 2 ranks, micro-batch 2 x 3 accumulation
    assert r.placement.knobs == TrainingKnobs(micro_batch=2, grad_accum=3)
    assert "train at once as a group of 2" in sel.detail and "shrink:" in sel.detail


def test_with_elastic_batch_scale_the_shrunk_group_keeps_the_per_rank_batch():
    sel = selection(lost_n2(spec(batch="scale"), provision_s=(600.0,)))
    # 12 x 2/3 = 8 on 2 ranks: 4 per rank, micro-batch 2 x 2 (as on 3 ranks)
    assert sel.result.placement.knobs == TrainingKnobs(micro_batch=2, grad_accum=2)


def test_a_job_without_min_nodes_waits_for_the_replacement_beside_its_survivors():
    sel = selection(lost_n2(spec(min_nodes=None), provision_s=(600.0,)))
    assert sel.result.verb is rc.LaunchVerb.JOIN_SURVIVORS and sel.result.train_nodes is None


def test_a_fast_replacement_is_waited_for_and_the_select_step_says_why():
    sel = selection(lost_n2(provision_s=(30.0,)))
    assert sel.result.verb is rc.LaunchVerb.JOIN_SURVIVORS
    assert "wait:" in sel.detail and "replacement expected in 30 s" in sel.detail


def test_two_nodes_lost_of_three_with_min_nodes_two_waits_for_a_full_set():
    s = lost_n2(provision_s=(600.0,), lost=("j-a1-n2", "j-a1-n1"))
    sel = selection(
        replace(
            s, attempt=replace(s.attempt, nodes=(node(0), node(1, hb=1)), vanished=("j-a1-n1",))
        )
    )
    assert sel.result.verb is rc.LaunchVerb.JOIN_SURVIVORS
    assert sel.result.keep == ("j-a1-n0",)
    assert "below min_nodes 2" in sel.detail


def test_a_launcher_that_refills_its_cluster_is_not_shrunk_and_says_so():
    refills = replace(KEEPS, refills_clusters=True)
    sel = selection(lost_n2(provision_s=(600.0,), abilities=refills))
    assert sel.result.verb is rc.LaunchVerb.REFILL
    assert "not shrinking: a refill keeps the group whole" in sel.detail


def test_the_shrink_is_recorded_with_its_training_group_size():
    s = lost_n2(provision_s=(600.0,))
    sel = selection(s)
    steps = {**s.incident.steps, **done(P.SELECT_REPLACEMENT)}
    inc = replace(s.incident, steps=steps, selection=sel.result)
    out = rc.decide(replace(s, incident=inc))
    rec = next(x for x in out if isinstance(x, rc.RecordAttempt))
    assert rec.verb is rc.LaunchVerb.SHRINK and rec.train_nodes == 2 and rec.number == 2
    assert (rec.resume_step, rec.stage_from) == (40, "file:///ckpt/step_40")


# --- the spare: grow, or run on shrunk ------------------------------------------------------


def spare_node(hb: float = 1.0, **kw) -> rc.NodeView:
    return replace(node(2, 2, hb=hb, ranks=False), **kw)


def test_a_validated_shrunk_group_grows_once_its_replacement_registered():
    out = rc.decide(snap(attempt=shrunk_attempt((spare_node(),), up=True)))
    assert len(out) == 1 and isinstance(out[0], rc.RecordFailure)
    grow = out[0]
    assert (grow.kind, grow.failure_class) == (EventKind.GROW, F.ELASTIC_GROW)
    assert "growing from 2 to 3 nodes at the next step boundary" in grow.message


def test_a_shrunk_group_trains_on_while_its_replacement_provisions():
    booting = rc.LaunchProgress(rc.LaunchPhase.PROVISIONING, "booting")
    assert rc.decide(snap(attempt=shrunk_attempt(progress=booting))) == []


def test_a_grow_waits_for_the_shrunk_group_to_validate_first():
    a = replace(shrunk_attempt((spare_node(),), up=True), validated_step=None)
    assert not any(isinstance(x, rc.RecordFailure) for x in rc.decide(snap(attempt=a)))


@pytest.mark.parametrize(
    ("spare", "why"),
    [
        (dict(progress=rc.LaunchProgress(rc.LaunchPhase.FAILED, "no capacity", True)),
         "its launch failed: no capacity"),
        (dict(spare_nodes=(spare_node(hb=45.0),), up=True), "j-a2-n2 silent for 45 s"),
        (dict(spare_nodes=(spare_node(alive=False),), up=True), "j-a2-n2 is gone"),
        (dict(failures=(rc.Failure(5, "health_check", F.HEALTH_CHECK_FAILED, ago(1),
                                   node_id="j-a2-n2", message="disk full"),)),
         "j-a2-n2: health_check_failed: disk full"),
    ],
)  # fmt: skip
def test_a_replacement_that_fails_is_given_back_and_the_job_runs_on_shrunk_saying_so(spare, why):
    out = rc.decide(snap(attempt=shrunk_attempt(**spare)))
    note, release = out
    assert isinstance(note, rc.RecordNote) and note.kind is EventKind.ELASTIC
    assert why in note.message and "training goes on at 2 of 3 nodes (min_nodes 2)" in note.message
    assert release == rc.ReleaseSpare(2, release.reason) and why in release.reason


def test_a_replacement_never_provisioned_within_the_timeout_is_given_back():
    s = snap(attempt=replace(shrunk_attempt(), requested_at=ago(1000.0)))
    note, _release = rc.decide(s)
    assert "not provisioned after 1000 s (provision_timeout_s 900)" in note.message


def test_a_given_back_spare_asks_for_nothing_until_the_wait_passed():
    a = shrunk_attempt(released=True, tries=1, released_at=ago(59.0))
    assert rc.decide(snap(attempt=a)) == []


def test_a_given_back_spare_is_asked_for_again_past_the_given_back_ones_ranks():
    (ask,) = rc.decide(snap(attempt=shrunk_attempt(released=True, tries=1, released_at=ago(61))))
    assert isinstance(ask, rc.LaunchSpare)
    assert (ask.attempt, ask.count, ask.node_rank_base, ask.tries) == (2, 1, 3, 2)
    assert "asking again for 1 replacement (try 2, 61 s after the last" in ask.reason


@pytest.mark.parametrize(("tries", "wait"), [(0, 60), (1, 60), (2, 120), (3, 240), (9, 900)])
def test_each_try_doubles_the_wait_before_the_next_up_to_a_cap(tries, wait):
    assert el.spare_wait_s(tries, el.ElasticConfig()) == wait


def test_a_later_try_waits_its_doubled_wait_and_ranks_past_every_earlier_try():
    a = shrunk_attempt(released=True, tries=3, released_at=ago(239))
    assert rc.decide(snap(attempt=a)) == []
    (ask,) = rc.decide(snap(attempt=replace(a, spare=replace(a.spare, released_at=ago(241)))))
    assert (ask.node_rank_base, ask.tries) == (2 + 3, 4)


def test_a_job_that_ends_before_a_replacement_would_be_up_runs_on_and_says_so():
    ending = rc.RankView(rank=0, step=50, resumed_step=40, step_time=0.5, max_steps=60)
    group = (replace(node(0, 2), ranks=(ending,)), replace(node(1, 2), ranks=(ending,)))
    a = replace(shrunk_attempt(released=True, tries=1, released_at=ago(61)), nodes=group)
    (note,) = rc.decide(snap(attempt=a))
    assert isinstance(note, rc.RecordNote) and note.kind is EventKind.ELASTIC
    assert "the 10 steps left end on 2 nodes in 5 s, before a replacement" in note.message
    assert "running on at 2" in note.message


def test_a_launcher_that_cannot_launch_beside_a_group_runs_on_and_says_so():
    refills = rc.LauncherAbilities(restarts_in_place=True, refills_clusters=True)
    a = shrunk_attempt(released=True, tries=1, released_at=ago(61))
    (note,) = rc.decide(snap(attempt=a, abilities=refills))
    assert isinstance(note, rc.RecordNote)
    assert "cannot launch nodes beside a running group" in note.message


def test_an_attempt_placed_on_fewer_nodes_asks_for_the_missing_ones():
    two = replace(full_attempt(), num_nodes=2, nodes=(node(0), node(1)), up_at=ago(61))
    (ask,) = rc.decide(snap(attempt=two))
    assert (ask.attempt, ask.count, ask.node_rank_base, ask.tries) == (1, 1, 2, 1)
    assert rc.decide(snap(attempt=replace(two, up_at=ago(30)))) == []


def test_a_job_without_min_nodes_placed_on_all_its_nodes_asks_for_nothing():
    assert rc.decide(snap(attempt=full_attempt(), spec=spec(None))) == []


def test_a_later_trys_provisioning_timeout_counts_from_its_own_request():
    late = replace(shrunk_attempt(tries=2, asked_at=ago(100)), requested_at=ago(1000))
    assert rc.decide(snap(attempt=late)) == []
    lost = replace(late, spare=replace(late.spare, asked_at=ago(1000)))
    note, release = rc.decide(snap(attempt=lost))
    assert "not provisioned after 1000 s" in note.message and note.key == "t2"
    assert isinstance(release, rc.ReleaseSpare)


# --- the grow's incident --------------------------------------------------------------------


def grow_incident(*steps: P, **kw) -> rc.IncidentView:
    return rc.IncidentView(
        event_id=120, attempt=2, failure_class=F.ELASTIC_GROW, steps=done(P.DETECT, *steps), **kw
    )


def test_a_grow_asks_every_rank_to_save_at_its_next_step_boundary():
    s = snap(attempt=shrunk_attempt((spare_node(),), up=True), incident=grow_incident())
    start, cmd = rc.decide(s)
    assert start == rc.StartStep(120, P.SIGNAL)
    assert cmd.type is CommandType.CHECKPOINT_AND_STOP and cmd.attempt == 2


def test_a_grow_keeps_every_node_including_the_replacement_and_releases_none():
    a = shrunk_attempt((spare_node(),), up=True)
    s = snap(
        attempt=a, incident=grow_incident(P.SIGNAL),
        listing=rc.CheckpointListing("file:///ckpt", (40, 47), {40: "a", 47: "b"}),
    )  # fmt: skip
    out = rc.decide(s)
    fin = next(x for x in out if isinstance(x, rc.FinishStep))
    assert fin.result.step == 47  # the save at the boundary: no step lost
    assert rc.Release(2, "incident 120", keep_nodes=True, release_nodes=()) in out


def test_a_grow_restarts_the_group_and_its_replacement_in_place_at_the_full_size():
    a = shrunk_attempt((spare_node(),), up=True)
    inc = grow_incident(P.SIGNAL, P.CONFIRM_CHECKPOINT, confirmed=rc.ConfirmedCheckpoint(47, "u"))
    sel = selection(snap(attempt=a, incident=inc, status=S.RECOVERING))
    r = sel.result
    assert r.remedy is RecoveryAction.GROW_BACK and r.verb is rc.LaunchVerb.JOIN_SURVIVORS
    assert r.keep == ("j-a2-n0", "j-a2-n1", "j-a2-n2")
    assert r.placement.num_nodes == 3 and r.placement.knobs == KNOBS  # 2 x 2 x 3 again


def test_a_grow_is_never_refused_by_the_restart_limit():
    a = shrunk_attempt((spare_node(),), up=True)
    inc = grow_incident(P.SIGNAL, P.CONFIRM_CHECKPOINT, confirmed=rc.ConfirmedCheckpoint(47, "u"))
    sel = selection(snap(attempt=a, incident=inc, status=S.RECOVERING, restarts_done=3))
    assert sel.outcome is O.OK
    assert rm.refuse_to_continue(
        F.NODE_LOST, None, None, (), restarts_done=3, max_restarts=3, max_same_user_error=2,
        max_same_anomaly=2, on_anomaly="rollback",
    )  # fmt: skip


def test_another_failure_of_a_shrunk_group_gives_its_spare_back_with_the_lost_node():
    a = shrunk_attempt((spare_node(),), up=True)
    inc = rc.IncidentView(
        event_id=121, attempt=2, failure_class=F.NODE_LOST, node_id="j-a2-n1",
        steps=done(P.DETECT, P.SIGNAL),
    )  # fmt: skip
    s = snap(
        attempt=a, incident=inc, listing=rc.CheckpointListing("file:///ckpt", (40,), {40: "a"})
    )
    release = next(x for x in rc.decide(s) if isinstance(x, rc.Release))
    assert release.keep_nodes and set(release.release_nodes) == {"j-a2-n1", "j-a2-n2"}


def test_a_grow_yields_to_a_failure_reported_beside_it():
    grow = rc.Failure(11, EventKind.GROW, F.ELASTIC_GROW, ago(2), message="grow")
    lost = rc.Failure(12, EventKind.NODE_LOST, F.NODE_LOST, ago(1), node_id="j-a2-n0")
    assert rc.primary_cause((grow, lost), ("j-a2-n0", "j-a2-n1")) is lost


# --- the spec -------------------------------------------------------------------------------


def test_an_elastic_global_batch_that_does_not_split_over_a_smaller_world_is_refused_by_name():
    doc = spec().model_dump(exclude_unset=True)
    doc["model"]["global_batch"] = 9  # 9 over 3 ranks, not over 2
    with pytest.raises(SpecError, match=r"global_batch 9 cannot be split evenly over 2 ranks"):
        validate_job_spec(doc)


def test_a_scaled_global_batch_must_scale_to_a_whole_batch():
    doc = spec(batch="scale").model_dump(exclude_unset=True)
    doc["model"]["global_batch"] = 10  # not a whole batch per rank on the full 3 ranks
    with pytest.raises(SpecError, match=r"global_batch 10 does not split evenly over the full 3"):
        validate_job_spec(doc)


def test_the_work_left_the_ranks_report_is_weighed_at_select():
    """The ranks say where their run ends (``max_steps``): 5 steps of 0.5 s left end
    on the 2 survivors long before even a 30 s replacement, so they train now."""
    s = lost_n2(provision_s=(30.0,))
    ends = tuple(
        replace(n, ranks=tuple(replace(r, max_steps=55) for r in n.ranks)) for n in s.attempt.nodes
    )
    sel = selection(replace(s, attempt=replace(s.attempt, nodes=ends)))
    assert sel.result.verb is rc.LaunchVerb.SHRINK
    assert "the 5 steps left end on 2 nodes" in sel.detail and "no grow needed" in sel.detail
