"""A real ``skyresume serve`` (SQLite, reconciler off) for the operator e2e tests:
started, stopped and started again on the same home, so a test can restart it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

SKYRESUME = [sys.executable, "-m", "orchestrator.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    def __init__(self, home: Path, **env: str) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "SKYRESUME_HOME": str(home), "SKYRESUME_PORT": str(self.port)}
        for k in ("SKYRESUME_TOKEN", "SKYRESUME_DATABASE_URL"):
            self.env.pop(k, None)
        # The tests drive attempts and protocol steps by hand, as the reconciler would.
        self.env["SKYRESUME_RECONCILE"] = "0"
        self.env.update(env)
        self.proc: subprocess.Popen[str] | None = None
        self.token = ""
        self._engine: Any = None
        self.sessionmaker: Any = None

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        with (self.home.parent / "serve.log").open("a") as log:
            self.proc = subprocess.Popen(
                [*SKYRESUME, "serve"], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
            if self.proc.poll() is not None:
                raise RuntimeError((self.home.parent / "serve.log").read_text())
        else:
            self.proc.kill()
            raise RuntimeError("serve did not become ready in 60 s")
        self.token = (self.home / "token").read_text().strip()
        if self.sessionmaker is None:
            from orchestrator.store.db import make_engine, make_sessionmaker

            self._engine = make_engine(f"sqlite:///{self.home / 'skyresume.db'}")
            self.sessionmaker = make_sessionmaker(self._engine)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._engine is not None:
            self._engine.dispose()

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*SKYRESUME, *args],
            env={**self.env, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def new_job(self, **spec: Any) -> str:
        from testkit import job_spec

        with self.http() as c:
            r = c.post("/v1/jobs", json=job_spec(num_nodes=1, ranks_per_node=2, **spec))
            r.raise_for_status()
            return str(r.json()["id"])

    def add_attempt(self, job_id: str, number: int = 1) -> None:
        from orchestrator.store.models import Attempt

        with self.sessionmaker() as s, s.begin():
            s.add(
                Attempt(
                    job_id=job_id, number=number, cloud="local", region="local",
                    instance_type="cpu", num_nodes=1, spot=True, knobs={},
                    started_at=datetime.now(UTC), state="running", launcher="local",
                )
            )  # fmt: skip
