"""The SkyPilot launcher submits requests and polls them: ``launch``/``restart``/``down``
return as soon as SkyPilot's API server has the request, and ``progress`` maps the
request's status (and, once finished, its stored result or exception) to a
LaunchPhase. Here against ``FakeSky``: the SDK surface the launcher uses, answering
with real ``RequestPayload`` rows and SkyPilot's own exception classes, and refusing
``get`` on a request that is not finished (on the real server that call blocks)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from orchestrator.domain.plan import Placement
from orchestrator.launchers.base import (
    CapacityError,
    ClusterState,
    LaunchError,
    LaunchHandle,
    LaunchPhase,
    LaunchRequest,
)
from orchestrator.launchers.skypilot import SkyPilotLauncher, TaskRejected

pytestmark = pytest.mark.filterwarnings("ignore::Warning:sky")

A2 = Placement(
    cloud="gcp",
    region="us-central1",
    instance_type="a2-highgpu-8g",
    accelerator="A100",
    accelerator_count=8,
    num_nodes=2,
    spot=True,
)
CLUSTER = "sr-j-7-a1"


def request(attempt: int = 1, placement: Placement = A2) -> LaunchRequest:
    return LaunchRequest(
        job_id="j-7", attempt=attempt, placement=placement, command="python train.py"
    )


class BlockingGet(AssertionError):
    """``sky.get`` on an unfinished request: the real call would wait for it."""


class FakeSky:
    """The client SDK as the launcher uses it, shaped after SkyPilot 0.14.1's own
    returns (sky/client/sdk.py): every call but ``api_status``/``api_info``/
    ``tail_logs`` is a request with an id, answered by ``get``; cluster records as
    ``sky.status`` gives them (a ``ClusterStatus``, ``init_status_reason``,
    ``last_creation_yaml``), job statuses as ``job_status`` gives them
    (``{job_id: JobStatus}``). Tests finish, fail or cancel requests and move
    clusters and jobs; ``offline`` makes every call raise, ``server_down`` makes
    ``api_info`` fail and ``api_status`` answer [] as the SDK does for a local server
    that is not running."""

    def __init__(self, sky: Any) -> None:
        from sky.skylet import job_lib

        self.sky = sky
        self.exceptions = sky.exceptions
        self.JobStatus = job_lib.JobStatus
        self.calls: list[tuple[str, Any]] = []
        self.requests: dict[str, dict[str, Any]] = {}
        self.clusters: dict[str, str] = {}
        #: cluster -> extra record fields (init_status_reason, last_creation_yaml)
        self.records: dict[str, dict[str, Any]] = {}
        #: cluster -> {job id: JobStatus value}
        self.cluster_jobs: dict[str, dict[int, str]] = {}
        self.logs: dict[tuple[str, int], str] = {}
        #: what a refresh=FORCE status finds (the cloud's truth), by cluster
        self.refreshed: dict[str, str] = {}
        self.offline: BaseException | None = None
        self.server_down = False
        self.cancel_error: BaseException | None = None
        self.hang_s = 0.0

    # the SDK's surface ------------------------------------------------------------
    def _answer(self) -> None:
        if self.hang_s:
            time.sleep(self.hang_s)
        if self.offline is not None:
            raise self.offline

    def _submit(self, name: str, cluster: str, task: Any = None, **extra: Any) -> str:
        from sky.utils import dag_utils

        self._answer()
        if self.server_down:  # SKYPILOT_DISABLE_LOCAL_API_SERVER=1 stops the auto-start
            raise RuntimeError(
                "No SkyPilot API server endpoint is configured, and starting a local API "
                "server on this machine is disabled (SKYPILOT_DISABLE_LOCAL_API_SERVER=1)."
            )
        rid = f"{len(self.requests) + 1:04d}-{name}"
        body: dict[str, Any] = {"cluster_name": cluster}
        if task is not None:
            body["task"] = dag_utils.dump_dag_to_yaml_str(dag_utils.convert_entrypoint_to_dag(task))
        self.requests[rid] = {
            "name": name,
            "cluster_name": cluster,
            "status": "PENDING",
            "created_at": time.time() + len(self.requests) * 1e-3,
            "body": json.dumps(body),
            **extra,
        }
        return rid

    def _now(self, name: str, result: Any = None, error: BaseException | None = None) -> str:
        """A short request, finished by the time it is answered."""
        rid = self._submit(name, "")
        if error is not None:
            self.fail(rid, error)
        else:
            self.finish(rid, result)
        return rid

    def api_info(self) -> Any:
        from sky.schemas.api.responses import APIHealthResponse
        from sky.server.common import ApiServerStatus

        self.calls.append(("api_info", None))
        self._answer()
        if self.server_down:
            raise self.exceptions.ApiServerConnectionError("http://127.0.0.1:46580")
        return APIHealthResponse(status=ApiServerStatus.HEALTHY, api_version="41")

    def launch(self, task: Any, **kw: Any) -> str:
        self.calls.append(("launch", kw))
        return self._submit("sky.launch", kw["cluster_name"], task)

    def exec(self, task: Any, **kw: Any) -> str:
        self.calls.append(("exec", kw))
        return self._submit("sky.exec", kw["cluster_name"], task)

    def down(self, cluster_name: str, **kw: Any) -> str:
        self.calls.append(("down", cluster_name))
        return self._submit("sky.down", cluster_name)

    def status(self, cluster_names: list[str] | None = None, **kw: Any) -> str:
        self.calls.append(("status", tuple(cluster_names or ()), kw))
        if str(getattr(kw.get("refresh"), "value", kw.get("refresh"))) == "FORCE":
            for name in cluster_names or list(self.clusters):
                if name in self.refreshed:
                    if self.refreshed[name] == "gone":
                        self.clusters.pop(name, None)
                    else:
                        self.clusters[name] = self.refreshed[name]
        names = cluster_names if cluster_names is not None else list(self.clusters)
        records = [
            {
                "name": n,
                "status": self.sky.ClusterStatus(self.clusters[n]),
                **self.records.get(n, {}),
            }
            for n in names
            if n in self.clusters
        ]
        return self._now("sky.status", records)

    def job_status(self, cluster_name: str, job_ids: list[int] | None = None) -> str:
        self.calls.append(("job_status", cluster_name, job_ids))
        if cluster_name not in self.clusters:
            gone = self.exceptions.ClusterDoesNotExist(cluster_name)
            return self._now("sky.job_status", error=gone)
        jobs = self.cluster_jobs.get(cluster_name, {})
        out = {j: (self.JobStatus(jobs[j]) if j in jobs else None) for j in job_ids or []}
        return self._now("sky.job_status", out)

    def queue(self, cluster_name: str, skip_finished: bool = False, all_users: bool = False) -> str:
        self.calls.append(("queue", cluster_name))
        done = ("SUCCEEDED", "FAILED", "FAILED_SETUP", "FAILED_DRIVER", "CANCELLED")
        records = [
            {"job_id": j, "job_name": f"job-{j}", "status": self.JobStatus(st)}
            for j, st in sorted(self.cluster_jobs.get(cluster_name, {}).items())
            if not (skip_finished and st in done)
        ]
        return self._now("sky.queue", records)

    def cancel(self, cluster_name: str, all: bool = False, **kw: Any) -> str:
        self.calls.append(("cancel", cluster_name, {"all": all, **kw}))
        if self.cancel_error is not None:
            return self._now("sky.cancel", error=self.cancel_error)
        for j, st in self.cluster_jobs.get(cluster_name, {}).items():
            if st in ("INIT", "PENDING", "SETTING_UP", "RUNNING"):
                self.cluster_jobs[cluster_name][j] = "CANCELLED"
        return self._now("sky.cancel")

    def tail_logs(self, cluster_name: str, job_id: int | None, follow: bool, tail: int = 0,
                  output_stream: Any = None, **kw: Any) -> int:  # fmt: skip
        self.calls.append(("tail_logs", cluster_name, job_id, follow, tail))
        self._answer()
        lines = self.logs.get((cluster_name, job_id or 0), "").splitlines()
        if tail:
            lines = lines[-tail:]
        if output_stream is not None:
            output_stream.write("".join(line + "\n" for line in lines))
        return 100

    def api_cancel(
        self, request_ids: Any = None, all_users: bool = False, silent: bool = False
    ) -> str:
        self.calls.append(("api_cancel", request_ids))
        self._answer()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or [])
        for rid in ids:
            if self.requests[rid]["status"] not in _FINISHED:
                self.set(rid, "CANCELLED")
        return self._now("sky.api_cancel", ids)

    def api_status(
        self,
        request_ids: list[str] | None = None,
        all_status: bool = False,
        limit: int | None = None,
        fields: list[str] | None = None,
        cluster_name: str | None = None,
    ) -> list[Any]:
        from sky.server.requests.payloads import RequestPayload

        self.calls.append(("api_status", request_ids, cluster_name))
        self._answer()
        if self.server_down:
            return []  # what the SDK answers when a local API server is not running
        out = []
        for rid, r in self.requests.items():
            if request_ids is not None and not any(rid.startswith(p) for p in request_ids):
                continue
            if cluster_name is not None and r["cluster_name"] != cluster_name:
                continue
            if request_ids is None and not all_status and r["status"] in _FINISHED:
                continue
            out.append(
                RequestPayload(
                    request_id=rid,
                    name=r["name"],
                    entrypoint=r["name"].removeprefix("sky."),
                    request_body=r["body"],
                    status=r["status"],
                    created_at=r["created_at"],
                    user_id="u1",
                    return_value="null",
                    error="null",  # api_status never carries the error: get does
                    pid=None,
                    schedule_type="long",
                    cluster_name=r["cluster_name"] or None,
                    status_msg=r.get("status_msg"),
                )
            )
        return out

    def get(self, rid: str) -> Any:
        self.calls.append(("get", rid))
        self._answer()
        r = self.requests[rid]
        if r["status"] not in _FINISHED:
            raise BlockingGet(f"sky.get({rid}) on a {r['status']} request")
        if r["status"] == "CANCELLED":
            raise self.exceptions.RequestCancelled(f"{rid} cancelled")
        if r.get("error") is not None:
            raise r["error"]
        return r.get("result")

    # the test's controls ------------------------------------------------------------
    def set(self, rid: str, status: str, **kw: Any) -> None:
        self.requests[rid].update(status=status, **kw)

    def finish(self, rid: str, result: Any = None) -> None:
        self.set(rid, "SUCCEEDED", result=result)

    def fail(self, rid: str, error: BaseException) -> None:
        self.set(rid, "FAILED", error=error)

    def submitted(self, kind: str) -> list[tuple[str, Any]]:
        return [c for c in self.calls if c[0] == kind]

    def wipe(self) -> None:
        """An API server restarted on SQLite: its request database is new."""
        self.requests.clear()


_FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")


@pytest.fixture
def fake(sky: Any) -> FakeSky:
    return FakeSky(sky)


#: A node image with Python and torch (a GCP image: naming one is checked offline).
IMAGE = "projects/deeplearning-platform-release/global/images/family/pytorch-latest-gpu"


def sky_launcher(fake: Any, **kw: Any) -> SkyPilotLauncher:
    kw.setdefault("image_id", IMAGE)
    return SkyPilotLauncher(sdk=fake, **kw)


@pytest.fixture
def launcher(fake: FakeSky) -> SkyPilotLauncher:
    return sky_launcher(fake, poll_timeout_s=2.0, submit_timeout_s=2.0)


class Handle:
    """A finished launch's result: ``(job_id, CloudVmRayResourceHandle)``, with the
    one attribute the launcher reads from the handle."""

    def __init__(self, pairs: list[tuple[str, str | None]]) -> None:
        self.stable_internal_external_ips = pairs


# --- launch ------------------------------------------------------------------------


def lost_a_node(fake: FakeSky, cluster: str = CLUSTER) -> None:
    """A cluster SkyPilot still lists UP whose refresh finds a node terminated."""
    fake.clusters[cluster] = "UP"
    fake.refreshed[cluster] = "INIT"
    fake.records[cluster] = {
        "init_status_reason": "Cluster is abnormal because one or more nodes terminated",
        "init_kind": "unhealthy",
    }


def test_launch_submits_a_plain_cluster_and_returns_with_its_request_id(launcher, fake):
    handle = launcher.launch(request())
    ((_, kw),) = fake.submitted("launch")
    # never retry_until_up (a stockout re-plans); autodown as a backstop against leaks
    assert kw == {
        "cluster_name": CLUSTER,
        "retry_until_up": False,
        "idle_minutes_to_autostop": 60,
        "down": True,
    }
    assert handle.cluster_name == CLUSTER and handle.node_ids == ("j-7-a1-n0", "j-7-a1-n1")
    assert fake.requests[handle.request_id]["status"] == "PENDING"  # nothing waited on it
    assert ("get", handle.request_id) not in fake.calls
    assert not hasattr(fake, "jobs")  # never a managed job


def test_a_service_restarted_mid_launch_does_not_submit_it_twice(fake):
    first = sky_launcher(fake).launch(request())
    fake.set(first.request_id, "RUNNING")
    again = sky_launcher(fake).launch(request())  # a fresh service process
    assert again == first
    fake.fail(first.request_id, fake.exceptions.NoCloudAccessError("Cloud access is not set up."))
    # a failed attempt stays failed: its retry is the next attempt, on a cluster of its own
    assert sky_launcher(fake).launch(request()).request_id == first.request_id
    assert len(fake.submitted("launch")) == 1
    assert sky_launcher(fake).launch(request(attempt=2)).cluster_name == "sr-j-7-a2"
    assert len(fake.submitted("launch")) == 2


def test_when_skypilot_cannot_say_what_it_holds_nothing_is_submitted_blind(launcher, fake):
    fake.offline = ConnectionError("Could not connect to SkyPilot API server")
    with pytest.raises(LaunchError, match="not submitting it again blind"):
        launcher.launch(request())
    assert fake.submitted("launch") == []


@pytest.mark.parametrize(
    "raised,expected,words",
    [
        pytest.param(
            ValueError("Invalid resources: A100:8 is not offered"),
            TaskRejected,
            "rejected it: Invalid resources",
            id="validation-is-rejected",
        ),
        pytest.param(
            "ResourcesUnavailableError",
            CapacityError,
            "No resource satisfying",
            id="stockout-known-now-is-capacity",
        ),
        pytest.param(
            "ApiServerConnectionError",
            LaunchError,
            "Could not connect",
            id="unreachable-is-no-rejection",
        ),
    ],
)
def test_a_launch_refused_at_submission_raises_at_once(launcher, fake, raised, expected, words):
    real = launcher.sdk.launch

    def refuse(task, **kw):
        real(task, **kw)
        if raised == "ResourcesUnavailableError":
            raise fake.exceptions.ResourcesUnavailableError("No resource satisfying A100:8")
        if raised == "ApiServerConnectionError":
            raise fake.exceptions.ApiServerConnectionError("http://127.0.0.1:46580")
        raise raised

    fake.launch = refuse
    with pytest.raises(expected, match=words) as e:
        launcher.launch(request())
    assert type(e.value) is expected
    assert f"{CLUSTER} on gcp/us-central1 a2-highgpu-8g" in str(e.value)


def test_a_submission_that_hangs_is_a_launch_error_within_its_bound(sky, fake):
    fake.hang_s = 3.0
    launcher = sky_launcher(fake, poll_timeout_s=0.2, submit_timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(LaunchError):
        launcher.launch(request())
    assert time.monotonic() - t0 < 1.5


# --- progress ------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["PENDING", "WAITING", "RUNNING"])
def test_an_unfinished_request_is_provisioning_and_never_waited_on(launcher, fake, status):
    handle = launcher.launch(request())
    fake.set(handle.request_id, status, status_msg="Launching on GCP us-central1")
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.PROVISIONING
    assert status in p.detail and "us-central1" in p.detail
    assert ("get", handle.request_id) not in fake.calls


def test_a_succeeded_launch_is_up_with_the_hosts_skypilot_gives_once_its_job_runs(launcher, fake):
    handle = launcher.launch(request())
    fake.clusters[CLUSTER] = "UP"
    fake.cluster_jobs[CLUSTER] = {1: "RUNNING"}
    fake.finish(handle.request_id, (1, Handle([("10.0.0.2", "34.1.2.3"), ("10.0.0.3", None)])))
    p = launcher.progress(handle)
    assert (p.phase, p.hosts) == (LaunchPhase.UP, ("34.1.2.3", "10.0.0.3"))
    assert ("job_status", CLUSTER, [1]) in fake.calls


def test_a_succeeded_launch_without_hosts_is_up_with_none(launcher, fake):
    handle = launcher.launch(request())
    fake.finish(handle.request_id, (None, None))
    p = launcher.progress(handle)
    assert (p.phase, p.hosts) == (LaunchPhase.UP, ())


@pytest.mark.parametrize("fresh_service", [False, True], ids=["same-process", "after-restart"])
def test_a_stockout_fails_the_launch_for_capacity(fake, fresh_service):
    first = sky_launcher(fake)
    handle = first.launch(request())
    fake.fail(
        handle.request_id,
        fake.exceptions.ResourcesUnavailableError(
            "Failed to provision all possible launchable resources."
        ),
    )
    launcher = sky_launcher(fake) if fresh_service else first
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.FAILED and p.capacity
    assert p.detail.startswith(f"SkyPilot could not launch {CLUSTER} on gcp/us-central1 a2-")
    assert "ResourcesUnavailableError: Failed to provision" in p.detail


@pytest.mark.parametrize("fresh_service", [False, True], ids=["same-process", "after-restart"])
def test_another_failure_fails_the_launch_naming_cluster_region_and_instance(fake, fresh_service):
    first = sky_launcher(fake)
    handle = first.launch(request())
    fake.fail(
        handle.request_id,
        fake.exceptions.NoCloudAccessError("Cloud access is not set up. Run: \x1b[1msky check"),
    )
    # after a restart the placement comes from the request SkyPilot kept
    launcher = sky_launcher(fake) if fresh_service else first
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.FAILED and not p.capacity
    assert p.detail == (
        f"SkyPilot could not launch {CLUSTER} on gcp/us-central1 a2-highgpu-8g: "
        "NoCloudAccessError: Cloud access is not set up. Run: sky check"
    )


def test_a_cancelled_request_is_failed_saying_so(launcher, fake):
    handle = launcher.launch(request())
    fake.set(handle.request_id, "CANCELLED")
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.FAILED and "cancelled" in p.detail and not p.capacity


@pytest.mark.parametrize(
    "breakage",
    ["api-server-unreachable", "request-not-listed", "get-unreachable", "unknown-status"],
)
def test_an_unreadable_request_is_unknown_never_failed(launcher, fake, breakage):
    handle = launcher.launch(request())
    if breakage == "api-server-unreachable":
        fake.offline = ConnectionError("Could not connect to SkyPilot API server")
    elif breakage == "request-not-listed":
        fake.server_down = True  # the SDK answers [] when a local server is not running
    elif breakage == "get-unreachable":
        fake.fail(handle.request_id, RuntimeError("boom"))

        def unreachable(rid):
            raise fake.exceptions.ApiServerConnectionError("http://127.0.0.1:46580")

        fake.get = unreachable
    else:
        fake.set(handle.request_id, "EXPLODED")
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.UNKNOWN and p.detail


def test_a_hung_api_server_is_unknown_within_the_poll_bound(sky, fake):
    launcher = sky_launcher(fake, poll_timeout_s=0.2)
    handle = launcher.launch(request())
    fake.hang_s = 5.0
    t0 = time.monotonic()
    p = launcher.progress(handle)
    assert time.monotonic() - t0 < 1.0
    assert p.phase is LaunchPhase.UNKNOWN and "did not answer within 0.2 s" in p.detail
    st = launcher.status(handle)
    assert st.state is ClusterState.UNKNOWN


def test_progress_never_raises_whatever_the_sdk_does(launcher, fake):
    handle = launcher.launch(request())

    def exits(**kw):
        raise SystemExit(2)

    fake.api_status = exits
    assert launcher.progress(handle).phase is LaunchPhase.UNKNOWN


def test_a_handle_without_request_id_reads_the_cluster(fake):
    launcher = sky_launcher(fake, status_ttl_s=0)
    h = LaunchHandle(CLUSTER, "skypilot")
    # not listed: another user hash's, or gone; neither is a failed launch
    assert launcher.progress(h).phase is LaunchPhase.UNKNOWN
    fake.clusters[CLUSTER] = "INIT"
    assert launcher.progress(h).phase is LaunchPhase.PROVISIONING
    fake.clusters[CLUSTER] = "UP"
    assert launcher.progress(h).phase is LaunchPhase.UP
    fake.clusters[CLUSTER] = "STOPPED"
    assert launcher.progress(h).phase is LaunchPhase.FAILED
    fake.offline = ConnectionError("down")
    assert launcher.progress(h).phase is LaunchPhase.UNKNOWN


# --- restart, down, status -------------------------------------------------------------


def test_restart_submits_exec_on_the_cluster_and_is_polled_the_same_way(launcher, fake):
    previous = LaunchHandle(CLUSTER, "skypilot", ("j-7-a1-n0", "j-7-a1-n1"), ("h0", "h1"), "r0")
    fake.clusters[CLUSTER] = "UP"
    fake.cluster_jobs[CLUSTER] = {1: "RUNNING"}
    handle = launcher.restart(previous, request(attempt=2))
    ((_, kw),) = fake.submitted("exec")
    assert kw == {"cluster_name": CLUSTER}
    assert handle.cluster_name == CLUSTER and handle.node_ids == ("j-7-a2-n0", "j-7-a2-n1")
    assert handle.request_id and handle.hosts == ("h0", "h1")
    assert launcher.progress(handle).phase is LaunchPhase.PROVISIONING
    # the same attempt again answers with its exec; the next attempt is a new one
    assert launcher.restart(previous, request(attempt=2)) == handle
    assert launcher.restart(previous, request(attempt=3)).request_id != handle.request_id
    assert len(fake.submitted("exec")) == 2
    fake.fail(handle.request_id, fake.exceptions.ClusterNotUpError("not UP"))
    p = launcher.progress(handle)
    assert p.phase is LaunchPhase.FAILED
    assert p.detail.startswith(f"SkyPilot could not restart on {CLUSTER}: ClusterNotUpError")
    fake.finish(handle.request_id, (2, None))
    fake.cluster_jobs[CLUSTER][2] = "RUNNING"
    assert launcher.progress(handle).phase is LaunchPhase.UP


def test_a_lost_node_is_replaced_by_launching_onto_the_same_cluster(launcher, fake):
    """SkyPilot's provisioner keeps a cluster's running instances and starts only the
    missing ones: the next attempt launched onto the failed attempt's cluster keeps
    the healthy nodes. Named after the attempt's try, so it is submitted once."""
    previous = LaunchHandle(CLUSTER, "skypilot", ("j-7-a1-n0", "j-7-a1-n1"), ("h0", "h1"), "r0")
    lost_a_node(fake)
    handle = launcher.refill(previous, request(attempt=2))
    ((_, kw),) = fake.submitted("launch")
    assert kw["cluster_name"] == CLUSTER and kw["retry_until_up"] is False
    (rid,) = [r for r, v in fake.requests.items() if v["name"] == "sky.launch"]
    assert rid == handle.request_id
    assert handle.cluster_name == CLUSTER and handle.node_ids == ("j-7-a2-n0", "j-7-a2-n1")
    assert launcher.refill(previous, request(attempt=2)) == handle
    assert len(fake.submitted("launch")) == 1
    assert launcher.progress(handle).phase is LaunchPhase.PROVISIONING


def test_down_submits_the_teardown_and_does_not_wait_for_it(launcher, fake):
    handle = LaunchHandle(CLUSTER, "skypilot")
    launcher.down(handle)
    ((_, name),) = fake.submitted("down")
    (rid,) = [r for r, v in fake.requests.items() if v["name"] == "sky.down"]
    assert name == CLUSTER and fake.requests[rid]["status"] == "PENDING"
    assert ("get", rid) not in fake.calls
    launcher.down(handle)  # a teardown under way is not submitted again
    assert len(fake.submitted("down")) == 1
    fake.fail(rid, fake.exceptions.ClusterDoesNotExist(f"Cluster {CLUSTER!r} does not exist."))
    launcher.down(handle)  # finished: a new down is harmless, and SkyPilot's to refuse
    assert len(fake.submitted("down")) == 2


def test_a_down_skypilot_runs_on_a_cluster_that_no_longer_exists_is_confirmed_gone(launcher, fake):
    # SkyPilot raises ClusterDoesNotExist when the down request runs, not on submission
    handle = LaunchHandle(CLUSTER, "skypilot")
    launcher.down(handle)
    (rid,) = [r for r, v in fake.requests.items() if v["name"] == "sky.down"]
    fake.fail(rid, fake.exceptions.ClusterDoesNotExist(f"Cluster {CLUSTER!r} does not exist."))
    assert launcher.confirm_down(handle).gone


def test_a_down_that_cannot_be_submitted_says_so(launcher, fake):
    fake.offline = ConnectionError("Could not connect to SkyPilot API server")
    with pytest.raises(LaunchError, match=f"could not tear down {CLUSTER}"):
        launcher.down(LaunchHandle(CLUSTER, "skypilot"))


def test_status_reads_skypilots_record_through_a_finished_request(fake):
    launcher = sky_launcher(fake, status_ttl_s=0)
    fake.clusters[CLUSTER] = "UP"
    h = LaunchHandle(CLUSTER, "skypilot", ("n0",))
    assert launcher.status(h).state is ClusterState.UP
    del fake.clusters[CLUSTER]
    st = launcher.status(h)  # not listed is not dead: heartbeats decide
    assert st.state is ClusterState.UNKNOWN and "not listed" in st.detail
    fake.offline = ConnectionError("API server unreachable")
    st = launcher.status(h)
    assert st.state is ClusterState.UNKNOWN and "unreachable" in st.detail


def test_sdk_calls_run_off_the_callers_thread_with_its_context(launcher, fake):
    """The bound runs each call in a thread of its own; the SDK keeps the server's API
    version in context variables, so the caller's context goes with it."""
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("api_version", default="unset")
    var.set("41")
    seen = {}
    real = fake.api_status

    def spy(**kw):
        seen["thread"] = threading.current_thread().name
        seen["version"] = var.get()
        return real(**kw)

    fake.api_status = spy
    launcher.progress(LaunchHandle(CLUSTER, "skypilot", request_id="0001-x"))
    assert seen == {"thread": "skyresume-sky.api_status", "version": "41"}
