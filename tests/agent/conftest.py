"""Fixtures for the agent tests: jobs with an attempt, and (for the end-to-end tests)
a real ``skyresume serve`` on an ephemeral port plus the metadata simulator."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from testkit import job_spec

from orchestrator.store.models import Attempt

HERE = Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "rank_script.py"


def add_attempt(sessionmaker: Any, job_id: str, number: int = 1, state: str = "running") -> None:
    """An attempt row as the reconciler would write it when it launches."""
    with sessionmaker() as s, s.begin():
        s.add(
            Attempt(
                job_id=job_id,
                number=number,
                cloud="local",
                region="local",
                instance_type="cpu",
                num_nodes=1,
                spot=True,
                knobs={},
                started_at=datetime.now(UTC),
                state=state,
                launcher="local",
            )
        )


def set_attempt_state(sessionmaker: Any, job_id: str, number: int, state: str) -> None:
    from sqlalchemy import select

    with sessionmaker() as s, s.begin():
        a = s.scalars(
            select(Attempt).where(Attempt.job_id == job_id, Attempt.number == number)
        ).one()
        a.state = state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    """A running ``skyresume serve`` (SQLite) and what tests need to drive it."""

    url: str
    token: str
    home: Path
    env: dict[str, str]
    sessionmaker: Any
    proc: subprocess.Popen[str] | None = None

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )

    def new_job(self, attempt: int = 1) -> str:
        with self.http() as c:
            r = c.post("/v1/jobs", json=job_spec(num_nodes=1, ranks_per_node=2))
            r.raise_for_status()
            job_id = r.json()["id"]
        add_attempt(self.sessionmaker, job_id, attempt)
        return job_id

    def events(self, job_id: str) -> list[dict[str, Any]]:
        with self.http() as c:
            r = c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000})
            r.raise_for_status()
            return r.json()["items"]

    def start(self) -> None:
        # Its log goes to a file: an unread pipe fills up and stalls the server.
        self.home.mkdir(parents=True, exist_ok=True)
        with (self.home.parent / "serve.log").open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cli", "serve"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
            if self.proc.poll() is not None:
                log_text = (self.home.parent / "serve.log").read_text()
                raise RuntimeError(f"serve exited: {log_text}")
        self.proc.kill()
        raise RuntimeError("serve did not become ready in 60 s")

    def stop(self, *, crash: bool = False) -> None:
        """Terminate (or, with ``crash``, SIGKILL) the service. A graceful stop waits
        for in-flight requests, agents' command long-polls included."""
        if self.proc is not None and self.proc.poll() is None:
            if crash:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=40)
        self.proc = None


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from orchestrator.store.db import make_engine, make_sessionmaker

    home = tmp_path_factory.mktemp("svc") / "home"
    port = free_port()
    env = {**os.environ, "SKYRESUME_HOME": str(home), "SKYRESUME_PORT": str(port)}
    env.pop("SKYRESUME_TOKEN", None)
    env.pop("SKYRESUME_DATABASE_URL", None)
    # These tests drive attempts and commands by hand, as the reconciler would; a
    # running reconciler would launch the test jobs and answer the test events.
    env["SKYRESUME_RECONCILE"] = "0"
    svc = Service(f"http://127.0.0.1:{port}", "", home, env, None)
    svc.start()
    svc.token = (home / "token").read_text().strip()
    engine = make_engine(f"sqlite:///{home / 'skyresume.db'}")
    svc.sessionmaker = make_sessionmaker(engine)
    yield svc
    # Killed, not terminated: a graceful stop waits out the long-polls of agents that
    # are gone (the app's HTTP middleware hides their disconnect from the route).
    svc.stop(crash=True)
    engine.dispose()
