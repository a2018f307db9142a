"""Launch verbs are decisions: SELECT decides how a relaunch gets its nodes (restart in
place, join the survivors, refill the cluster, a fresh launch), the attempt records
it, LAUNCH starts it as decided, and one failed refill or restart falls back to a
fresh launch on a new cluster. Pure decisions on hand-built snapshots at a fixed NOW,
then the same against a real database with a fake launcher; teardowns count only
once the launcher confirms them; the store's records round-trip typed."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from test_decide import R1, ago, attempt, done, incident, snap
from test_protocol_store import World, preempt_node_1_after_a_save_at_40, start_running
from testkit import FakeLauncher

from orchestrator.domain import reconcile as rc
from orchestrator.domain.failures import FailureClass as F
from orchestrator.domain.planner import FailureRecord
from orchestrator.domain.policy import RecoveryAction as A
from orchestrator.domain.protocol import ProtocolStep as P
from orchestrator.domain.protocol import StepOutcome as O
from orchestrator.domain.status import JobStatus as S
from orchestrator.launchers.base import (
    DownResult,
    LaunchError,
    LaunchHandle,
    LaunchProgress,
    LaunchRequest,
    RefillRefused,
)
from orchestrator.store import records, repo
from orchestrator.store.incidents import incidents
from orchestrator.store.models import Attempt, FailureEvent

V = rc.LaunchVerb
REFILLS = rc.LauncherAbilities(restarts_in_place=True, keeps_survivors=True, refills_clusters=True)
JOINS = rc.LauncherAbilities(
    restarts_in_place=True, keeps_survivors=True, releases_single_nodes=True
)
CONFIRMED = rc.ConfirmedCheckpoint(40, "file:///ckpt/step_40")


# --- SELECT decides the verb -----------------------------------------------------------------


def _failed_attempt(cls: F, abilities: rc.LauncherAbilities, launches: int) -> rc.JobSnapshot:
    inc = rc.IncidentView(
        event_id=99, attempt=1, failure_class=cls, node_id="j-a1-n1",
        steps=done(P.DETECT, P.SIGNAL, P.CONFIRM_CHECKPOINT), confirmed=CONFIRMED,
    )  # fmt: skip
    a = attempt(hosts={"j-a1-n0": "h0", "j-a1-n1": "h1"}, launches=launches)
    return snap(status=S.RECOVERING, incident=inc, abilities=abilities, attempt=a)


def _selection(s: rc.JobSnapshot) -> rc.Selection:
    fin = next(o for o in rc.decide(s) if isinstance(o, rc.FinishStep))
    assert (fin.step, fin.outcome) == (P.SELECT_REPLACEMENT, O.OK)
    assert isinstance(fin.result, rc.Selection)
    return fin.result


@pytest.mark.parametrize(
    "cls, abilities, launches, verb, keep, region",
    [
        (F.PREEMPTION_NOTICE, REFILLS, 1, V.REFILL, ("j-a1-n0",), "r1"),
        (F.PREEMPTION_NOTICE, REFILLS, 2, V.JOIN_SURVIVORS, ("j-a1-n0",), "r1"),
        (F.PREEMPTION_NOTICE, JOINS, 1, V.JOIN_SURVIVORS, ("j-a1-n0",), "r1"),
        # nothing kept: the region that preempted us is avoided
        (F.PREEMPTION_NOTICE, rc.LauncherAbilities(restarts_in_place=True), 1, V.LAUNCH, (), "r2"),
        (F.NCCL_TRANSPORT, REFILLS, 1, V.RESTART_IN_PLACE, (), "r1"),
        (F.NCCL_TRANSPORT, JOINS, 2, V.JOIN_SURVIVORS, ("j-a1-n0", "j-a1-n1"), "r1"),
        (F.NCCL_TRANSPORT, rc.LauncherAbilities(), 1, V.LAUNCH, (), "r1"),
    ],
    ids=[
        "preempted-one-cluster-refills",
        "preempted-two-launches-join",
        "preempted-no-refill-joins",
        "preempted-nothing-kept-launches",
        "transport-restarts-in-place",
        "transport-across-launches-restarts-every-node-as-one",
        "transport-no-restart-ability-launches",
    ],
)
def test_select_decides_the_verb_from_the_failure_the_survivors_and_the_abilities(
    cls: F,
    abilities: rc.LauncherAbilities,
    launches: int,
    verb: rc.LaunchVerb,
    keep: tuple,
    region: str,
) -> None:
    sel = _selection(_failed_attempt(cls, abilities, launches))
    assert (sel.verb, sel.keep, sel.placement.region) == (verb, keep, region)


def test_a_refill_says_so_at_select() -> None:
    fin = next(
        o
        for o in rc.decide(_failed_attempt(F.PREEMPTION_NOTICE, REFILLS, 1))
        if isinstance(o, rc.FinishStep)
    )
    assert "(a refill of its cluster)" in fin.detail


# --- the verb travels: SELECT -> the attempt record -> LAUNCH ----------------------------------


def _chosen(verb: rc.LaunchVerb, keep: tuple[str, ...] = ()) -> rc.Selection:
    return rc.Selection(
        A.REPLACE_NODE_BLOCK_REGION, R1, verb, keep=keep, keep_hosts=("h0",) * len(keep)
    )


def test_the_verb_select_chose_is_recorded_with_the_attempt():
    steps = done(P.DETECT, P.SIGNAL, P.CONFIRM_CHECKPOINT, P.SELECT_REPLACEMENT)
    inc = incident(steps, confirmed=CONFIRMED, selection=_chosen(V.REFILL, ("j-a1-n0",)))
    (rec,) = [
        o
        for o in rc.decide(snap(status=S.RECOVERING, incident=inc))
        if isinstance(o, rc.RecordAttempt)
    ]
    assert (rec.verb, rec.keep, rec.keep_hosts) == (V.REFILL, ("j-a1-n0",), ("h0",))


def _relaunch(
    verb: rc.LaunchVerb,
    failures: tuple[rc.LaunchFailure, ...] = (),
    *,
    cls: F = F.PREEMPTION_NOTICE,
    **kw: object,
) -> rc.JobSnapshot:
    """Attempt 2 recorded with ``verb`` (after ``failures`` of its requests), not launched."""
    keep = ("j-a1-n0",) if verb in (V.REFILL, V.JOIN_SURVIVORS) else ()
    steps = {
        **done(P.DETECT, P.SIGNAL, P.CONFIRM_CHECKPOINT, P.SELECT_REPLACEMENT),
        P.LAUNCH: rc.StepView(ago(30)),
    }
    inc = incident(steps, cls, confirmed=CONFIRMED, selection=_chosen(verb, keep))
    a2 = attempt(
        2, validated=None, expected=40, launched=False, state="launching", nodes=(), started=30,
        verb=verb, keep=keep, launch_failures=failures,
    )  # fmt: skip
    return snap(status=S.RECOVERING, incident=inc, attempt=a2, abilities=REFILLS, **kw)


def _failed(
    verb: rc.LaunchVerb, *, capacity: bool = False, at: float = 1.0, retryable: bool = True
) -> rc.LaunchFailure:
    return rc.LaunchFailure(
        ago(at), "fake", "r1", "cpu", capacity, f"the {verb} failed", retryable, verb
    )


@pytest.mark.parametrize("verb", [V.REFILL, V.RESTART_IN_PLACE, V.JOIN_SURVIVORS, V.LAUNCH])
def test_launch_starts_the_recorded_attempt_by_the_verb_select_chose(verb: rc.LaunchVerb):
    cls = F.NCCL_TRANSPORT if verb is V.RESTART_IN_PLACE else F.PREEMPTION_NOTICE
    s = _relaunch(verb, cls=cls)
    if verb is V.RESTART_IN_PLACE:  # a restart in place waits its backoff first
        s = replace(s, attempt=replace(s.attempt, started_at=ago(600)))
    assert rc.decide(s) == [rc.StartNodes(2, 99, verb, launch_try=0)]


# --- fallbacks are decisions ---------------------------------------------------------------


def test_r1_refill_failed_then_r2_is_a_fresh_launch_at_once_with_the_kept_nodes_given_back():
    """R1 (preempted) -> R2 refill (refused: the cluster is not INIT with fewer nodes)
    -> R2 fresh launch: a new cluster (its own try, so its own key), no backoff, and
    the node the refill would have kept goes back first."""
    out = rc.decide(_relaunch(V.REFILL, (_failed(V.REFILL),)))
    assert out == [
        rc.Release(1, "the refill failed: a fresh launch replaces it"),
        rc.StartNodes(2, 99, V.LAUNCH, launch_try=1),
    ]


def test_a_failed_restart_in_place_is_never_tried_again_but_launched_fresh():
    """An exec onto an INIT cluster, or onto nodes holding another agent wheel, fails
    the same way again: the next try is new nodes."""
    out = rc.decide(
        _relaunch(V.RESTART_IN_PLACE, (_failed(V.RESTART_IN_PLACE),), cls=F.NCCL_TRANSPORT)
    )
    assert out == [
        rc.Release(1, "the restart_in_place failed: a fresh launch replaces it"),
        rc.StartNodes(2, 99, V.LAUNCH, launch_try=1),
    ]


def test_a_refill_refused_for_capacity_is_a_fresh_launch_in_another_region():
    """R1 (preempted) -> R2 refill (StopFailoverError, read as capacity) -> R2 fresh
    launch elsewhere: the kept node is given back with the re-plan (it cannot join a
    group in another region), and the re-planned attempt then starts as a launch."""
    stockout = (FailureRecord("fake", "r1", "cpu", ago(60), "capacity_unavailable"),)
    s = _relaunch(V.REFILL, (_failed(V.REFILL, capacity=True, at=60),), history=stockout)
    give_back, replan = rc.decide(s)
    assert give_back == rc.Release(1, "the refill failed: a fresh launch replaces it")
    assert isinstance(replan, rc.Replan) and replan.placement.region == "r2"
    moved = replace(s.attempt, placement=replan.placement, keep=())
    assert rc.decide(replace(s, attempt=moved)) == [rc.StartNodes(2, 99, V.LAUNCH, launch_try=1)]


def test_a_fresh_launch_after_a_fallback_is_retried_like_any_launch_without_giving_back_again():
    failures = (_failed(V.REFILL, at=120), _failed(V.LAUNCH, at=0.5))
    assert rc.decide(_relaunch(V.REFILL, failures)) == []  # its backoff first
    failures = (_failed(V.REFILL, at=120), _failed(V.LAUNCH, at=60))
    assert rc.decide(_relaunch(V.REFILL, failures)) == [
        rc.StartNodes(2, 99, V.LAUNCH, launch_try=2)
    ]


def test_the_refused_refill_does_not_count_against_the_fresh_launch_s_retries():
    cfg = rc.ReconcileConfig(launch_retries=1)
    failures = (_failed(V.REFILL, at=120), _failed(V.LAUNCH, at=60))
    assert rc.decide(_relaunch(V.REFILL, failures), cfg) == [
        rc.StartNodes(2, 99, V.LAUNCH, launch_try=2)
    ]
    failures = (*failures, _failed(V.LAUNCH, at=60))
    out = rc.decide(_relaunch(V.REFILL, failures), cfg)
    assert out[1].status is S.FAILED and "launch failed 2 times" in out[1].reason


def test_a_refill_of_a_task_the_provider_rejects_fails_the_job_instead_of_launching_it_fresh():
    out = rc.decide(_relaunch(V.REFILL, (_failed(V.REFILL, retryable=False),)))
    assert out[0].outcome is O.FAILED and out[1].status is S.FAILED


def test_a_refill_request_that_failed_after_it_was_accepted_records_its_verb():
    s = _relaunch(V.REFILL)
    failed = rc.LaunchProgress(rc.LaunchPhase.FAILED, "StopFailoverError: spot", capacity=True)
    a2 = replace(s.attempt, launched=True, up_at=None, requested_at=ago(20), provision=failed)
    assert rc.decide(replace(s, attempt=a2)) == [
        rc.LaunchRequestFailed(2, "StopFailoverError: spot", True, V.REFILL)
    ]


def test_launch_says_a_fresh_launch_replaced_the_failed_refill():
    s = _relaunch(V.REFILL, (_failed(V.REFILL),))
    up = rc.LaunchProgress(rc.LaunchPhase.UP)
    a2 = replace(s.attempt, launched=True, up_at=None, requested_at=ago(20), provision=up)
    fin = next(o for o in rc.decide(replace(s, attempt=a2)) if isinstance(o, rc.FinishStep))
    assert fin.step is P.LAUNCH and "r1: a fresh launch, after the refill failed" in fin.detail


# --- the same against a real database --------------------------------------------------------


@dataclass
class RefillingFake(FakeLauncher):
    """A fake whose clusters can be refilled; ``refuse`` makes each refill refused."""

    abilities = REFILLS
    refilled: list[LaunchRequest] = field(default_factory=list)
    refuse: bool = False

    def refill(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        self.refilled.append(request)
        if self.refuse:
            raise RefillRefused(f"{previous.cluster_name} is UP, not INIT with fewer nodes")
        return LaunchHandle(previous.cluster_name, self.name, self._ids(request), (), "rf")


@pytest.fixture
def refills(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    w = World(db_url, tmp_path)
    w.launcher = RefillingFake(tmp_path / "disks")
    w.rec = w.reconciler()
    yield w
    w.engine.dispose()


def _launch_failures(w: World) -> list[dict]:
    with w.sm() as s:
        rows = s.query(FailureEvent).filter_by(job_id=w.job, kind="launch_failed").all()
        return [dict(r.details or {}) for r in rows]


def test_a_refused_refill_is_followed_by_a_fresh_launch_of_the_whole_group(refills):
    w = refills
    w.launcher.refuse = True
    preempt_node_1_after_a_save_at_40(w)
    w.run_until_launched(2)
    assert len(w.launcher.refilled) == 1  # asked once, never again
    fresh = w.launcher.launched[-1]
    assert (fresh.attempt, fresh.launch_try, fresh.placement.num_nodes) == (2, 1, 2)
    assert fresh.launch_key == f"{w.job}-a2-t1"  # a key of its own: never the refused one
    assert f"{w.job}-a1" in w.launcher.downed  # the node the refill kept went back
    ((failure),) = _launch_failures(w)
    assert (failure["verb"], failure["capacity"]) == ("refill", False)  # no region cooled
    w.recovered(2, 40)
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
        a2 = s.query(Attempt).filter_by(job_id=w.job, number=2).one()
        assert records.launched_verb(a2) is V.LAUNCH
    assert inc["launch_verb"] == "refill" and inc["steps_lost"] == 0
    launch = next(st for st in inc["steps"] if st["step"] == "launch")
    assert "a fresh launch, after the refill failed" in launch["detail"]


def test_a_refill_that_fails_for_capacity_after_it_was_accepted_relaunches_fresh_elsewhere(
    refills,
):
    """SkyPilot's StopFailoverError on an AWS spot refill, read as capacity: the failed
    request is given back and never adopted again, and the group launches in r2."""
    w = refills
    failed = LaunchProgress(rc.LaunchPhase.FAILED, "StopFailoverError: spot", capacity=True)
    w.launcher.provisioning[f"{w.job}-a1"] = failed
    preempt_node_1_after_a_save_at_40(w)
    w.run_until_launched(2)
    assert len(w.launcher.refilled) == 1
    fresh = w.launcher.launched[-1]
    assert (fresh.attempt, fresh.placement.region, fresh.launch_try) == (2, "r2", 1)
    assert w.launcher.downed.count(f"{w.job}-a1") >= 1
    ((failure),) = _launch_failures(w)
    assert (failure["verb"], failure["capacity"], failure["region"]) == ("refill", True, "r1")


# --- teardown is confirmed --------------------------------------------------------------


@dataclass
class ConfirmingFake(FakeLauncher):
    """A fake whose down only asks: clusters in ``gone`` are confirmed gone; ``fail``
    makes the next downs raise."""

    abilities = rc.LauncherAbilities(restarts_in_place=True, confirms_down=True)
    gone: set[str] = field(default_factory=set)
    fail: int = 0

    def down(self, handle: LaunchHandle) -> None:
        if self.fail:
            self.fail -= 1
            raise LaunchError("sky.down: the API server did not answer")
        super().down(handle)

    def confirm_down(self, handle: LaunchHandle) -> DownResult:
        if handle.cluster_name in self.gone:
            return DownResult(True, f"{handle.cluster_name} is gone")
        return DownResult(False, f"{handle.cluster_name} is still listed (UP)")


def _handle(w: World, number: int) -> dict:
    with w.sm() as s:
        return dict(s.query(Attempt).filter_by(job_id=w.job, number=number).one().handle or {})


def test_a_teardown_counts_only_once_the_launcher_confirms_it(db_url, tmp_path):
    w = World(db_url, tmp_path)
    try:
        w.launcher = ConfirmingFake(tmp_path / "disks")
        w.rec = w.reconciler()
        preempt_node_1_after_a_save_at_40(w)
        w.run_until_launched(2)
        assert w.launcher.downed == [f"{w.job}-a1"]  # asked at CONFIRM
        h = _handle(w, 1)
        assert "downed" not in h and "still listed" in h["down_pending"]
        assert w.rec.finish_teardowns(w.now) == 1  # polled: still there, asked again
        assert w.launcher.downed == [f"{w.job}-a1"] * 2
        w.launcher.gone.add(f"{w.job}-a1")
        assert w.rec.finish_teardowns(w.now) == 0
        assert "downed" in _handle(w, 1) and len(w.launcher.downed) == 2
        assert w.rec.finish_teardowns(w.now) == 0  # nothing is asked of it again
        assert len(w.launcher.downed) == 2
    finally:
        w.engine.dispose()


def test_a_down_that_failed_is_asked_again_until_it_is_done(world):
    w = world
    start_running(w)
    w.launcher.abilities = rc.LauncherAbilities(restarts_in_place=True)
    flaky = {"n": 1}
    real_down = w.launcher.down

    def down(handle: LaunchHandle) -> None:
        if flaky["n"]:
            flaky["n"] -= 1
            raise LaunchError("the provider did not answer")
        real_down(handle)

    w.launcher.down = down  # type: ignore[method-assign]
    with w.sm.begin() as s:
        repo.set_status(s, w.job, S.CANCELLED, reason="operator", now=w.now)
    w.tick()  # the cancelled job's attempt is released: its down fails
    assert w.launcher.downed == [] and "downed" not in _handle(w, 1)
    assert "did not answer" in _handle(w, 1)["down_pending"]
    assert w.rec.finish_teardowns(w.now) == 0
    assert w.launcher.downed == [f"{w.job}-a1"] and "downed" in _handle(w, 1)


@pytest.fixture
def world(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    w = World(db_url, tmp_path)
    yield w
    w.engine.dispose()


def test_the_launchers_that_declare_an_ability_implement_it():
    """An ability is how the reconciler knows a method is there (it never probes the
    object): whoever declares refills_clusters or confirms_down implements it."""
    from orchestrator.launchers.local import LocalLauncher
    from orchestrator.launchers.skypilot import SkyPilotLauncher

    for cls in (SkyPilotLauncher, LocalLauncher, FakeLauncher, RefillingFake, ConfirmingFake):
        ab = cls.abilities
        assert not ab.refills_clusters or callable(getattr(cls, "refill", None)), cls
        assert not ab.confirms_down or callable(getattr(cls, "confirm_down", None)), cls
    assert SkyPilotLauncher.abilities.refills_clusters
    assert SkyPilotLauncher.abilities.confirms_down  # its teardown takes minutes


# --- the store's records ----------------------------------------------------------------


@pytest.mark.parametrize(
    "result",
    [
        rc.Selection(A.REPLACE_NODE_BLOCK_REGION, R1, V.REFILL, ("h9",), ("j-a1-n0",), ("h0",)),
        rc.Selection(A.RESTART_IN_PLACE, R1, V.RESTART_IN_PLACE),
        rc.ConfirmedCheckpoint(40, "s3://b/ckpt/step_40", {50: "d50", 60: "d60"}),
        rc.ConfirmedCheckpoint(None),
    ],
    ids=["refill-selection", "in-place-selection", "confirmed-with-poisoned", "fresh-start"],
)
def test_step_results_round_trip_through_the_store_typed(result: rc.StepResult):
    stored = records.result_json(result)
    read = (
        records.selection_from_json(stored)
        if isinstance(result, rc.Selection)
        else records.confirmed_from_json(stored)
    )
    assert read == result


def test_a_selection_stored_before_verbs_reads_as_the_verb_it_meant():
    old = {"remedy": "restart_in_place", "placement": R1.to_dict(), "in_place": True}
    assert records.selection_from_json(old).verb is V.RESTART_IN_PLACE
    old = {"remedy": "replace_node_block_region", "placement": R1.to_dict(), "in_place": False,
           "keep": ["j-a1-n0"], "keep_hosts": ["h0"]}  # fmt: skip
    assert records.selection_from_json(old).verb is V.JOIN_SURVIVORS
    old["keep"] = []
    assert records.selection_from_json(old).verb is V.LAUNCH


@pytest.mark.parametrize(
    "stored, names",
    [
        ({"remedy": "restart_in_place", "placement": R1.to_dict(), "verb": "teleport"}, "teleport"),
        ({"remedy": "pray", "placement": R1.to_dict(), "verb": "launch"}, "unknown remedy"),
        ({"remedy": "restart_in_place", "verb": "launch"}, "'placement' is missing"),
        (
            {
                "remedy": "restart_in_place",
                "placement": R1.to_dict(),
                "verb": "launch",
                "keep": "j-a1-n0",
            },
            "'keep' is not a list",
        ),
    ],
    ids=["unknown-verb", "unknown-remedy", "no-placement", "keep-not-a-list"],
)
def test_a_stored_selection_that_does_not_parse_is_an_error_naming_the_field(stored, names):
    with pytest.raises(records.StoredRecordError, match=names):
        records.selection_from_json(stored)
