"""The loop tells the truth (issue 27), on hand-built snapshots at a fixed NOW.

A finished run ends SUCCEEDED in every state; no fixed timer stops training that
shows work; each incident step says only what a report shows; a script that sends no
progress reports runs under the plain-script contract, said once, in one event.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from orchestrator.contract import EventKind
from orchestrator.domain import reconcile as rc
from orchestrator.domain.failures import FailureClass as F
from orchestrator.domain.plan import Placement
from orchestrator.domain.protocol import ORDER
from orchestrator.domain.protocol import ProtocolStep as P
from orchestrator.domain.protocol import StepOutcome as O
from orchestrator.domain.spec import validate_job_spec
from orchestrator.domain.status import JobStatus as S

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
R1 = Placement("fake", "r1", "cpu", None, 0, 2, True, price_per_node_hour=0.5)


def ago(s: float) -> datetime:
    return NOW - timedelta(seconds=s)


def spec(**over):
    doc = {
        "name": "j",
        "task": {"template": "local", "command": "python train.py"},
        "num_nodes": 2,
        "ranks_per_node": 2,
        "checkpoint": {"uri": "file:///ckpt"},
        "restarts": {"heartbeat_timeout_s": 30.0, "grace_period_s": 60.0},
    }
    for key, value in over.items():
        doc[key] = {**doc[key], **value} if isinstance(doc.get(key), dict) else value
    return validate_job_spec(doc)


SPEC = spec()
PLAIN_OWN = spec(
    task={"framework": "plain"},
    checkpoint={"own": {"path": "/shared/snapshot.pt", "resume_arg": "--snapshot_path"}},
)


def rank(k: int, **kw) -> rc.RankView:
    """A rank of a script that reports (training.Run): resumed at 0, at step 50."""
    return rc.RankView(**{"rank": k, "step": 50, "resumed_step": 0, "report_age_s": 0.2, **kw})


def quiet(k: int, idle: float | None = 0.5, **kw) -> rc.RankView:
    """A rank of a plain script: no datagram ever, CPU used ``idle`` seconds ago."""
    return rc.RankView(rank=k, cpu_idle_s=idle, **kw)


def node(k: int, *, attempt: int = 1, ranks=None, **kw) -> rc.NodeView:
    base = dict(
        node_id=f"j-a{attempt}-n{k}",
        node_rank=k,
        last_heartbeat_at=ago(1),
        alive=True,
        ranks=tuple(ranks if ranks is not None else (rank(2 * k), rank(2 * k + 1))),
        address=f"10.0.0.{k + 2}",
    )
    return rc.NodeView(**{**base, **kw})


def finished_node(k: int, *, attempt: int = 1, **kw) -> rc.NodeView:
    return node(
        k, attempt=attempt, exited=True, exit_code=0, exit_reason="all ranks exited 0", **kw
    )


def attempt(number=1, *, nodes=None, up=120.0, validated=None, expected=None, **kw):
    return rc.AttemptView(
        number=number,
        state=kw.pop("state", "running"),
        started_at=ago(up + 5),
        requested_at=ago(up + 5),
        up_at=ago(up),
        num_nodes=2,
        ranks_per_node=2,
        expected_step=expected,
        validated_step=validated,
        placement=R1,
        nodes=tuple(
            nodes if nodes is not None else (node(0, attempt=number), node(1, attempt=number))
        ),
        **kw,
    )


def snap(**kw) -> rc.JobSnapshot:
    base = dict(
        job_id="j",
        status=S.RUNNING,
        now=NOW,
        spec=SPEC,
        attempt=attempt(validated=0),
        abilities=rc.LauncherAbilities(restarts_in_place=True),
    )
    return rc.JobSnapshot(**{**base, **kw})


def incident(upto: P, *, attempt_=1, cls=F.PREEMPTION_NOTICE, **steps) -> rc.IncidentView:
    """An incident whose steps before ``upto`` are done, ``upto`` itself started."""
    views = {}
    for p in ORDER:
        if p is upto:
            views[p] = rc.StepView(ago(3))
            break
        views[p] = rc.StepView(ago(10), ago(9), O.OK)
    return rc.IncidentView(event_id=99, attempt=attempt_, failure_class=cls, steps=views, **steps)


def statuses(out) -> list[S]:
    return [o.status for o in out if isinstance(o, rc.SetStatus)]


# --- 1. each job ends true ---------------------------------------------------------------


def test_a_finished_relaunch_ends_succeeded():
    """The issue's run: attempt 2 ran all its epochs, every node exited 0, and 42 s later
    the validate timer declared it stuck. Now the finish is read before any timer."""
    a2 = attempt(2, nodes=(finished_node(0, attempt=2), finished_node(1, attempt=2)), up=342)
    out = rc.decide(snap(status=S.PROVISIONING, attempt=a2, incident=incident(P.VALIDATE)))
    assert statuses(out) == [S.RUNNING, S.SUCCEEDED]
    assert not any(isinstance(o, rc.RecordFailure | rc.OpenIncident) for o in out)
    (validate,) = [o for o in out if isinstance(o, rc.FinishStep)]
    assert validate.step is P.VALIDATE and validate.outcome is O.OK
    assert "every rank exited 0" in validate.detail and "never reported" in validate.detail
    assert rc.Release(2, "finished") in out


@pytest.mark.parametrize("step", [p for p in ORDER if p is not P.DETECT], ids=str)
def test_an_attempt_whose_every_rank_exited_zero_succeeds_at_every_incident_step(step):
    """A notice arrived, and the ranks finished before the stop reached them: the job is
    done, whichever step the incident was at; the incident is closed, not left open."""
    a1 = attempt(1, validated=0, nodes=(finished_node(0), finished_node(1)))
    out = rc.decide(snap(status=S.RECOVERING, attempt=a1, incident=incident(step)))
    assert statuses(out) == [S.RUNNING, S.SUCCEEDED]
    closed = {o.step: o.outcome for o in out if isinstance(o, rc.FinishStep)}
    assert closed[P.VALIDATE] is O.SKIPPED
    if step is not P.VALIDATE:
        assert closed[step] is O.SKIPPED
    assert not any(isinstance(o, rc.SendCommand | rc.RecordAttempt) for o in out)


def test_a_finished_run_without_an_incident_says_what_shows_it():
    a = attempt(validated=None, nodes=(finished_node(0), finished_node(1)))
    out = rc.decide(snap(status=S.RUNNING, attempt=a))
    (done,) = [o for o in out if isinstance(o, rc.SetStatus)]
    assert done.status is S.SUCCEEDED
    assert "every rank of attempt 1 exited 0" in done.reason and "step None" not in done.reason
    assert "last step reported 50" in done.reason


def test_a_plain_run_that_finished_does_not_claim_a_step():
    quiet_nodes = (
        finished_node(0, ranks=(quiet(0), quiet(1))),
        finished_node(1, ranks=(quiet(2), quiet(3))),
    )
    out = rc.decide(snap(attempt=attempt(nodes=quiet_nodes)))
    assert "no step was reported" in statuses_reason(out, S.SUCCEEDED)


def statuses_reason(out, status: S) -> str:
    return next(o.reason for o in out if isinstance(o, rc.SetStatus) and o.status is status)


def test_a_script_that_exits_zero_when_stopped_is_restarted_when_the_spec_says_so():
    """``exit_zero_is_success: false``: after the service asked the ranks to stop, an
    all-zero exit is a stop, and the protocol goes on."""
    s = spec(restarts={"exit_zero_is_success": False})
    a1 = attempt(1, validated=0, nodes=(finished_node(0), finished_node(1)))
    out = rc.decide(snap(spec=s, status=S.RECOVERING, attempt=a1, incident=incident(P.SIGNAL)))
    assert S.SUCCEEDED not in statuses(out)
    (fin,) = out
    assert fin.step is P.SIGNAL and fin.outcome is O.OK
    # Without a stop asked for, exit 0 is success all the same.
    assert S.SUCCEEDED in statuses(rc.decide(snap(spec=s, attempt=a1)))


def test_one_node_still_running_is_not_a_finish():
    a = attempt(validated=0, nodes=(finished_node(0), node(1)))
    assert S.SUCCEEDED not in statuses(rc.decide(snap(attempt=a)))


# --- 2. no fixed timer kills training ------------------------------------------------------


def _unvalidated(ranks_of, up: float, **kw) -> rc.AttemptView:
    return attempt(
        validated=None,
        up=up,
        nodes=(node(0, ranks=ranks_of(0)), node(1, ranks=ranks_of(1))),
        **kw,
    )


def test_training_that_makes_steps_is_never_stopped_for_a_missing_resume_report():
    """Ranks step on (their reports are fresh) but one never said what it resumed from:
    however long past the timeout, nothing is recorded against them."""

    def ranks(k):
        return (rank(2 * k), rank(2 * k + 1, resumed_step=None))

    for up in (301.0, 3_000.0, 30_000.0):
        assert rc.decide(snap(status=S.PROVISIONING, attempt=_unvalidated(ranks, up))) == []


def test_a_stuck_start_names_the_missing_report_who_owes_it_and_why_it_matters():
    def ranks(k):
        return (quiet(2 * k, idle=200.0), quiet(2 * k + 1, idle=200.0))

    (stuck,) = rc.decide(snap(status=S.PROVISIONING, attempt=_unvalidated(ranks, 301.0)))
    assert isinstance(stuck, rc.RecordFailure) and stuck.kind is EventKind.STUCK
    assert "no resume report from ranks 0, 1, 2, 3" in stuck.message
    assert "no CPU used for 200 s" in stuck.message
    assert "which checkpoint and step it loaded" in stuck.message
    assert "the default" in stuck.message  # where the 300 s came from
    assert stuck.failure_class is F.NCCL_TIMEOUT  # every rank ran: the rendezvous worked


def test_ranks_whose_cpu_is_not_measured_yet_are_waited_for_one_heartbeat_timeout_more():
    """Not measured is not idle: a plain script's ranks found late on a loaded host have
    no CPU reading at the validate timeout (seen in CI: a healthy start called stuck at
    20 s, "no CPU measured"); the start is called stuck only a heartbeat timeout later."""

    def ranks(k):
        return (quiet(2 * k, idle=None), quiet(2 * k + 1, idle=None))

    hb = snap().heartbeat_timeout_s
    a = _unvalidated(ranks, 301.0)
    assert rc.decide(snap(status=S.PROVISIONING, attempt=a)) == []
    late = replace(a, up_at=ago(300.0 + hb + 1))
    (stuck,) = rc.decide(snap(status=S.PROVISIONING, attempt=late))
    assert stuck.kind is EventKind.STUCK and "no CPU measured" in stuck.message


def test_ranks_that_never_started_are_a_rendezvous_failure_naming_the_node():
    def ranks(k):
        return (quiet(0, idle=200.0), quiet(1, idle=200.0)) if k == 0 else ()

    (stuck,) = rc.decide(snap(status=S.PROVISIONING, attempt=_unvalidated(ranks, 301.0)))
    assert stuck.failure_class is F.RENDEZVOUS_FAILURE
    assert "j-a1-n1: 2 of its 2 ranks have no process its agent found" in stuck.message


def test_the_validate_timeout_comes_from_the_spec():
    def ranks(k):
        return (quiet(2 * k, idle=200.0), quiet(2 * k + 1, idle=200.0))

    s = spec(restarts={"validate_timeout_s": 1800})
    a = _unvalidated(ranks, 1000.0)
    assert rc.decide(snap(spec=s, status=S.PROVISIONING, attempt=a)) == []
    (stuck,) = rc.decide(snap(spec=s, status=S.PROVISIONING, attempt=replace(a, up_at=ago(1801))))
    assert "limit 1800 s, restarts.validate_timeout_s" in stuck.message


@pytest.mark.parametrize(
    ("measured", "limit"),
    [((), 300.0), ((10.0,), 120.0), ((50.0, 200.0), 600.0)],
    ids=["nothing-measured-default", "fast-start-floor", "longest-times-three"],
)
def test_the_validate_timeout_follows_the_measured_start_up_with_a_floor(measured, limit):
    s = snap(startup_s=measured)
    assert rc.validate_timeout_s(s, rc.ReconcileConfig())[0] == limit


def test_a_slow_measured_start_up_gives_the_next_attempt_longer():
    def ranks(k):
        return (quiet(2 * k, idle=200.0), quiet(2 * k + 1, idle=200.0))

    a = _unvalidated(ranks, 500.0)
    assert rc.decide(snap(status=S.PROVISIONING, attempt=a, startup_s=(200.0,))) == []


# --- 4. the plain-script contract ---------------------------------------------------------


def _plain_attempt(number=1, up=301.0, idle=0.5, **kw):
    return attempt(
        number,
        validated=None,
        up=up,
        nodes=(
            node(0, attempt=number, ranks=(quiet(0, idle), quiet(1, idle))),
            node(1, attempt=number, ranks=(quiet(2, idle), quiet(3, idle))),
        ),
        **kw,
    )


def test_ranks_that_send_no_reports_but_work_are_noticed_once_and_never_stopped():
    out = rc.decide(snap(status=S.PROVISIONING, attempt=_plain_attempt()))
    (note,) = [o for o in out if isinstance(o, rc.RecordNote)]
    assert note.kind is EventKind.PLAIN_SCRIPT and note.attempt == 1
    assert "send no progress reports" in note.message and "\n" not in note.message
    assert "starts from scratch" in note.message  # no checkpoint.own
    assert statuses(out) == [S.RUNNING]
    assert "from scratch" in statuses_reason(out, S.RUNNING)
    # Noticed: the next ticks say nothing more and stop nothing.
    again = snap(status=S.RUNNING, attempt=_plain_attempt(up=30_000), plain=True)
    assert rc.decide(again) == []


def test_a_plain_script_before_the_timeout_is_waited_for():
    assert rc.decide(snap(status=S.PROVISIONING, attempt=_plain_attempt(up=100))) == []


def test_a_spec_that_declares_a_plain_script_is_not_waited_for():
    out = rc.decide(snap(spec=PLAIN_OWN, status=S.PROVISIONING, attempt=_plain_attempt(up=5)))
    assert [type(o) for o in out] == [rc.RecordNote, rc.SetStatus]
    assert "passes checkpoint.own" in out[0].message


def test_a_plain_relaunch_validates_on_what_its_agents_found_of_its_own_checkpoint():
    """Nothing the script loaded is reported: VALIDATE says what the agents did (passed
    --snapshot_path where the file was), not that it resumed at some step."""
    a2 = _plain_attempt(2, up=5)
    a2 = replace(
        a2, nodes=(replace(a2.nodes[0], own_found=True), replace(a2.nodes[1], own_found=False))
    )
    s = snap(
        spec=PLAIN_OWN, status=S.PROVISIONING, attempt=a2, incident=incident(P.VALIDATE), plain=True
    )
    out = rc.decide(s)
    (fin,) = [o for o in out if isinstance(o, rc.FinishStep)]
    assert fin.step is P.VALIDATE and fin.outcome is O.OK
    assert "--snapshot_path /shared/snapshot.pt on j-a2-n0" in fin.detail
    assert "not on the others" in fin.detail and "resumed at step" not in fin.detail
    assert not any(isinstance(o, rc.RecordNote) for o in out)  # said once, for attempt 1
    assert statuses(out) == [S.RUNNING]


def test_a_plain_relaunch_whose_nodes_lack_the_checkpoint_says_from_scratch():
    a2 = _plain_attempt(2, up=5)
    a2 = replace(a2, nodes=tuple(replace(n, own_found=False) for n in a2.nodes))
    s = snap(spec=PLAIN_OWN, status=S.PROVISIONING, attempt=a2, incident=incident(P.VALIDATE))
    (fin,) = [o for o in rc.decide(s) if isinstance(o, rc.FinishStep)]
    assert "from scratch: no node had /shared/snapshot.pt" in fin.detail


def test_confirm_of_a_plain_script_says_where_the_restart_resumes_from():
    listing = rc.CheckpointListing("file:///ckpt")
    inc = incident(P.CONFIRM_CHECKPOINT)
    (own, _release) = rc.decide(snap(spec=PLAIN_OWN, incident=inc, listing=listing, plain=True))
    assert "passes --snapshot_path /shared/snapshot.pt" in own.detail
    (none, _release) = rc.decide(snap(incident=inc, listing=listing, plain=True))
    assert "restarting from scratch (step 0) (a plain script without checkpoint.own)" in none.detail
    assert "the 50 steps reported are lost" in none.detail


# --- 3. every claim rests on evidence --------------------------------------------------------


def _signalled(nodes, cls=F.PREEMPTION_NOTICE) -> rc.JobSnapshot:
    return snap(
        status=S.RECOVERING,
        attempt=attempt(validated=0, nodes=nodes),
        incident=incident(P.SIGNAL, cls=cls),
    )


def test_a_stop_whose_nodes_reported_no_save_never_says_saved():
    """The issue's incident said "every rank saved and stopped" while each rank died of
    SIGTERM and each node's exit report carried saved_step null."""

    def killed(k):
        ranks = (rank(2 * k, signal="SIGTERM"), rank(2 * k + 1, signal="SIGTERM"))
        why = f"rank {2 * k} ended with signal SIGTERM"
        return node(k, exited=True, exit_code=1, exit_reason=why, ranks=ranks)

    (fin,) = rc.decide(_signalled((killed(0), killed(1))))
    assert "saved and stopped" not in fin.detail
    assert fin.detail.startswith("every rank stopped; no save reported")
    assert (
        "j-a1-n0 stopped, no save reported (rank 0 ended with signal SIGTERM; ranks 0, 1: SIGTERM)"
        in fin.detail
    )


def test_a_stop_whose_every_node_reported_its_save_says_which_step():
    def saved(k):
        return node(
            k, exited=True, exit_code=75, saved_step=120, exit_reason="ranks saved and stopped"
        )

    (fin,) = rc.decide(_signalled((saved(0), saved(1))))
    assert fin.detail.startswith("every rank saved and stopped at step 120")
    assert "j-a1-n1 saved step 120 and stopped (exit 75)" in fin.detail


def test_a_collective_save_is_claimed_from_exit_75_and_its_step_from_rank_0_s_node():
    """Only rank 0 reports commits: the other node exits 75 with no saved_step, and the
    save (collective, committed before any rank exits) is still every rank's."""
    first = node(0, exited=True, exit_code=75, saved_step=120)
    other = node(1, exited=True, exit_code=75)
    (fin,) = rc.decide(_signalled((first, other)))
    assert fin.detail.startswith("every rank saved and stopped at step 120")
    assert "j-a1-n1 saved and stopped (exit 75)" in fin.detail


def test_a_stop_with_one_node_saved_and_one_gone_says_both():
    saved = node(0, exited=True, exit_code=75, saved_step=120)
    gone = node(1, alive=False)
    (fin,) = rc.decide(_signalled((saved, gone), cls=F.NODE_LOST))
    assert (
        "j-a1-n0 saved step 120" in fin.detail
        and "j-a1-n1 gone without an exit report" in fin.detail
    )


def test_validate_names_the_resume_reports_it_rests_on():
    nodes = (
        node(0, attempt=2, ranks=(rank(0, resumed_step=40), rank(1, resumed_step=40))),
        node(1, attempt=2, ranks=(rank(2, resumed_step=40), rank(3, resumed_step=40))),
    )
    a2 = attempt(2, nodes=nodes, expected=40, up=20)
    out = rc.decide(snap(status=S.PROVISIONING, attempt=a2, incident=incident(P.VALIDATE)))
    assert out[0].detail == "all 4 ranks resumed at step 40 (each rank's resume report)"
    assert out[0].result == rc.ResumeValidated(40)  # a measured start-up, for the next


@pytest.mark.parametrize(
    ("spec_", "plain", "confirmed", "says"),
    [
        (SPEC, False, rc.ConfirmedCheckpoint(40, "file:///ckpt/step_40"), "resuming at step_40"),
        (SPEC, False, rc.ConfirmedCheckpoint(None), "from scratch"),
        (SPEC, True, rc.ConfirmedCheckpoint(None), "from scratch"),
        (PLAIN_OWN, True, rc.ConfirmedCheckpoint(None), "passing --snapshot_path /shared"),
    ],
    ids=["checkpoint", "none", "plain-without-own", "plain-own"],
)
def test_the_relaunch_status_says_where_it_starts(spec_, plain, confirmed, says):
    sel = rc.Selection(rc.rm.remedy_for(F.PREEMPTION_NOTICE), R1, rc.LaunchVerb.LAUNCH)
    inc = replace(incident(P.LAUNCH), confirmed=confirmed, selection=sel)
    out = rc.decide(snap(spec=spec_, status=S.RECOVERING, incident=inc, plain=plain))
    assert says in statuses_reason(out, S.PROVISIONING)
