"""Factories and helpers shared by the test folders. A module of its own (not
conftest) because several folders have a conftest and the name would collide."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.domain.planner import Candidate
from orchestrator.domain.reconcile import LauncherAbilities
from orchestrator.launchers.base import (
    CapacityError,
    ClusterState,
    ClusterStatus,
    LaunchHandle,
    LaunchPhase,
    LaunchProgress,
    LaunchRequest,
)


def reset_postgres(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")


def short_busy_timeout(engine: Any, ms: int = 200) -> None:
    """SQLite connections of ``engine`` wait ``ms`` for a lock, not the service's 30 s:
    a transaction that would wait for the write lock fails at once with "database is
    locked". The pool is emptied, so every connection from now on is a new one."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _short(dbapi_conn, _record):  # type: ignore[no-untyped-def]
        dbapi_conn.execute(f"PRAGMA busy_timeout = {ms}")

    engine.dispose()


def job_spec(**overrides):  # type: ignore[no-untyped-def]
    """A valid job spec document; keyword arguments replace top-level fields."""
    doc = {
        "name": "gpt-small",
        "task": {"template": "gpt-cpu", "command": "python -m training.examples.train_gpt"},
        "num_nodes": 2,
        "min_nodes": 1,
        "ranks_per_node": 2,
        "accelerators": ["A100:8", "nvidia:40GB+:8"],
        "spot": True,
        "clouds": ["aws", "gcp"],
        "regions": ["us-east-1"],
        "checkpoint": {"uri": "file:///tmp/skyresume-ckpt", "every_steps": 50, "keep": 2},
    }
    doc.update(overrides)
    return doc


def job_with_running_attempt(app) -> str:  # type: ignore[no-untyped-def]
    """A job (``job_spec()``) stored with attempt 1 running on one local node: what the
    agent routes need to answer for a node; its id."""
    from datetime import UTC, datetime

    from orchestrator.domain.spec import validate_job_spec
    from orchestrator.store import repo
    from orchestrator.store.models import Attempt

    with app.state.sessionmaker.begin() as s:
        job = repo.create_job(s, validate_job_spec(job_spec()))
        s.add(
            Attempt(
                job_id=job.id, number=1, cloud="local", region="local", instance_type="cpu",
                num_nodes=1, spot=True, knobs={}, started_at=datetime.now(UTC),
                state="running", launcher="local",
            )
        )  # fmt: skip
        return str(job.id)


def kill_tree(pid: int, sig: int) -> None:
    """Signal a process and every descendant at once, as losing a node does.

    torchrun starts each worker in its own session, so killing torchrun's process
    group leaves the ranks running as orphans (DESIGN.md): collect the tree first.
    """
    import contextlib

    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    psutil.wait_procs(procs, timeout=30)


def torchrun(*args: str, nproc: int = 2, pythonpath: str = "") -> subprocess.Popen:
    """``torchrun --standalone`` on CPU with one thread per rank, output captured.

    ``args`` follow torchrun's own options: a script path or ``-m module``, then
    the script's arguments. skyresume owns restarts, so ``--max-restarts=0``.
    """
    root = Path(__file__).resolve().parents[1]
    path = f"{root}:{pythonpath}" if pythonpath else str(root)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        *args,
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


@dataclass
class FakeLauncher:
    """A two-node launcher for reconciler tests: records launches and teardowns;
    nodes named in ``dead`` are gone. It offers regions r1 (cheaper) and r2; regions
    in ``stocked_out`` refuse launches for capacity."""

    root: Path
    name: str = "fake"
    launched: list[LaunchRequest] = field(default_factory=list)
    downed: list[str] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)

    abilities = LauncherAbilities(restarts_in_place=True)
    stocked_out: set[str] = field(default_factory=set)
    restarted: list[LaunchRequest] = field(default_factory=list)
    provisioning: dict[str, LaunchProgress] = field(default_factory=dict)
    """cluster name -> what ``progress`` answers (default: up at once)."""

    def candidates(self, spec, *, replacement=False):  # type: ignore[no-untyped-def]
        return [
            Candidate("fake", r, "cpu", None, 0, None, 1.0 + k, 0.5 + k)
            for k, r in enumerate(("r1", "r2"))
        ]

    downed_nodes: list[tuple[str, ...]] = field(default_factory=list)

    @staticmethod
    def _ids(request: LaunchRequest) -> tuple[str, ...]:
        base = request.node_rank_base
        return tuple(
            f"{request.job_id}-a{request.attempt}-n{base + k}"
            for k in range(request.placement.num_nodes)
        )

    def restart(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        self.restarted.append(request)
        return LaunchHandle(previous.cluster_name, self.name, self._ids(request), previous.hosts)

    def progress(self, handle: LaunchHandle) -> LaunchProgress:
        return self.provisioning.get(
            handle.cluster_name, LaunchProgress(LaunchPhase.UP, hosts=handle.hosts)
        )

    def launch(self, request: LaunchRequest) -> LaunchHandle:
        if request.placement.region in self.stocked_out:
            raise CapacityError(f"InsufficientInstanceCapacity in {request.placement.region}")
        self.launched.append(request)
        ids = self._ids(request)
        base = request.node_rank_base
        hosts = tuple(f"h{request.attempt}-{base + k}" for k in range(len(ids)))
        cluster = f"{request.job_id}-a{request.attempt}" + (f"-b{base}" if base else "")
        return LaunchHandle(cluster, self.name, ids, hosts, request_id=f"req-{cluster}")

    def status(self, handle: LaunchHandle) -> ClusterStatus:
        up = tuple(n for n in handle.node_ids if n not in self.dead)
        full = len(up) == len(handle.node_ids)
        return ClusterStatus(ClusterState.UP if full else ClusterState.PARTIAL, up)

    def down(self, handle: LaunchHandle) -> None:
        self.downed.append(handle.cluster_name)
        self.downed_nodes.append(handle.node_ids)


@contextlib.contextmanager
def served(app, settings, **config):  # type: ignore[no-untyped-def]
    """``app`` behind uvicorn as ``serve`` configures it (``api/connections.py``:
    its limits from ``settings``), in a thread on a free port; its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    from orchestrator.api.connections import uvicorn_config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, settings, port=port, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def module_client(request: Any, tmp_path_factory: Any, name: str) -> Iterator[Any]:
    """An operator's TestClient on one app per database for a whole module (a module
    fixture parametrized sqlite/postgres calls it): a migrated database per test costs
    more than most claims, so such a module's tests make their own jobs."""
    from fastapi.testclient import TestClient

    from orchestrator.app import create_app
    from orchestrator.settings import Settings
    from orchestrator.store import db

    home = tmp_path_factory.mktemp(name)
    if request.param == "sqlite":
        url = f"sqlite:///{home / 'test.db'}"
    else:
        url = request.getfixturevalue("postgres_server_url")
        reset_postgres(url)
    db.upgrade(url)
    app = create_app(Settings(home=home / "home", database_url=url))
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {app.state.token}"
        yield c
    app.state.engine.dispose()


def cli_through(client: Any, monkeypatch: Any) -> Any:
    """``orchestrator.cli`` with its HTTP ``Client`` answered by ``client`` (a
    TestClient of the real app) instead of a socket; returns the module. A call the
    app refuses fails the test with the app's answer."""
    import orchestrator.cli as cli
    from orchestrator.commands import common

    class AppClient:
        def request(self, method: str, path: str, **kw: Any) -> Any:
            kw.pop("retries", None)
            r = client.request(method, path, **kw)
            assert r.is_success, r.text
            return r.json()

    monkeypatch.setattr(cli, "Client", AppClient)
    monkeypatch.setattr(common, "Client", AppClient)
    return cli


def chaos_incident(http: Any, job: str, chaos: dict[str, Any], deadline: float) -> ChaosOutcome:
    """Inject ``chaos`` (a ``/chaos`` body) into the attempt training now, wait for a
    later attempt to validate, and return the incident the fault opened with the
    attempts before and after it. Nothing assumes "attempt 2" or "the first incident":
    on a loaded machine an earlier attempt may have ended before the fault (seen in
    CI: a launch recovered once before step 20), and the claims are about the fault."""
    from orchestrator.demo import api_get, api_post, wait_for

    def attempts() -> list[dict[str, Any]]:
        return list(api_get(http, f"/v1/jobs/{job}/attempts")["items"])

    before = attempts()[-1]
    api_post(http, f"/v1/jobs/{job}/chaos", chaos)
    n = before["number"]
    wait_for(http, job, f"an attempt after {n} validated",
             lambda st, number, v, step: number > n and v is not None, deadline)  # fmt: skip
    incs = [i for i in api_get(http, f"/v1/jobs/{job}/incidents")["items"] if i["attempt"] == n]
    assert len(incs) == 1, f"incidents of attempt {n}: {incs}"
    after = next(a for a in attempts() if a["number"] == n + 1)
    return ChaosOutcome(incs[0], before, after)


@dataclass(frozen=True)
class ChaosOutcome:
    incident: dict[str, Any]
    before: dict[str, Any]
    """The attempt the fault was injected into."""
    after: dict[str, Any]
    """The attempt the recovery launched."""
