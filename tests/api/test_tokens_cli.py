"""``skyresume token ...`` against a real ``skyresume serve`` (SQLite, local mode: the
CLI holds the bootstrap token from ``<home>/token``)."""

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
import yaml
from testkit import job_spec

SKYRESUME = [sys.executable, "-m", "orchestrator.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    home = tmp_path_factory.mktemp("tokens-cli") / "home"
    port = _free_port()
    env = {**os.environ, "SKYRESUME_HOME": str(home), "SKYRESUME_PORT": str(port)}
    env["SKYRESUME_RECONCILE"] = "false"
    env.pop("SKYRESUME_TOKEN", None)
    proc = subprocess.Popen([*SKYRESUME, "serve"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            pytest.fail(f"serve exited: {proc.stderr.read() if proc.stderr else ''}")
    else:
        proc.kill()
        pytest.fail("serve did not become ready in 60 s")
    yield env
    proc.terminate()
    proc.wait(timeout=15)


def run(env, *args: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run([*SKYRESUME, *args], env=env, capture_output=True, text=True, timeout=60)


def test_create_prints_the_token_once_alone_on_stdout_and_list_never_shows_it(service):
    out = run(service, "token", "create", "--role", "viewer", "--name", "dash")
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert token.startswith("sro_") and out.stdout.count("\n") == 1
    assert "'dash'" in out.stderr and "role viewer" in out.stderr and token not in out.stderr
    listed = run(service, "token", "list")
    assert listed.returncode == 0 and "dash" in listed.stdout and "viewer" in listed.stdout
    as_json = run(service, "token", "list", "-o", "json")
    assert token not in listed.stdout + as_json.stdout
    assert [t["name"] for t in json.loads(as_json.stdout)["items"]] == ["dash"]


def test_a_viewer_lists_jobs_cannot_submit_and_a_revoked_one_is_rejected(service, tmp_path):
    token = run(service, "token", "create", "--role", "viewer", "--name", "ro").stdout.strip()
    viewer = {**service, "SKYRESUME_TOKEN": token}
    assert run(viewer, "jobs").returncode == 0
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job_spec()))
    refused = run(viewer, "submit", str(spec))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("error: POST /v1/jobs needs role operator")
    assert run(viewer, "token", "list").stderr.startswith("error: GET /v1/tokens needs role admin")

    revoked = run(service, "token", "revoke", "ro")
    assert revoked.returncode == 0 and "revoked token 'ro'" in revoked.stdout
    after = run(viewer, "jobs")
    assert after.returncode == 1
    assert after.stderr.startswith("error: the service rejected the token")
    assert run(service, "token", "revoke", "ro").returncode == 2  # 404: no live token of that name


def test_a_bad_role_is_refused_by_the_cli_itself(service):
    out = run(service, "token", "create", "--role", "root", "--name", "x")
    assert out.returncode == 2 and "root" in out.stderr


def test_revoke_sessions_ends_every_dashboard_login(service):
    port = service["SKYRESUME_PORT"]
    bootstrap = (Path(service["SKYRESUME_HOME"]) / "token").read_text().strip()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", follow_redirects=False) as c:
        r = c.post("/dashboard/login", data={"token": bootstrap})
        assert r.status_code == 303 and c.get("/dashboard/").status_code == 200
        out = run(service, "token", "revoke-sessions")
        assert out.returncode == 0 and "1 dashboard session(s) ended" in out.stdout
        assert c.get("/dashboard/").status_code == 303
