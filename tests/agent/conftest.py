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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve"],
            env=self.env,
            stderr=subprocess.PIPE,
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
                raise RuntimeError(f"serve exited: {self.proc.stderr.read()}")  # type: ignore[union-attr]
        self.proc.kill()
        raise RuntimeError("serve did not become ready in 60 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
        self.proc = None


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from orchestrator.store.db import make_engine, make_sessionmaker

    home = tmp_path_factory.mktemp("svc") / "home"
    port = free_port()
    env = {**os.environ, "SKYRESUME_HOME": str(home), "SKYRESUME_PORT": str(port)}
    env.pop("SKYRESUME_TOKEN", None)
    env.pop("SKYRESUME_DATABASE_URL", None)
    svc = Service(f"http://127.0.0.1:{port}", "", home, env, None)
    svc.start()
    svc.token = (home / "token").read_text().strip()
    engine = make_engine(f"sqlite:///{home / 'skyresume.db'}")
    svc.sessionmaker = make_sessionmaker(engine)
    yield svc
    svc.stop()
    engine.dispose()
