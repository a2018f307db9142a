"""The SkyPilot launcher against SkyPilot's real API server, started on loopback.

The server runs from ``sky api start`` with an isolated runtime directory (HOME and
``SKY_RUNTIME_DIR``: the package's ``sky_home``, seeded with the test catalog; never
the user's ``~/.sky``), a port of its own (``SKYPILOT_API_SERVER_LOCAL_PORT``, which
client and server both honour) and the network guard on its PYTHONPATH. With no
cloud enabled a launch is accepted and then fails inside SkyPilot's worker
(``NoCloudAccessError``): a real failure of a real request, which the launcher must
report through ``progress`` while ``launch`` itself returns at once.

Measured here: the server starts in ~9-10 s and the launch request fails ~20-25 s
after it was submitted (it waits for a worker, then SkyPilot finds no cloud), so the
module takes ~40 s and is ``long`` (run with ``-m long``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.domain.plan import Placement
from orchestrator.launchers.base import LaunchHandle, LaunchPhase, LaunchRequest
from orchestrator.launchers.skypilot import SkyPilotLauncher
from tests.planner.conftest import cli_env

pytestmark = [pytest.mark.long, pytest.mark.filterwarnings("ignore::Warning:sky")]

SKY = Path(sys.executable).with_name("sky")
A2 = Placement(
    cloud="gcp",
    region="us-central1",
    instance_type="a2-highgpu-8g",
    accelerator="A100",
    accelerator_count=8,
    num_nodes=2,
    spot=True,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def forget_server_url() -> None:
    """SkyPilot caches its server URL and health per process; a new port needs both
    forgotten."""
    from sky.server import common

    common.get_server_url.cache_clear()
    common.is_api_server_local.cache_clear()
    common.get_api_server_status_response.cache_clear()


@pytest.fixture(scope="module")
def api_server(sky_home: Path, sky: Any) -> Iterator[dict[str, Any]]:
    port = free_port()
    env = {
        **cli_env(sky_home),
        "SKYPILOT_API_SERVER_LOCAL_PORT": str(port),
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
    }
    mine = ("SKYPILOT_API_SERVER_LOCAL_PORT", "SKYPILOT_DISABLE_USAGE_COLLECTION")
    saved = {k: os.environ.get(k) for k in mine}
    t0 = time.monotonic()
    started = subprocess.run(
        [str(SKY), "api", "start"], env=env, capture_output=True, text=True, timeout=120
    )
    start_s = time.monotonic() - t0
    assert started.returncode == 0, started.stdout + started.stderr
    for k in mine:
        os.environ[k] = env[k]
    forget_server_url()
    try:
        yield {"port": port, "start_s": start_s, "home": sky_home}
    finally:
        subprocess.run([str(SKY), "api", "stop"], env=env, capture_output=True, timeout=60)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        forget_server_url()


#: A node image with torch (without one the launcher refuses the task). A container
#: image: a GCP image's first validation costs seconds, which the timed launch would pay.
IMAGE = "docker:pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime"


def request(attempt: int = 1) -> LaunchRequest:
    return LaunchRequest(job_id="j-real", attempt=attempt, placement=A2, command="python t.py")


def test_a_real_launch_returns_at_once_and_fails_inside_skypilot(api_server, capsys):
    from sky.server import common

    assert common.get_server_url() == f"http://127.0.0.1:{api_server['port']}"
    launcher = SkyPilotLauncher(poll_timeout_s=5.0, image_id=IMAGE)
    t0 = time.monotonic()
    handle = launcher.launch(request())
    launch_s = time.monotonic() - t0
    assert handle.cluster_name == "sr-j-real-a1" and handle.request_id

    seen: list[tuple[float, LaunchPhase, str]] = []
    polls: list[float] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        t = time.monotonic()
        p = launcher.progress(handle)
        polls.append(time.monotonic() - t)
        seen.append((time.monotonic() - t0, p.phase, p.detail))
        if p.phase is not LaunchPhase.PROVISIONING:
            break
        time.sleep(0.5)

    phases = [ph for _, ph, _ in seen]
    assert phases[0] is LaunchPhase.PROVISIONING  # accepted, not yet run
    assert phases[-1] is LaunchPhase.FAILED, seen[-1]
    assert set(phases[:-1]) == {LaunchPhase.PROVISIONING}
    final = launcher.progress(handle)
    assert final.phase is LaunchPhase.FAILED and not final.capacity
    # SkyPilot's own error, as its worker stored it, naming what was launched where
    assert final.detail.startswith(
        "SkyPilot could not launch sr-j-real-a1 on gcp/us-central1 a2-highgpu-8g: "
        "NoCloudAccessError: Cloud access is not set up."
    ), final.detail
    assert max(polls) < 2.0, polls

    # a second launch of the same attempt answers with the same request, submits none
    t1 = time.monotonic()
    again = launcher.launch(request())
    relaunch_s = time.monotonic() - t1
    assert again.request_id == handle.request_id
    # after a service restart too: the request comes from SkyPilot, not from memory
    fresh = SkyPilotLauncher(poll_timeout_s=5.0, image_id=IMAGE)
    assert fresh.launch(request()).request_id == handle.request_id
    assert fresh.progress(handle).detail == final.detail

    # a second attempt is a new launch: time the submission once the server is warm
    t2 = time.monotonic()
    second = launcher.launch(request(attempt=2))
    second_s = time.monotonic() - t2
    assert second.request_id not in ("", handle.request_id)

    # down is submitted and not waited on (this cluster never came up)
    t3 = time.monotonic()
    launcher.down(LaunchHandle(handle.cluster_name, "skypilot"))
    down_s = time.monotonic() - t3

    with capsys.disabled():
        print(
            f"\n[skypilot api server] start {api_server['start_s']:.1f} s; "
            f"launch call {launch_s:.2f} s (warm {second_s:.2f} s, repeat {relaunch_s:.2f} s); "
            f"FAILED seen after {seen[-1][0]:.1f} s over {len(polls)} polls, "
            f"slowest poll {max(polls) * 1000:.0f} ms; down call {down_s:.2f} s"
        )
    # The first submission of a process pays SkyPilot's cold start (the client's
    # health check, the server's first /validate): 3-4 s measured; later ones ~0.1 s.
    assert launch_s < 10.0 and second_s < 1.0 and relaunch_s < 1.0 and down_s < 1.0


def test_a_request_the_api_server_does_not_know_is_resolved_from_the_cluster(api_server):
    """The server is up and has no such request (it restarted: a new request database),
    and SkyPilot lists no such cluster: that launch is over, and not for want of capacity."""
    p = SkyPilotLauncher(poll_timeout_s=5.0, image_id=IMAGE).progress(
        LaunchHandle("sr-j-real-a9", "skypilot", request_id="00000000-dead-beef")
    )
    assert p.phase is LaunchPhase.FAILED and not p.capacity
    assert "lists no request" in p.detail and "no such cluster" in p.detail


def test_an_api_server_that_is_not_running_is_unknown_and_quick(api_server, monkeypatch):
    """Nothing listens on the port: the SDK answers ``api_status`` with [] for a local
    server that is not running, which must read as unknown, never as failed."""
    monkeypatch.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(free_port()))
    monkeypatch.setenv("SKYPILOT_DISABLE_LOCAL_API_SERVER", "1")  # never start one here
    forget_server_url()
    try:
        t0 = time.monotonic()
        p = SkyPilotLauncher(poll_timeout_s=5.0, image_id=IMAGE).progress(
            LaunchHandle("sr-j-real-a1", "skypilot", request_id="0123")
        )
        assert time.monotonic() - t0 < 5.0
        assert p.phase is LaunchPhase.UNKNOWN, p
    finally:
        monkeypatch.undo()
        forget_server_url()
