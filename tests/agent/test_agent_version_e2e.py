"""An agent of another version meets a real ``skyresume serve``: it exits with one
clear line and its own exit code, and no rank ever starts. The agent is the real one,
run as another version would be (``orchestrator.__version__`` set before it loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Service

from orchestrator import __version__
from orchestrator.agent.main import EXIT_AGENT_MISMATCH
from orchestrator.api.auth import job_token
from orchestrator.store import agents

ROOT = Path(__file__).resolve().parents[2]


def run_agent_as(version: str, service: Service, job_id: str, tmp_path: Path):
    marker = tmp_path / "rank-ran"
    code = (
        "import sys, orchestrator; "
        f"orchestrator.__version__ = {version!r}; "
        "from orchestrator.agent.main import main; main(sys.argv[1:])"
    )
    argv = [
        sys.executable, "-c", code,
        "--service-url", service.url, "--job-id", job_id, "--attempt", "1",
        "--node-id", "n0", "--local-dir", str(tmp_path / "n0"), "--launcher", "direct",
        "--health-checks", "off",
        "--command", f"python -c \"open('{marker}', 'w')\"",
    ]  # fmt: skip
    env = {
        **os.environ,
        "SKYRESUME_AGENT_TOKEN": job_token(service.token, job_id, 1),
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    return out, marker


@pytest.mark.parametrize("version", ["0.0.1", "99.0.0"], ids=["older-agent", "newer-agent"])
def test_an_agent_of_another_version_exits_with_one_line_naming_both(
    service: Service, tmp_path, version
):
    job_id = service.new_job()
    out, marker = run_agent_as(version, service, job_id, tmp_path)
    assert out.returncode == EXIT_AGENT_MISMATCH, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("skyresume-agent: error:")]
    assert len(errors) == 1, out.stderr
    assert f"skyresume {version}" in errors[0] and f"skyresume {__version__}" in errors[0]
    assert "Traceback" not in out.stderr
    assert not marker.exists()  # no rank was ever started
    with service.sessionmaker() as s:
        assert agents.list_nodes(s, job_id) == []  # and the service stored no node


def test_the_agent_of_this_version_registers_and_runs(service: Service, tmp_path):
    job_id = service.new_job()
    out, marker = run_agent_as(__version__, service, job_id, tmp_path)
    assert out.returncode == 0, out.stderr
    assert marker.exists()
    with service.sessionmaker() as s:
        assert [n.node_id for n in agents.list_nodes(s, job_id)] == ["n0"]
