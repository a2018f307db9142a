"""The SkyPilot launcher survives what SkyPilot 0.14.1 actually does (SKYPILOT.md
section 2), on the fake SDK of test_skypilot_requests.py, whose returns and exceptions
are SkyPilot's own: a launch request succeeds once its job is *queued* (setup runs in
the job), a refill or exec only queues another job beside the old one, StopFailoverError
reaches the client as a plain ``Exception('StopFailoverError: ...')``, a restarted API
server has forgotten every request id, and ``sky.down`` leaves a pending launch alone."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from orchestrator.launchers.base import (
    CapacityError,
    ClusterState,
    ConfirmsDown,
    LaunchError,
    LaunchHandle,
    LaunchPhase,
    LaunchRequest,
    RefillingLauncher,
    RefillRefused,
    RestartRefused,
    SubmitUncertain,
)
from orchestrator.launchers.skypilot import is_capacity_error
from tests.planner.test_skypilot_requests import A2, CLUSTER, FakeSky, lost_a_node, sky_launcher

pytestmark = pytest.mark.filterwarnings("ignore::Warning:sky")


def request(attempt: int = 1, launch_try: int = 0) -> LaunchRequest:
    return LaunchRequest(
        job_id="j-7", attempt=attempt, placement=A2, command="python train.py",
        launch_try=launch_try,
    )  # fmt: skip


PREVIOUS = LaunchHandle(CLUSTER, "skypilot", ("j-7-a1-n0", "j-7-a1-n1"), ("h0", "h1"), "r0")


@pytest.fixture
def fake(sky: Any) -> FakeSky:
    return FakeSky(sky)


@pytest.fixture
def launcher(fake: FakeSky):
    return sky_launcher(fake, poll_timeout_s=2.0, submit_timeout_s=2.0)


def launched(launcher, fake, job: int = 1, **kw) -> LaunchHandle:
    """A launch whose request SkyPilot finished: its job ``job`` is queued."""
    handle = launcher.launch(request(**kw))
    fake.clusters[handle.cluster_name] = "UP"
    fake.cluster_jobs.setdefault(handle.cluster_name, {})[job] = "PENDING"
    fake.finish(handle.request_id, (job, None))
    return handle


# --- defect 2: a setup failure is a launch failure, within seconds ---------------------


def test_a_failed_setup_fails_the_launch_with_its_log_tail_not_as_capacity(launcher, fake):
    handle = launched(launcher, fake)
    fake.cluster_jobs[CLUSTER][1] = "SETTING_UP"
    assert launcher.progress(handle).phase is LaunchPhase.PROVISIONING  # not UP: setup runs
    fake.cluster_jobs[CLUSTER][1] = "FAILED_SETUP"
    fake.logs[(CLUSTER, 1)] = "\n".join(
        [f"line {k}" for k in range(40)]
        + ["skyresume setup: python3 3.8 on this image; the agent needs 3.9+"]
    )
    p = sky_launcher(fake).progress(handle)  # a fresh read: no cached job status
    assert p.phase is LaunchPhase.FAILED and not p.capacity
    assert p.detail.startswith(f"setup failed on {CLUSTER} (job 1): ")
    assert p.detail.endswith("the agent needs 3.9+") and "line 39" in p.detail
    assert "line 0 " not in p.detail  # a tail, not the whole log
    (tail,) = fake.submitted("tail_logs")
    assert tail == ("tail_logs", CLUSTER, 1, False, 20)  # never follows: it returns


def test_a_job_queued_behind_another_is_provisioning_and_says_behind_which(launcher, fake):
    fake.clusters[CLUSTER] = "UP"
    fake.cluster_jobs[CLUSTER] = {3: "RUNNING"}
    handle = launched(launcher, fake, job=4)
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.PROVISIONING and "waiting behind job 3" in p.detail
    fake.cluster_jobs[CLUSTER][4] = "RUNNING"
    assert sky_launcher(fake).progress(handle).phase is LaunchPhase.UP


def test_a_jobs_status_is_read_at_most_every_job_poll_s_however_often_asked(fake):
    now = [0.0]
    launcher = sky_launcher(fake, job_poll_s=3.0, clock=lambda: now[0])
    handle = launched(launcher, fake)
    for _ in range(10):
        launcher.progress(handle)
    assert len(fake.submitted("job_status")) == 1
    now[0] = 3.5
    launcher.progress(handle)
    assert len(fake.submitted("job_status")) == 2


# --- defects 3 and 12: capacity from failover_history; a refill's StopFailoverError ----


def test_a_refill_whose_spot_stop_aws_refused_is_capacity_of_that_refill(launcher, fake):
    from sky import exceptions
    from sky.provision.common import StopFailoverError

    lost_a_node(fake)
    handle = launcher.refill(PREVIOUS, request(attempt=2))
    # what sky.get raises on the client: the class is not in sky.exceptions
    arrived = exceptions.deserialize_exception(
        exceptions.serialize_exception(
            StopFailoverError(f"Failed to stop cluster {CLUSTER}. This can cause resource leakage")
        )
    )
    assert type(arrived) is Exception
    fake.fail(handle.request_id, arrived)
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.FAILED and p.capacity
    assert "StopFailoverError: Failed to stop cluster" in p.detail


@pytest.mark.parametrize(
    "history,capacity",
    [
        pytest.param(
            ["RUE:Failed to acquire resources in all zones"], True, id="zones-stocked-out"
        ),
        pytest.param(
            ["RUE:Failed to provision on cloud AWS due to invalid cloud credentials: x"],
            False,
            id="bad-credentials",
        ),
        pytest.param(["ProvisionUnsupportedError:no such feature"], False, id="unsupported"),
        pytest.param(["CloudUserIdentityError:who"], False, id="identity"),
        pytest.param([], True, id="no-history-optimizer-or-sky-start"),
    ],
)
def test_capacity_is_read_from_the_failover_history(sky, history, capacity):
    from sky import exceptions

    def entry(text: str) -> Exception:
        kind, msg = text.split(":", 1)
        if kind == "RUE":
            return exceptions.ResourcesUnavailableError(msg)
        return getattr(exceptions, kind)(msg)

    e = exceptions.ResourcesUnavailableError(
        "Failed to provision all possible launchable resources.",
        failover_history=[entry(h) for h in history],
    )
    # as the client gets it back from the API server
    e = exceptions.deserialize_exception(exceptions.serialize_exception(e))
    assert is_capacity_error(e) is capacity


def test_the_previous_status_sky_start_error_of_a_refill_is_capacity(sky):
    from sky import exceptions

    e = exceptions.ResourcesUnavailableError(
        f"Failed to launch cluster {CLUSTER!r} (previous status: INIT). To retry launching "
        f"the cluster, run: sky start {CLUSTER}",
        no_failover=True,
    )
    assert is_capacity_error(e)


def test_no_such_exception_as_insufficient_capacity_is_relied_on(sky):
    import orchestrator.launchers.skypilot as sp

    assert not hasattr(sky.exceptions, "InsufficientCapacityError")
    assert "InsufficientCapacityError" not in open(sp.__file__).read()  # noqa: SIM115


# --- defect 4: idempotency per try ------------------------------------------------------


def test_a_retried_refill_is_a_new_request_never_the_failed_one_of_the_try_before(launcher, fake):
    lost_a_node(fake)
    first = launcher.refill(PREVIOUS, request(attempt=2))
    fake.fail(first.request_id, fake.exceptions.ResourcesUnavailableError("no capacity"))
    lost_a_node(fake)
    again = launcher.refill(PREVIOUS, request(attempt=2))  # the same try: adopted
    assert again.request_id == first.request_id
    retry = launcher.refill(PREVIOUS, request(attempt=2, launch_try=1))
    assert retry.request_id != first.request_id
    assert len(fake.submitted("launch")) == 2


def test_a_retried_exec_is_a_new_request_never_the_failed_one(launcher, fake):
    fake.clusters[CLUSTER] = "UP"
    first = launcher.restart(PREVIOUS, request(attempt=2))
    fake.fail(first.request_id, fake.exceptions.ClusterNotUpError("not UP"))
    assert launcher.restart(PREVIOUS, request(attempt=2)).request_id == first.request_id
    retry = launcher.restart(PREVIOUS, request(attempt=2, launch_try=1))
    assert retry.request_id != first.request_id


# --- defect 5: a refill only where SkyPilot found nodes terminated ----------------------


@pytest.mark.parametrize("cloud_says", ["UP", "gone", "INIT-ray-unhealthy"])
def test_a_refill_of_a_cluster_that_lost_no_node_is_refused_before_submission(
    launcher, fake, cloud_says
):
    fake.clusters[CLUSTER] = "UP"
    if cloud_says == "INIT-ray-unhealthy":
        fake.refreshed[CLUSTER] = "INIT"
        fake.records[CLUSTER] = {"init_status_reason": "ray cluster is unhealthy (x)"}
    else:
        fake.refreshed[CLUSTER] = cloud_says
    with pytest.raises(RefillRefused) as e:
        launcher.refill(PREVIOUS, request(attempt=2))
    assert not isinstance(e.value, CapacityError)  # the placement is not to blame
    assert fake.submitted("launch") == [] and fake.submitted("cancel") == []
    (status,) = [c for c in fake.calls if c[0] == "status" and c[1] == (CLUSTER,)]
    assert str(status[2]["refresh"].value) == "FORCE"  # asked the cloud, not the cache


# --- defect 6: old jobs are cancelled before a refill or an exec ------------------------


@pytest.mark.parametrize("verb", ["refill", "restart"])
def test_old_jobs_are_cancelled_and_waited_for_before_the_new_one_is_queued(launcher, fake, verb):
    if verb == "refill":
        lost_a_node(fake)
    else:
        fake.clusters[CLUSTER] = "UP"
    fake.cluster_jobs[CLUSTER] = {1: "RUNNING"}
    getattr(launcher, verb)(PREVIOUS, request(attempt=2))
    names = [c[0] for c in fake.calls]
    cancel = names.index("cancel")
    submitted = names.index("launch" if verb == "refill" else "exec")
    assert cancel < submitted
    (call,) = fake.submitted("cancel")
    assert call[2] == {"all": True, "_try_cancel_if_cluster_is_init": True}
    (rid,) = [r for r, v in fake.requests.items() if v["name"] == "sky.cancel"]
    assert ("get", rid) in fake.calls  # waited for
    assert fake.cluster_jobs[CLUSTER][1] == "CANCELLED"


def test_a_cancel_skypilot_refuses_refuses_the_refill(launcher, fake):
    lost_a_node(fake)
    fake.cancel_error = fake.exceptions.ClusterNotUpError("head is gone")
    with pytest.raises(RefillRefused, match="could not be cancelled first"):
        launcher.refill(PREVIOUS, request(attempt=2))
    assert fake.submitted("launch") == []


# --- defect 18: a restart in place only where sky.exec can work -------------------------


def test_a_restart_on_a_cluster_that_is_not_up_is_refused(launcher, fake):
    fake.clusters[CLUSTER] = "INIT"
    with pytest.raises(RestartRefused, match=r"is INIT; sky\.exec needs it UP"):
        launcher.restart(PREVIOUS, request(attempt=2))
    assert fake.submitted("exec") == []


def test_a_restart_onto_nodes_with_another_agent_wheel_is_refused(fake):
    launcher = sky_launcher(
        fake, package="https://svc/v1/agent/dist/skyresume-0.2.whl", status_ttl_s=0
    )
    fake.clusters[CLUSTER] = "UP"
    fake.records[CLUSTER] = {
        "last_creation_yaml": (
            "envs:\n  SKYRESUME_PACKAGE: https://svc/v1/agent/dist/skyresume-0.1.whl\n"
        )
    }
    with pytest.raises(RestartRefused, match=r"skyresume-0\.1\.whl.*skips setup"):
        launcher.restart(PREVIOUS, request(attempt=2))
    fake.records[CLUSTER]["last_creation_yaml"] = (
        "envs:\n  SKYRESUME_PACKAGE: https://svc/v1/agent/dist/skyresume-0.2.whl\n"
    )
    launcher.restart(PREVIOUS, request(attempt=2))
    assert len(fake.submitted("exec")) == 1


# --- defect 8: INIT or missing is unknown --------------------------------------------


@pytest.mark.parametrize("record", ["INIT", None])
def test_an_init_or_missing_cluster_reads_unknown_never_down(fake, record):
    launcher = sky_launcher(fake)
    if record:
        fake.clusters[CLUSTER] = record
    st = launcher.status(LaunchHandle(CLUSTER, "skypilot", ("n0", "n1")))
    assert st.state is ClusterState.UNKNOWN and st.nodes_up == ()


def test_clusters_of_every_user_are_read(launcher, fake):
    launcher.status(LaunchHandle(CLUSTER, "skypilot"))
    (call,) = fake.submitted("status")
    assert call[2].get("all_users") is True  # a new user hash must not hide our clusters


# --- defect 9: the API server is never auto-started; a lost request is resolved ----------


def test_nothing_is_submitted_while_the_api_server_is_down(launcher, fake):
    fake.server_down = True
    with pytest.raises(LaunchError) as e:
        launcher.launch(request())
    assert not isinstance(e.value, CapacityError)
    assert fake.submitted("launch") == []


def test_an_auto_start_the_environment_refused_is_a_transport_error(launcher, fake):
    fake.server_down = True
    p = launcher.progress(LaunchHandle(CLUSTER, "skypilot", request_id="0001-x"))
    assert p.phase is LaunchPhase.UNKNOWN and not p.capacity


def test_a_request_a_restarted_api_server_forgot_is_resolved_from_the_cluster(launcher, fake):
    handle = launcher.launch(request())
    fake.wipe()  # the server restarted: its request database is new
    p = launcher.progress(handle)  # the launch died with it; no cluster came of it
    assert p.phase is LaunchPhase.FAILED and not p.capacity and "lost it" in p.detail
    fake.clusters[CLUSTER] = "INIT"
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.FAILED and not p.capacity and "INIT" in p.detail
    fake.clusters[CLUSTER] = "UP"  # it did finish before the restart: its job decides
    fake.cluster_jobs[CLUSTER] = {1: "RUNNING"}
    assert launcher.progress(handle).phase is LaunchPhase.UP


# --- defect 10: a submission that timed out keeps its key -----------------------------


def test_a_submission_that_timed_out_is_adopted_not_submitted_again(fake):
    gate = threading.Event()
    real = fake.launch

    def slow(task, **kw):
        gate.wait(10)
        return real(task, **kw)

    fake.launch = slow
    launcher = sky_launcher(fake, poll_timeout_s=1.0, submit_timeout_s=0.2)
    with pytest.raises(SubmitUncertain, match="may have been accepted"):
        launcher.launch(request())
    with pytest.raises(SubmitUncertain, match="still being submitted"):
        launcher.launch(request())  # the same key, while the first may still land
    gate.set()
    for _ in range(100):
        if fake.requests:
            break
        threading.Event().wait(0.05)
    handle = launcher.launch(request())
    (rid,) = list(fake.requests)
    assert handle.request_id == rid and len(fake.submitted("launch")) == 1


def test_an_api_status_that_cannot_be_read_is_uncertain_not_a_failed_launch(launcher, fake):
    fake.offline = ConnectionError("Could not connect to SkyPilot API server")
    with pytest.raises(SubmitUncertain, match="not submitting it again blind"):
        launcher.launch(request())


# --- defect 11: teardown cancels the launch, then downs, and is confirmed ----------------


def test_down_cancels_a_pending_launch_first_and_is_confirmed_only_when_gone(fake):
    launcher = sky_launcher(fake)
    assert isinstance(launcher, ConfirmsDown) and isinstance(launcher, RefillingLauncher)
    handle = launcher.launch(request())  # still PENDING: a down alone would not stop it
    fake.clusters[CLUSTER] = "INIT"
    launcher.down(handle)
    assert fake.requests[handle.request_id]["status"] == "CANCELLED"
    names = [c[0] for c in fake.calls]
    assert names.index("api_cancel") < names.index("down")
    assert not launcher.confirm_down(handle).gone  # the down is still running
    (rid,) = [r for r, v in fake.requests.items() if v["name"] == "sky.down"]
    fake.finish(rid)
    r = launcher.confirm_down(handle)
    assert not r.gone and "still listed" in r.detail  # SkyPilot still lists it
    del fake.clusters[CLUSTER]
    assert launcher.confirm_down(handle).gone


def test_a_confirmation_that_cannot_be_read_is_not_gone(launcher, fake):
    fake.offline = ConnectionError("down")
    assert not launcher.confirm_down(LaunchHandle(CLUSTER, "skypilot")).gone


def test_a_users_own_autostop_replaces_the_autodown_backstop(fake, tmp_path):
    from orchestrator.domain.spec import TaskSpec

    own = tmp_path / "own.yaml"
    own.write_text(
        "resources: {accelerators: A100:8, autostop: {idle_minutes: 10, down: true}}\n"
        "run: python train.py\n"
    )
    sky_launcher(fake).launch(request(), TaskSpec(skypilot_yaml=str(own)))
    ((_, kw),) = fake.submitted("launch")
    assert (kw["idle_minutes_to_autostop"], kw["down"]) == (None, False)


# --- defect 13: one sky.status for every job, cached -----------------------------------


def test_one_status_request_serves_every_job_within_its_ttl(fake):
    now = [0.0]
    launcher = sky_launcher(fake, status_ttl_s=20.0, clock=lambda: now[0])
    fake.clusters.update({"sr-a-a1": "UP", "sr-b-a1": "UP"})
    for _ in range(5):
        for name in ("sr-a-a1", "sr-b-a1", "sr-c-a1"):
            launcher.status(LaunchHandle(name, "skypilot"))
    assert len(fake.submitted("status")) == 1
    now[0] = 20.5
    launcher.status(LaunchHandle("sr-a-a1", "skypilot"))
    assert len(fake.submitted("status")) == 2
    (first, second) = fake.submitted("status")
    assert first[1] == () and second[1] == ()  # all clusters, not one per job
