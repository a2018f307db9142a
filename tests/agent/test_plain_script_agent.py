"""What the agent adds for a script that sends no progress reports (issue 27): each
rank's CPU use in its heartbeat, and ``checkpoint.own`` appended where the node has
it. Processes and files here are real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.agent import ranks as rk
from orchestrator.agent.main import Agent, parse_args
from orchestrator.contract import Env


def test_cpu_ticks_are_user_plus_system_time_from_proc_stat(tmp_path):
    # comm with spaces and parentheses, as a rank's may have; utime 120, stime 30.
    stat = "4242 (python (rank 3)) S 1 4242 4242 0 -1 4194560 500 0 0 0 120 30 0 0 20 0 4 0"
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "stat").write_text(stat)
    assert rk.cpu_ticks(4242, proc=str(tmp_path)) == 150


def test_a_process_that_is_gone_has_no_cpu_ticks():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert rk.cpu_ticks(child.pid) is None


def test_a_busy_process_s_cpu_ticks_grow():
    first = rk.cpu_ticks(os.getpid())
    assert first is not None
    now = first
    for _ in range(10_000):  # burn CPU until the kernel's tick count moves
        sum(i * i for i in range(10_000))
        now = rk.cpu_ticks(os.getpid()) or 0
        if now > first:
            break
    assert now > first


def _agent(tmp_path: Path, own: Path) -> Agent:
    out = tmp_path / "argv.txt"
    cfg = parse_args(
        [
            "--job-id", "j", "--attempt", "2", "--node-id", "n0",
            "--local-dir", str(tmp_path / "node"), "--launcher", "direct", "--",
            "python", "-c", f"import sys; open({str(out)!r}, 'w').write(' '.join(sys.argv[1:]))",
        ]
    )  # fmt: skip
    environ = {Env.OWN_CHECKPOINT: str(own), Env.OWN_RESUME_ARG: "--snapshot_path"}
    return Agent(cfg, token=None, environ=environ)


def _argv_of_rank(agent: Agent, tmp_path: Path) -> str:
    for r in agent.ranks:
        assert r.proc is not None
        r.proc.wait(timeout=60)
    return (tmp_path / "argv.txt").read_text()


def test_the_script_s_own_checkpoint_is_passed_where_the_node_has_it(tmp_path):
    own = tmp_path / "snapshot.pt"
    own.write_bytes(b"weights")
    agent = _agent(tmp_path, own)
    agent.start_ranks()
    assert _argv_of_rank(agent, tmp_path) == f"--snapshot_path {own}"
    assert agent._heartbeat_body()["own_checkpoint"] == {"path": str(own), "found": True}


def test_no_argument_is_passed_where_the_node_lacks_it_and_the_heartbeat_says_so(tmp_path):
    own = tmp_path / "snapshot.pt"
    agent = _agent(tmp_path, own)
    agent.start_ranks()
    assert _argv_of_rank(agent, tmp_path) == ""
    assert agent._heartbeat_body()["own_checkpoint"] == {"path": str(own), "found": False}


def test_a_heartbeat_carries_each_rank_s_cpu_idle_time(tmp_path):
    agent = _agent(tmp_path, tmp_path / "absent")
    agent.start_ranks()
    (row,) = agent._heartbeat_body()["ranks"]
    assert "cpu_idle_s" in row
    _argv_of_rank(agent, tmp_path)
    agent.ranks[0].exited = True
    (done,) = agent._heartbeat_body()["ranks"]
    assert done["cpu_idle_s"] is None  # an exited rank uses nothing and is not measured
