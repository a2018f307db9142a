"""The operator CLI against a real `skyresume serve` on an ephemeral port."""

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

from orchestrator.store import db

SKYRESUME = [sys.executable, "-m", "orchestrator.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def service(tmp_path: Path, request: pytest.FixtureRequest):
    """`skyresume serve` on SQLite (auto-migrated) or a migrated PostgreSQL database."""
    port = _free_port()
    env = {**os.environ, "SKYRESUME_HOME": str(tmp_path / "home"), "SKYRESUME_PORT": str(port)}
    env["SKYRESUME_RECONCILE"] = "false"  # these tests are about the CLI, not recovery
    env.pop("SKYRESUME_TOKEN", None)
    if getattr(request, "param", "sqlite") == "postgres":
        url = request.getfixturevalue("db_url_postgres")
        env["SKYRESUME_DATABASE_URL"] = url
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
            pytest.fail(f"serve exited: {proc.stderr.read()}")
    else:
        proc.kill()
        pytest.fail("serve did not become ready in 30 s")
    yield env
    proc.terminate()
    proc.wait(timeout=15)


@pytest.fixture
def db_url_postgres(postgres_server_url):
    from testkit import reset_postgres

    from orchestrator.store import db

    reset_postgres(postgres_server_url)
    db.upgrade(postgres_server_url)
    return postgres_server_url


def run(env, *args: str, input_: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SKYRESUME, *args], env=env, capture_output=True, text=True, timeout=60, input=input_
    )


def _spec_file(tmp_path: Path, **overrides) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_spec(**overrides)))
    return str(path)


@pytest.mark.parametrize(
    "service", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_submit_list_show_events_cancel_round_trip(service, tmp_path):
    out = run(service, "submit", _spec_file(tmp_path), "-o", "json")
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["id"]

    listed = json.loads(run(service, "jobs", "-o", "json").stdout)
    assert [j["id"] for j in listed["items"]] == [job_id]
    assert job_id in run(service, "jobs").stdout

    shown = json.loads(run(service, "show", job_id, "-o", "json").stdout)
    assert shown["status"] == "PENDING"

    token = (Path(service["SKYRESUME_HOME"]) / "token").read_text().strip()
    base = f"http://127.0.0.1:{service['SKYRESUME_PORT']}"
    httpx.post(
        f"{base}/v1/jobs/{job_id}/events",
        headers={"Authorization": f"Bearer {token}"},
        json={"idempotency_key": "n0:1", "kind": "preemption_notice", "node_id": "n0"},
    )
    events = json.loads(run(service, "events", job_id, "-o", "json").stdout)
    assert [e["kind"] for e in events["items"]] == ["preemption_notice"]

    assert run(service, "cancel", job_id).returncode == 0
    again = run(service, "cancel", job_id)
    assert again.returncode == 2 and again.stderr.startswith("error: illegal transition")
    # --follow ends by itself once the job is terminal and nothing new arrives.
    followed = run(service, "events", job_id, "--follow", "-o", "json", "--interval", "0.2")
    assert followed.returncode == 0 and len(followed.stdout.strip().splitlines()) == 1


def test_bad_spec_is_one_line_error_and_nothing_stored(service, tmp_path):
    out = run(service, "submit", _spec_file(tmp_path, num_nodes=-3, surprise=True))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "num_nodes" in out.stderr and "surprise: unknown field" in out.stderr
    assert json.loads(run(service, "jobs", "-o", "json").stdout)["total"] == 0


def test_missing_file_is_a_clear_error(service, tmp_path):
    out = run(service, "submit", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "cannot read" in out.stderr and "No such file" in out.stderr


def test_wrong_token_is_a_clear_error(service):
    out = run({**service, "SKYRESUME_TOKEN": "not-the-token"}, "jobs")
    assert out.returncode == 1
    assert out.stderr.startswith("error: the service rejected the token")
    assert "Traceback" not in out.stderr


def test_unknown_status_filter_is_a_clear_error(service):
    out = run(service, "jobs", "--status", "sleeping")
    assert out.returncode == 2 and "unknown status 'sleeping'" in out.stderr


def test_unreachable_service_is_a_clear_error(tmp_path):
    env = {**os.environ, "SKYRESUME_HOME": str(tmp_path), "SKYRESUME_PORT": str(_free_port())}
    out = run(env, "jobs")
    assert out.returncode == 1
    assert out.stderr.startswith("error: cannot reach the skyresume service")
    assert "Traceback" not in out.stderr


def test_db_upgrade_current_and_downgrade(tmp_path):
    env = {**os.environ, "SKYRESUME_HOME": str(tmp_path)}
    url = f"sqlite:///{tmp_path}/cli.db"
    up = run(env, "db", "upgrade", "--db-url", url)
    head = db.head_revision()
    assert up.returncode == 0 and f"revision {head}" in " ".join(up.stdout.split())
    assert run(env, "db", "current", "--db-url", url).stdout.strip() == head
    down = run(env, "db", "downgrade", "base", "--db-url", url)
    assert down.returncode == 0 and "base" in down.stdout


def test_db_upgrade_on_unreachable_database_is_a_clear_error(tmp_path):
    env = {**os.environ, "SKYRESUME_HOME": str(tmp_path)}
    out = run(env, "db", "upgrade", "--db-url", "postgresql://nobody:secret@127.0.0.1:1/x")
    assert out.returncode == 1 and out.stderr.startswith("error: upgrade of")
    assert "secret" not in out.stderr  # passwords never printed


def _db_session(env):  # type: ignore[no-untyped-def]
    """The serving instance's own SQLite database, written as the reconciler would."""
    from orchestrator.store.db import make_engine, make_sessionmaker

    engine = make_engine(f"sqlite:///{Path(env['SKYRESUME_HOME']) / 'skyresume.db'}")
    return engine, make_sessionmaker(engine)


def test_jobs_never_cuts_a_job_id_at_80_columns_nor_in_a_pipe(service, tmp_path):
    long_name = "ddp-tutorial-multinode-snapshot-resume-" * 2
    ids = []
    for _ in range(2):
        out = run(service, "submit", _spec_file(tmp_path, name=long_name[:63]), "-o", "json")
        ids.append(json.loads(out.stdout)["id"])
    engine, sm = _db_session(service)
    from orchestrator.domain.status import JobStatus
    from orchestrator.store import repo

    with sm.begin() as s:
        repo.set_status(s, ids[0], JobStatus.PROVISIONING, reason="x " * 120)
    engine.dispose()
    for columns in ("80", "60"):
        piped = run({**service, "COLUMNS": columns}, "jobs")  # captured: a pipe
        assert piped.returncode == 0, piped.stderr
        for job_id in ids:
            assert job_id in piped.stdout, piped.stdout
        assert max(len(line) for line in piped.stdout.splitlines()) <= int(columns)
    events = run({**service, "COLUMNS": "80"}, "events")
    assert events.returncode == 0, events.stderr


def _attempt(s, job_id: str, number: int, ranks: list[dict], **kw) -> None:  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    from orchestrator.store.models import Attempt, Node

    s.add(
        Attempt(
            job_id=job_id, number=number, cloud="local", region="local", instance_type="cpu",
            num_nodes=1, spot=True, knobs={}, started_at=datetime.now(UTC),
            state=kw.pop("state", "running"), launcher="local", **kw,
        )
    )  # fmt: skip
    s.add(
        Node(
            job_id=job_id, attempt=number, node_id=f"{job_id}-a{number}-n0", node_rank=0,
            address="10.0.0.1", state="running", progress={"ranks": ranks},
            registered_at=datetime.now(UTC),
        )
    )  # fmt: skip


def test_show_and_attempts_say_what_each_attempt_trained(service, tmp_path):
    job_id = json.loads(run(service, "submit", _spec_file(tmp_path), "-o", "json").stdout)["id"]
    assert f"{job_id} is PENDING; no attempt launched yet" in run(service, "show", job_id).stdout

    from orchestrator.domain.status import JobStatus
    from orchestrator.store import repo

    engine, sm = _db_session(service)
    with sm.begin() as s:
        # A plain script: its ranks are found, and never report a step.
        plain = [{"rank": 0, "local_rank": 0}, {"rank": 1, "local_rank": 1}]
        _attempt(s, job_id, 1, plain, state="ended", end_reason="node lost")
        # The relaunch of a training.Run script: resumed at 40, the ranks at 57 and 58.
        run_ranks = [{"rank": 0, "step": 57}, {"rank": 1, "step": 58}]
        _attempt(s, job_id, 2, run_ranks, resume_step=40, validated_step=40)
        repo.set_status(s, job_id, JobStatus.PROVISIONING)
        repo.set_status(s, job_id, JobStatus.RUNNING, reason="recovered: all ranks at step 40")
    engine.dispose()

    shown = run({**service, "COLUMNS": "200"}, "show", job_id).stdout
    assert f"{job_id} is RUNNING (recovered: all ranks at step 40)" in shown
    assert "attempt 2 running: from step 40; ranks at steps 57-58" in shown
    assert "None" not in shown

    listed = run({**service, "COLUMNS": "200"}, "attempts", job_id).stdout
    assert "from scratch; without progress reports" in listed
    assert "from step 40; ranks at steps 57-58" in listed
    assert "None" not in listed
