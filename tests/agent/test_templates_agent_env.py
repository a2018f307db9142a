"""The task templates give the agent what its health checks and evidence need: the
node's GPU count, NCCL's fail-fast and Flight Recorder settings
with the dumps on the node's disk. The run section runs in bash with a fake
``skyresume-agent`` that records its argv and environment."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

TEMPLATES = Path(__file__).resolve().parents[2] / "task_templates"


def run_section(template: str, tmp_path: Path, gpus: str) -> tuple[list[str], dict[str, str]]:
    task = yaml.safe_load((TEMPLATES / f"{template}.yaml").read_text())
    bindir = tmp_path / "bin"
    bindir.mkdir()
    agent = bindir / "skyresume-agent"
    agent.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$OUT/argv"\nenv > "$OUT/env"\n')
    agent.chmod(0o755)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "OUT": str(tmp_path),
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "10.0.0.11",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": gpus,
        "SKYRESUME_RUN_SERVICE_URL": "http://10.0.0.5:8470",
        "SKYRESUME_RUN_JOB_ID": "j-1",
        "SKYRESUME_RUN_ATTEMPT": "1",
        **{k: str(v) for k, v in task["envs"].items()},
        "SKYRESUME_COMMAND": "python train.py",
    }
    subprocess.run(["bash", "-c", task["run"]], env=env, check=True, timeout=30)
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    seen = dict(
        line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line
    )
    return argv, seen


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    ("template", "gpus"), [("skypilot-gpu", "8"), ("gpt-cpu", "0")], ids=["gpu", "cpu"]
)
def test_templates_pass_the_gpu_count_disk_estimate_and_nccl_evidence_settings(
    tmp_path, template, gpus
):
    argv, env = run_section(template, tmp_path, gpus)
    assert argv[argv.index("--expect-gpus") + 1] == gpus  # 0 on CPU: GPU check skipped
    # The other health settings reach the agent as SKYRESUME_AGENT_* variables in
    # the run environment, which a flag here would override.
    assert not [a for a in argv if a.startswith("--min-")]
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    prefix = env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert prefix == f"{tmp_path}/home/skyresume/node/nccl_trace/rank_"
    assert Path(prefix).parent.is_dir()
