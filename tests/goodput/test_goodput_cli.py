"""`skyresume goodput` as a subprocess against a real `skyresume serve`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from goodput_history import JobHistory, plain_script_job, two_incident_job

from orchestrator.store.db import make_engine, make_sessionmaker

SKYRESUME = [sys.executable, "-m", "orchestrator.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):
    """`skyresume serve` on SQLite (reconciler off: the history is written here) with
    two jobs. The API these commands read is tested on PostgreSQL too
    (test_goodput_api.py); one server start is enough for the client."""
    home = tmp_path_factory.mktemp("home")
    port = _free_port()
    env = {
        **os.environ,
        "SKYRESUME_HOME": str(home),
        "SKYRESUME_PORT": str(port),
        "SKYRESUME_RECONCILE": "0",
        "COLUMNS": "200",  # one layout, whatever terminal runs the tests
    }
    env.pop("SKYRESUME_TOKEN", None)
    url = f"sqlite:///{home / 'skyresume.db'}"
    proc = subprocess.Popen([*SKYRESUME, "serve"], env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            pytest.fail(f"serve exited: {proc.stderr.read() if proc.stderr else ''}")
    else:
        proc.kill()
        pytest.fail("serve did not become ready in 30 s")
    engine = make_engine(url)
    with make_sessionmaker(engine)() as s:
        busy = two_incident_job(s, "gpt-7b-spot")
        quiet = JobHistory(s, "never-failed")
        plain = plain_script_job(s)
        s.commit()
        ids = {"busy": busy.id, "quiet": quiet.id, "plain": plain.id}
    engine.dispose()
    yield env, ids
    proc.terminate()
    proc.wait(timeout=15)


def run(env, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SKYRESUME, *args], env=env, capture_output=True, text=True, timeout=60)


def test_json_is_the_api_document(service):
    env, ids = service
    out = run(env, "goodput", ids["busy"], "-o", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    token = (Path(env["SKYRESUME_HOME"]) / "token").read_text().strip()
    api = httpx.get(
        f"http://127.0.0.1:{env['SKYRESUME_PORT']}/v1/jobs/{ids['busy']}/goodput",
        headers={"Authorization": f"Bearer {token}"},
    ).json()
    assert doc == api
    assert [i["failure_class"] for i in doc["incidents"]] == ["preemption_notice", "node_lost"]
    assert doc["effective_training_fraction"] == pytest.approx(16_771.3 / 18_000, abs=1e-5)


def test_table_shows_the_split_and_each_incidents_protocol_steps(service):
    env, ids = service
    out = run(env, "goodput", ids["busy"])
    assert out.returncode == 0, out.stderr
    assert "effective training time 93.2% (final)" in out.stdout
    assert "2 restarts" in out.stdout
    for text in ("idle (queued, no attempt)", "preemption_notice", "node_lost", "STAGE"):
        assert text in out.stdout
    assert "5.2m" in out.stdout  # the 310 s launch of the notice-driven recovery
    assert "63 steps, 2.0m" in out.stdout  # redone after the node loss


def test_a_plain_scripts_lost_training_time_is_shown_not_zero(service):
    env, ids = service
    out = run(env, "goodput", ids["plain"])
    assert out.returncode == 0, out.stderr
    assert "20.0m of training (no step reports)" in out.stdout
    assert "lost work (thrown away)" in out.stdout
    assert "0.0s      0.0%" not in out.stdout.split("lost work")[1].splitlines()[0]


def test_job_without_incidents_says_so(service):
    env, ids = service
    out = run(env, "goodput", ids["quiet"])
    assert out.returncode == 0, out.stderr
    assert "no incidents" in out.stdout and "effective training time 0.0% (so far)" in out.stdout


def test_unknown_job_is_one_error_line_exit_2(service):
    env, _ = service
    out = run(env, "goodput", "j-nope")
    assert out.returncode == 2
    assert out.stderr == "error: job j-nope not found\n"
