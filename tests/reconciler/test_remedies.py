"""Each failure class gets its own remedy: the decisions, on hand-built snapshots."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_decide import (
    CANDIDATES,
    R1,
    SPEC,
    ago,
    attempt,
    done,
    failure,
    node,
    snap,
)

from orchestrator.domain import reconcile as rc
from orchestrator.domain import remedy as rm
from orchestrator.domain.failures import FailureClass as F
from orchestrator.domain.plan import TrainingKnobs
from orchestrator.domain.planner import FailureRecord
from orchestrator.domain.policy import RecoveryAction
from orchestrator.domain.protocol import ProtocolStep as P
from orchestrator.domain.protocol import StepOutcome as O
from orchestrator.domain.spec import validate_job_spec
from orchestrator.domain.status import JobStatus as S

MODEL = {
    "parameters": 1_300_000_000,
    "layers": 24,
    "hidden_size": 2048,
    "heads": 16,
    "seq_len": 2048,
    "global_batch": 64,
    "micro_batch": 8,
}
SPEC_WITH_MODEL = validate_job_spec({**SPEC.model_dump(exclude_none=True), "model": MODEL})


def incident(cls, steps, **kw) -> rc.IncidentView:
    return rc.IncidentView(event_id=99, attempt=1, failure_class=cls, steps=steps, **kw)


def confirmed(step=40, **more):
    return {**done(P.DETECT, P.SIGNAL, P.CONFIRM_CHECKPOINT), **more}


def chosen(step=40, verb=rc.LaunchVerb.LAUNCH, remedy=RecoveryAction.REPLACE_NODE_BLOCK_REGION):
    """CONFIRM's and SELECT's results: ``step`` confirmed, ``verb`` onto R1."""
    return dict(
        confirmed=rc.ConfirmedCheckpoint(step, f"file:///ckpt/step_{step}"),
        selection=rc.Selection(remedy, R1, verb),
    )


def select(cls, **kw) -> rc.FinishStep | list:
    inc_kw = {k: kw.pop(k) for k in ("host", "signature", "onset_step") if k in kw}
    inc = incident(cls, confirmed(), confirmed=chosen()["confirmed"], **inc_kw)
    out = rc.decide(snap(status=S.RECOVERING, incident=inc, **kw))
    return next(o for o in out if isinstance(o, rc.FinishStep))


# --- CUDA OOM: re-plan the memory, the global batch unchanged ---------------------------------


def test_an_oom_replans_to_a_smaller_setting_with_the_same_global_batch():
    a = attempt(placement=replace(R1, knobs=TrainingKnobs(8, 2, 0)))
    fin = select(F.CUDA_OOM, spec=SPEC_WITH_MODEL, attempt=a)
    assert fin.outcome is O.OK and fin.result.remedy is RecoveryAction.REPLAN_MEMORY
    k = fin.result.placement.knobs
    assert k.micro_batch * k.grad_accum * 4 == 64  # 4 data-parallel ranks
    assert (k.micro_batch, k.activation_checkpoint_every) != (8, 0)
    assert "global batch 64 kept" in fin.detail


def test_a_second_oom_at_the_smallest_setting_fails_the_job_saying_so():
    a = attempt(placement=replace(R1, knobs=TrainingKnobs(1, 16, 1)))
    fin = select(F.CUDA_OOM, spec=SPEC_WITH_MODEL, attempt=a)
    assert fin.outcome is O.FAILED and "at the smallest setting" in fin.detail


def test_an_oom_without_a_model_profile_fails_naming_what_is_missing():
    fin = select(F.CUDA_OOM)
    assert fin.outcome is O.FAILED and "no model profile" in fin.detail


def test_the_memory_planner_never_offers_a_larger_setting_after_an_oom():
    from orchestrator.domain.memory import activation_bytes

    profile = SPEC_WITH_MODEL.model
    assert profile is not None
    k = TrainingKnobs(8, 2, 0)
    seen = []
    while (k2 := rm.knobs_after_oom(SPEC_WITH_MODEL, k, 4).knobs) is not None:
        assert activation_bytes(profile, k2.micro_batch, k2.activation_checkpoint_every) < (
            activation_bytes(profile, k.micro_batch, k.activation_checkpoint_every)
        )
        seen.append(k2)
        k = k2
    assert seen and seen[-1].micro_batch == 1


# --- NaN / loss spike: roll back to before the onset ---------------------------------------


@pytest.mark.parametrize(
    "cls, complete, onset, expected",
    [
        (F.NAN_DIVERGENCE, (20, 40, 60), 47, 40),
        (F.LOSS_SPIKE, (20, 40, 60), 40, 20),  # saved at the onset: already diverged
        (F.LOSS_SPIKE, (50,), 47, None),  # nothing older: from step 0
        (F.NODE_LOST, (20, 40, 60), 47, 60),  # not an anomaly: the newest
    ],
    ids=["nan-before-onset", "spike-at-onset", "nothing-older", "not-an-anomaly"],
)
def test_confirm_rolls_an_anomaly_back_to_the_newest_checkpoint_older_than_its_onset(
    cls, complete, onset, expected
):
    listing = rc.CheckpointListing("file:///ckpt", complete)
    inc = incident(cls, done(P.DETECT, P.SIGNAL), onset_step=onset)
    out = rc.decide(snap(status=S.RECOVERING, incident=inc, listing=listing))
    fin = next(o for o in out if isinstance(o, rc.FinishStep))
    assert fin.result.step == expected


def test_the_same_anomaly_at_the_same_step_twice_fails_the_job():
    past = (rm.PastIncident(F.LOSS_SPIKE, onset_step=47),)
    fin = select(F.LOSS_SPIKE, onset_step=47, past_incidents=past)
    assert fin.outcome is O.FAILED and "loss_spike at step 47 2 times" in fin.detail
    fin = select(F.LOSS_SPIKE, onset_step=48, past_incidents=past)
    assert fin.outcome is O.OK


def test_on_anomaly_fail_stops_at_the_first_anomaly():
    spec = validate_job_spec(
        {**SPEC.model_dump(exclude_none=True), "restarts": {"on_anomaly": "fail"}}
    )
    fin = select(F.NAN_DIVERGENCE, spec=spec, onset_step=30)
    assert fin.outcome is O.FAILED and "on_anomaly: fail" in fin.detail


def test_rollback_skip_relaunches_with_the_window_past_the_onset_skipped():
    spec = validate_job_spec(
        {
            **SPEC.model_dump(exclude_none=True),
            "restarts": {"on_anomaly": "rollback_skip", "skip_after_onset": 5},
        }
    )
    steps = confirmed(
        40,
        **{
            P.SELECT_REPLACEMENT: rc.StepView(ago(3), ago(2), O.OK),
            P.STAGE: rc.StepView(ago(2), ago(1), O.OK),
        },
    )
    inc = incident(F.LOSS_SPIKE, steps, onset_step=47, **chosen())
    out = rc.decide(snap(status=S.RECOVERING, spec=spec, incident=inc))
    (rec,) = [o for o in out if isinstance(o, rc.RecordAttempt)]
    assert rec.skip_steps == (41, 52) and rec.resume_step == 40


# --- GPU hardware: never relaunch onto that host -----------------------------------------


def test_a_hardware_fault_excludes_its_host_from_every_later_placement():
    fin = select(F.GPU_HARDWARE, host="h1-1")
    assert fin.result.exclude_hosts == ("h1-1",)
    assert "host h1-1 excluded" in fin.detail
    fin = select(F.NODE_LOST, excluded_hosts=frozenset({"h1-1"}))
    assert fin.result.exclude_hosts == ("h1-1",)  # a bad host stays bad


def test_a_preemption_does_not_blame_the_host():
    assert select(F.PREEMPTION_NOTICE, host="h1-1").result.exclude_hosts == ()


# --- transport errors: same placement, no re-provisioning, with backoff -----------------------


def test_a_transport_error_restarts_in_place_without_releasing_the_nodes():
    listing = rc.CheckpointListing("file:///ckpt", (40,))
    inc = incident(F.NCCL_TRANSPORT, done(P.DETECT, P.SIGNAL))
    out = rc.decide(snap(status=S.RECOVERING, incident=inc, listing=listing))
    assert rc.Release(1, "incident 99", keep_nodes=True) in out
    fin = select(F.NCCL_TRANSPORT)
    assert fin.result.verb is rc.LaunchVerb.RESTART_IN_PLACE
    assert fin.result.placement.region == "r1"


def test_a_restart_in_place_waits_its_backoff_before_starting():
    steps = confirmed(
        40,
        **{
            P.SELECT_REPLACEMENT: rc.StepView(ago(3), ago(2), O.OK),
            P.STAGE: rc.StepView(ago(2), ago(1), O.SKIPPED),
            P.LAUNCH: rc.StepView(ago(1)),
        },
    )
    in_place = rc.LaunchVerb.RESTART_IN_PLACE
    a2 = attempt(2, validated=None, launched=False, state="launching", nodes=(), started=1,
                 verb=in_place)  # fmt: skip
    inc = incident(F.NCCL_TRANSPORT, steps, **chosen(verb=in_place))
    assert rc.decide(snap(status=S.RECOVERING, incident=inc, attempt=a2)) == []
    wait = rm.backoff_s("j", 1)
    later = replace(a2, started_at=ago(wait + 0.1))
    assert rc.decide(snap(status=S.RECOVERING, incident=inc, attempt=later)) == [
        rc.StartNodes(2, 99, in_place)
    ]


def test_backoff_doubles_is_capped_and_its_jitter_is_deterministic():
    assert rm.backoff_s("j", 0) == 0
    one, two = rm.backoff_s("j", 1), rm.backoff_s("j", 2)
    assert 5 <= one < 7.5 and 10 <= two < 15
    assert rm.backoff_s("j", 30) < 300 * 1.5
    assert rm.backoff_s("j", 3) == rm.backoff_s("j", 3) != rm.backoff_s("k", 3)


# --- capacity: cool the region for that type, re-plan, fail only when nothing is left ---------


def _refused(region: str, tries: int = 1) -> rc.AttemptView:
    fails = tuple(
        rc.LaunchFailure(ago(60), "fake", region, "cpu", capacity=True, message="no capacity")
        for _ in range(tries)
    )
    return attempt(
        validated=None, launched=False, state="launching", nodes=(), launch_failures=fails
    )


def test_a_stockout_replans_into_another_region_after_the_backoff():
    history = (FailureRecord("fake", "r1", "cpu", ago(60), "capacity_unavailable"),)
    (out,) = rc.decide(snap(status=S.PROVISIONING, attempt=_refused("r1"), history=history))
    assert isinstance(out, rc.Replan) and out.placement.region == "r2"
    assert "r1 had no capacity for cpu" in out.reason


def test_a_stockout_everywhere_fails_the_job_listing_what_was_tried():
    history = tuple(
        FailureRecord("fake", r, "cpu", ago(60), "capacity_unavailable") for r in ("r1", "r2")
    )
    out = rc.decide(snap(status=S.PROVISIONING, attempt=_refused("r1"), history=history))
    assert out[0].status is S.FAILED
    assert "no capacity anywhere: tried fake/r1/cpu" in out[0].reason
    assert "r2" in out[0].reason


def test_a_launch_refused_for_another_reason_is_retried_then_fails_naming_it():
    def failed(n: int) -> rc.AttemptView:
        fails = tuple(
            rc.LaunchFailure(ago(60), "fake", "r1", "cpu", capacity=False, message="bad image")
            for _ in range(n)
        )
        return attempt(validated=None, launched=False, state="launching", nodes=(),
                       launch_failures=fails)  # fmt: skip

    # a transient failure (a package fetch that timed out) gets another try, after a wait
    # each try is a request of its own (keyed by the try): never the failed one adopted
    launch = rc.LaunchVerb.LAUNCH
    assert rc.decide(snap(status=S.PROVISIONING, attempt=failed(1))) == [
        rc.StartNodes(1, None, launch, launch_try=1)
    ]
    assert rc.decide(snap(status=S.PROVISIONING, attempt=failed(2))) == [
        rc.StartNodes(1, None, launch, launch_try=2)
    ]
    out = rc.decide(snap(status=S.PROVISIONING, attempt=failed(3)))  # past launch_retries
    assert out[0].status is S.FAILED and "launch failed 3 times: bad image" in out[0].reason


def test_a_task_the_provider_refused_fails_at_once_it_would_be_refused_again():
    fails = (rc.LaunchFailure(ago(60), "fake", "r1", "cpu", False, "bad YAML", retryable=False),)
    a = attempt(validated=None, launched=False, state="launching", nodes=(), launch_failures=fails)
    out = rc.decide(snap(status=S.PROVISIONING, attempt=a))
    assert out[0].status is S.FAILED and "bad YAML" in out[0].reason


def test_capacity_cools_only_that_instance_type_in_that_region():
    from orchestrator.domain.planner import rank

    cands = (*CANDIDATES, replace(CANDIDATES[0], instance_type="gpu"))
    history = (FailureRecord("fake", "r1", "cpu", ago(60), "capacity_unavailable"),)
    ranked = rank(SPEC, cands, history, ago(0)).ranked
    assert {(r.placement.region, r.placement.instance_type) for r in ranked} == {
        ("r2", "cpu"),
        ("r1", "gpu"),
    }


# --- user code errors: fail fast on the second identical exception --------------------------


def test_the_second_identical_user_error_fails_fast_a_different_one_retries():
    sig = "KeyError: 'input_ids'"
    past = (rm.PastIncident(F.USER_CODE_ERROR, signature=sig),)
    fin = select(F.USER_CODE_ERROR, signature=sig, past_incidents=past)
    assert fin.outcome is O.FAILED and "the same user code error 2 times: KeyError" in fin.detail
    fin = select(F.USER_CODE_ERROR, signature="TypeError: <n> args", past_incidents=past)
    assert fin.outcome is O.OK


# --- slow nodes: replaced at the next checkpoint, its own class ------------------------------


def test_one_straggler_report_is_noise_three_replace_the_node_after_a_save():
    slow = [
        rc.Failure(10 + k, "anomaly", F.SLOW_PEER, ago(3 - k), node_id="j-a1-n1", step=50 + k)
        for k in range(3)
    ]
    assert rc.decide(snap(failures=tuple(slow[:2]))) == []
    out = rc.decide(snap(failures=tuple(slow)))
    assert isinstance(out[0], rc.OpenIncident) and out[0].cause.failure_class is F.SLOW_PEER
    inc = incident(F.SLOW_PEER, done(P.DETECT))
    out = rc.decide(snap(status=S.RECOVERING, incident=inc))
    assert out[1].type == "checkpoint_and_stop"  # every node is alive: save first
    assert select(F.SLOW_PEER, host="h1-1").result.exclude_hosts == ("h1-1",)


# --- causes and consequences ----------------------------------------------------------------


def test_the_survivors_crashes_after_a_lost_node_are_its_consequences():
    survivor = failure(F.NODE_LOST, "rank_exit", "j-a1-n1", code=1, id_=5)
    torn = failure(F.EXTERNAL_TERMINATION, "rank_exit", "j-a1-n1", id_=6)
    lost = failure(F.NODE_LOST, "node_lost", "j-a1-n0", id_=8)
    a = attempt(nodes=(node(0, alive=False), node(1)))
    out = rc.decide(snap(attempt=a, failures=(survivor, torn, lost)))
    assert out[0].cause == lost and out[0].consequences == (5, 6)


def test_a_transport_error_names_the_incident_over_a_peer_s_word_that_it_crashed():
    """Seen on SkyPilot (issue 19): rank 0's collective failed on a transport error;
    gloo closed its pairs and node 1's rank read 'Connection closed by peer ...
    remote worker crashing' (classed node_lost), which reached the service first.
    Both nodes spoke, so no node is missing: the transport error is the cause and the
    remedy a restart in place, not a replacement of a node that is alive."""
    heard = replace(failure(F.NODE_LOST, "rank_exit", "j-a1-n1", code=1, id_=5), occurred_at=ago(3))
    transport = failure(F.NCCL_TRANSPORT, "rank_exit", "j-a1-n0", code=1, id_=6)
    out = rc.decide(snap(failures=(heard, transport)))
    assert out[0].cause == transport and out[0].consequences == (5,)
    # The same word with the other node silent is a node loss: its loss is the cause.
    assert rc.primary_cause((heard,), ("j-a1-n0", "j-a1-n1")) == heard


def test_a_peer_s_word_alone_waits_for_the_silent_node_then_that_node_is_lost():
    """Only node 1 spoke, and node 0 looks alive (it beat 1 s ago): the service waits
    up to hearsay_wait_s for node 0's own report or the sight of its loss; then node 0,
    the one silent node, is the one lost, never node 1, the witness (seen on the
    emulated AWS: an incident named after the witness gave the survivor back)."""
    cfg = rc.ReconcileConfig()
    heard = replace(failure(F.NODE_LOST, "rank_exit", "j-a1-n1", code=1, id_=5), occurred_at=ago(3))
    assert rc.decide(snap(failures=(heard,)), cfg) == []
    late = replace(heard, occurred_at=ago(cfg.hearsay_wait_s + 1))
    (rec,) = rc.decide(snap(failures=(late,)), cfg)
    assert isinstance(rec, rc.RecordFailure) and rec.kind == "node_lost"
    assert rec.node_id == "j-a1-n0" and "j-a1-n1" in rec.message
    # Recorded, it names the incident; the witness's word is its consequence, and the
    # remedy keeps the witness's node.
    lost = failure(F.NODE_LOST, "node_lost", "j-a1-n0", id_=8)
    out = rc.decide(snap(failures=(late, lost)), cfg)
    assert out[0].cause == lost and out[0].consequences == (5,)
    # Two silent nodes of three: which one crashed is not known; the incident opens.
    a3 = attempt(nodes=(node(0), node(1), node(2)))
    out = rc.decide(snap(attempt=a3, failures=(late,)), cfg)
    assert isinstance(out[0], rc.OpenIncident)
    # Node 0 seen gone meanwhile: its loss is recorded at once, it names the incident.
    a = attempt(nodes=(node(0, alive=False), node(1)))
    out = rc.decide(snap(attempt=a, failures=(heard,)), cfg)
    assert isinstance(out[0], rc.RecordFailure) and out[0].node_id == "j-a1-n0"


def test_hearsay_from_every_node_waits_for_the_crashed_rank_s_own_report():
    """Rank 0's collective failed on a transport error; torchrun SIGTERMed rank 1 on
    the same node, and both nodes' other ranks read the broken pairs as a peer's crash
    (classed node_lost). Their word reached the service before rank 0's own exit
    report (seen here on the local launcher): every node spoke, but only hearsay, so
    the service waits for the report that names the cause rather than call a live
    node lost."""
    cfg = rc.ReconcileConfig()
    n0 = replace(failure(F.NODE_LOST, "rank_exit", "j-a1-n0", code=-15, id_=5), occurred_at=ago(1))
    n1 = replace(failure(F.NODE_LOST, "rank_exit", "j-a1-n1", code=1, id_=6), occurred_at=ago(1))
    assert rc.decide(snap(failures=(n0, n1)), cfg) == []
    transport = failure(F.NCCL_TRANSPORT, "rank_exit", "j-a1-n0", code=1, id_=7)
    out = rc.decide(snap(failures=(n0, n1, transport)), cfg)
    assert out[0].cause == transport and set(out[0].consequences) == {5, 6}
    # No such report within the wait: the incident opens on what was said.
    late = tuple(replace(f, occurred_at=ago(cfg.hearsay_wait_s + 1)) for f in (n0, n1))
    out = rc.decide(snap(failures=late), cfg)
    assert isinstance(out[0], rc.OpenIncident) and out[0].cause.failure_class is F.NODE_LOST


def test_hearsay_beside_the_crashed_rank_s_own_error_waits_for_the_silent_node():
    """Seen here on a loaded machine: rank 0's transport error and rank 1's "closed by
    peer" (both node 0) reached the service while node 1 had not spoken yet. Opened at
    once, the hearsay named the incident node_lost and the live node 0 was replaced;
    the service waits for node 1, then the transport error names it."""
    cfg = rc.ReconcileConfig()

    def said(cls, node_id, code, id_, age):  # type: ignore[no-untyped-def]
        return replace(failure(cls, "rank_exit", node_id, code=code, id_=id_), occurred_at=ago(age))

    transport = said(F.NCCL_TRANSPORT, "j-a1-n0", -6, 4, 1)
    heard = said(F.NODE_LOST, "j-a1-n0", -15, 5, 1)
    assert rc.decide(snap(failures=(transport, heard)), cfg) == []
    peer = said(F.NODE_LOST, "j-a1-n1", 1, 6, 0.5)
    out = rc.decide(snap(failures=(transport, heard, peer)), cfg)
    assert isinstance(out[0], rc.OpenIncident)
    assert out[0].cause == transport and set(out[0].consequences) == {5, 6}
    # Node 1 still silent past the wait: it is the node the peers heard crash.
    late = tuple(replace(f, occurred_at=ago(cfg.hearsay_wait_s + 1)) for f in (transport, heard))
    (rec,) = rc.decide(snap(failures=late), cfg)
    assert isinstance(rec, rc.RecordFailure) and rec.node_id == "j-a1-n1"


def test_a_rank_s_oom_names_the_incident_over_its_peers_timeouts():
    timeout = failure(F.NCCL_TIMEOUT, "rank_exit", "j-a1-n0", code=1, id_=4)
    oom = failure(F.CUDA_OOM, "rank_exit", "j-a1-n1", code=1, id_=5)
    out = rc.decide(snap(failures=(timeout, oom)))
    assert out[0].cause == oom and out[0].consequences == (4,)


def test_ranks_that_hold_a_diverged_state_are_stopped_without_a_save():
    """An emergency save after a spike would hold the diverged weights and push the
    good checkpoints out of retention."""
    for cls in (F.LOSS_SPIKE, F.NAN_DIVERGENCE):
        out = rc.decide(snap(status=S.RECOVERING, incident=incident(cls, done(P.DETECT))))
        assert out[1].type == "stop" and out[1].args["save"] is False
    out = rc.decide(snap(status=S.RECOVERING, incident=incident(F.NODE_LOST, done(P.DETECT))))
    assert "save" not in out[1].args


# --- the collective timeout comes from what the job measured ---------------------------------


@pytest.mark.parametrize(
    "step_s, save_s, expected",
    [
        (None, None, None),  # nothing measured: torch's default stays
        (0.5, None, 60),  # a fast job: the floor (start-up)
        (2.0, 9.0, 90),  # a long blocking save dominates
        (120.0, None, 600),  # never past torch's own default
    ],
    ids=["unmeasured", "floor", "save-dominates", "cap"],
)
def test_the_collective_timeout_is_ten_times_the_slowest_measured_wait(step_s, save_s, expected):
    from orchestrator.domain.advisor import collective_timeout_s

    assert collective_timeout_s(step_s, save_s) == expected


def test_a_relaunch_carries_the_timeout_derived_from_the_failed_attempt():
    ranks = tuple(rc.RankView(rank=i, step=50, report_age_s=0.2, step_time=3.0) for i in range(2))
    a = attempt(nodes=(replace(node(0), ranks=ranks), node(1)))
    steps = confirmed(
        40,
        **{
            P.SELECT_REPLACEMENT: rc.StepView(ago(3), ago(2), O.OK),
            P.STAGE: rc.StepView(ago(2), ago(1), O.OK),
        },
    )
    inc = incident(F.NODE_LOST, steps, **chosen())
    out = rc.decide(snap(status=S.RECOVERING, incident=inc, attempt=a, blocking_save_s=1.0))
    (rec,) = [o for o in out if isinstance(o, rc.RecordAttempt)]
    assert rec.collective_timeout_s == 60  # 10 x 3 s step < the 60 s floor


def test_checkpoints_a_rollback_went_past_are_never_resumed_by_a_later_incident():
    listing = rc.CheckpointListing("file:///ckpt", (20, 30, 40), {20: "a", 30: "b", 40: "c"})
    spike = incident(F.LOSS_SPIKE, done(P.DETECT, P.SIGNAL), onset_step=30)
    out = rc.decide(snap(status=S.RECOVERING, incident=spike, listing=listing))
    fin = next(o for o in out if isinstance(o, rc.FinishStep))
    assert fin.result.step == 20 and fin.result.poisoned == {30: "b", 40: "c"}
    # The next incident (another class) before the run saved step 30 again: from 20.
    lost = incident(F.NODE_LOST, done(P.DETECT, P.SIGNAL))
    poisoned = frozenset({(30, "b"), (40, "c")})
    out = rc.decide(snap(status=S.RECOVERING, incident=lost, listing=listing, poisoned=poisoned))
    assert next(o for o in out if isinstance(o, rc.FinishStep)).result.step == 20
    # Once step 30 was saved again (a new manifest), it is a good checkpoint.
    again = rc.CheckpointListing("file:///ckpt", (20, 30), {20: "a", 30: "new"})
    out = rc.decide(snap(status=S.RECOVERING, incident=lost, listing=again, poisoned=poisoned))
    assert next(o for o in out if isinstance(o, rc.FinishStep)).result.step == 30


def test_a_vanished_node_names_the_incident_whatever_its_survivors_logs_say():
    """Seen in the demo: a survivor's log read as a user error (a DDP warning line);
    the node the reconciler saw vanish is still the cause, the rest consequences."""
    survivor = failure(F.USER_CODE_ERROR, "rank_exit", "j-a1-n1", code=1, id_=5)
    lost = failure(F.NODE_LOST, "node_lost", "j-a1-n0", id_=8)
    a = attempt(nodes=(node(0, alive=False), node(1)))
    out = rc.decide(snap(attempt=a, failures=(survivor, lost)))
    assert out[0].cause == lost and out[0].consequences == (5,)
