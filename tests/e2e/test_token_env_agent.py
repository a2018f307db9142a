"""The agent passes its token to no child: a real agent starts torchrun and a rank,
and the rank reads its own and torchrun's environment from /proc. (The whole-run
claim, every process of every node of a real service's launch, is
test_token_env_e2e.py, which takes longer.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sra_" + "5e" * 32

#: The rank: copy its own environment and its parent's (torchrun's) where the test reads.
RANK = """
import os, pathlib, sys
out = pathlib.Path(sys.argv[1])
out.joinpath("rank.env").write_bytes(pathlib.Path("/proc/self/environ").read_bytes())
out.joinpath("parent.env").write_bytes(pathlib.Path(f"/proc/{os.getppid()}/environ").read_bytes())
out.joinpath("parent.cmd").write_bytes(pathlib.Path(f"/proc/{os.getppid()}/cmdline").read_bytes())
import time; time.sleep(3)  # long enough for the agent to find the rank (it scans /proc)
"""


@pytest.mark.parametrize("launcher", ["torchrun", "direct"])
def test_torchrun_and_the_ranks_inherit_no_agent_token(tmp_path, launcher):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
    env.update(SKYRESUME_AGENT_TOKEN=SECRET, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [
        sys.executable, "-m", "orchestrator.agent", "--job-id", "j-env", "--attempt", "1",
        "--node-id", "n0", "--local-dir", str(tmp_path / "n0"), "--launcher", launcher,
        "--nproc-per-node", "1", "--provider", "none", "--health-checks", "off",
        "--grace-s", "5", "--", sys.executable, str(script), str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    rank_env = (tmp_path / "rank.env").read_bytes()
    parent_env = (tmp_path / "parent.env").read_bytes()
    assert b"RANK=0" in rank_env.split(b"\0")  # it really is the rank
    assert SECRET.encode() not in rank_env
    if launcher == "torchrun":  # (with ``direct`` the parent is the agent itself)
        assert b"torch.distributed.run" in (tmp_path / "parent.cmd").read_bytes()
        assert SECRET.encode() not in parent_env
    assert SECRET not in out.stderr + out.stdout  # nor in the agent's own log
