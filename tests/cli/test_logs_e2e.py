"""``skyresume logs`` and ``watch`` against a real service and a real agent whose
whole node is then SIGKILLed: the agent uploaded its tails every 0.5 s, so the
service still holds the node's last lines, and ``logs`` prints them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from operator_service import Serve

from orchestrator.api.auth import job_token

pytestmark = pytest.mark.long

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    s = Serve(tmp_path_factory.mktemp("logs") / "home")
    s.start()
    yield s
    s.close()


def start_agent(serve: Serve, job_id: str, tmp: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SKYRESUME_AGENT_TOKEN": job_token(serve.token, job_id, 1),
        "SKYRESUME_AGENT_LOG_UPLOAD_S": "0.5",
        "PYTHONPATH": str(HERE.parents[1]),
    }
    argv = [
        sys.executable, "-m", "orchestrator.agent", "--service-url", serve.url,
        "--job-id", job_id, "--attempt", "1", "--node-id", "n0", "--nproc-per-node", "2",
        "--launcher", "direct", "--local-dir", str(tmp / "n0"), "--heartbeat-s", "0.2",
        "--poll-s", "0.2", "--", sys.executable, str(HERE / "printing_rank.py"),
    ]  # fmt: skip
    with (tmp / "agent.log").open("w") as out:
        # Its own session: agent and direct ranks are one process group, the node.
        return subprocess.Popen(argv, env=env, stdout=out, stderr=out, start_new_session=True)


def rank_lines(path: Path) -> list[int]:
    return [int(m) for m in re.findall(r"rank 0 line (\d+)", path.read_text())]


def test_logs_prints_a_sigkilled_nodes_last_lines(serve: Serve, tmp_path: Path) -> None:
    job = serve.new_job()
    serve.add_attempt(job)
    agent = start_agent(serve, job, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with serve.http() as c:
                got = c.get(f"/v1/jobs/{job}/logs").json()["items"]
            rank0 = next((i for i in got if i["source"] == "rank0"), None)
            if rank0 and len(rank0["lines"]) > 20:
                break
            time.sleep(0.3)
        else:
            pytest.fail("the agent uploaded no rank log: " + (tmp_path / "agent.log").read_text())
        watched = serve.cli("watch", job, "--once")
        assert watched.returncode == 0, watched.stderr
        assert "n0" in watched.stdout and "RUNNING" not in watched.stderr
    finally:
        os.killpg(agent.pid, signal.SIGKILL)  # the whole node, agent included: no exit upload
        agent.wait()
    rank_log = next((tmp_path / "n0").rglob("*rank0*"), None) or next(
        p for p in (tmp_path / "n0").rglob("*.log") if "rank 0 line" in p.read_text()
    )
    printed = rank_lines(rank_log)

    out = serve.cli("logs", job, "--node", "0", "--rank", "0")
    assert out.returncode == 0, out.stderr
    shown = [int(m) for m in re.findall(r"^rank 0 line (\d+)$", out.stdout, re.M)]
    assert shown, out.stdout
    # The last lines it shows are the node's last lines, but for at most the ~0.5 s
    # (10 lines) between its last upload and the kill.
    assert shown == printed[printed.index(shown[0]) : printed.index(shown[-1]) + 1]
    assert printed[-1] - shown[-1] <= 20, (printed[-1], shown[-1])
    assert "rank 1 line" not in out.stdout  # --rank 0: that rank alone

    everything = serve.cli("logs", job, "--node", "0")
    assert "n0 (node rank 0" in everything.stdout
    for source in ("agent: ", "rank0: ", "rank1: "):
        assert f" {source}" in everything.stdout, source
    assert "skyresume-agent[n0]" in everything.stdout  # the agent's own log lines
