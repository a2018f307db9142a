"""The task templates start the real agent from the environment SkyPilot gives a node.

The setup section installs the served wheel (pinned by its hash) into a directory of
its own; the run section is ``python3 -m orchestrator.agent --from-env`` with that
directory first on PYTHONPATH. These tests run both sections in bash as SkyPilot
would, with a ``python3`` on PATH that is this interpreter, and read what the agent
resolved (``--print-config``) or what a rank received."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port

from orchestrator.agent.main import parse_args

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "task_templates"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def node_env(tmp_path: Path, template: str, gpus: str, **extra: str) -> dict[str, str]:
    """What SkyPilot sets on node 0 of a 2-node cluster, plus the template's envs."""
    task = yaml.safe_load((TEMPLATES / f"{template}.yaml").read_text())
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    # A wrapper, not a symlink: a venv's interpreter finds its site-packages from its
    # own path, so a link elsewhere would lose torch.
    py = bindir / "python3"
    py.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    py.chmod(0o755)
    return {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(ROOT),  # the checkout stands in for the installed wheel
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NODE_IPS": "10.0.0.11\n10.0.0.12",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": gpus,
        "SKYPILOT_TASK_ID": "sky-2024-01-01-00-00-00-000000_sr-j-1-a3_1",
        "SKYRESUME_RUN_SERVICE_URL": "http://10.0.0.5:8470",
        "SKYRESUME_RUN_JOB_ID": "j-1",
        "SKYRESUME_RUN_ATTEMPT": "3",
        "SKYRESUME_RUN_RESUME_FROM": "{node_disk}/staged/step_300",
        **{k: str(v) for k, v in task["envs"].items()},
        "SKYRESUME_RANKS_PER_NODE": "3",
        "SKYRESUME_PROVIDER": "aws",
        "SKYRESUME_METADATA_URL": "http://169.254.169.254",
        "SKYRESUME_GRACE_S": "120",
        "SKYRESUME_COMMAND": "python train.py --lr '3e-4 warm'",
        **extra,
    }


def run_section(
    template: str, env: dict[str, str], *extra_flags: str
) -> subprocess.CompletedProcess:
    run = yaml.safe_load((TEMPLATES / f"{template}.yaml").read_text())["run"]
    # The run section's one command, with flags appended (as an operator would).
    run = run.replace("--from-env", "--from-env " + " ".join(extra_flags))
    return subprocess.run(
        ["bash", "-c", run], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    ("template", "gpus", "nproc"),
    [("skypilot-gpu", "8", 8), ("gpt-cpu", "0", 3)],
    ids=["gpu", "cpu-falls-back-to-ranks-per-node"],
)
def test_run_section_gives_the_agent_every_node_fact_from_the_environment(
    tmp_path, template, gpus, nproc
):
    env = node_env(tmp_path, template, gpus)
    out = run_section(template, env, "--print-config")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    cfg = doc["config"]
    home = tmp_path / "home"
    assert cfg["node_rank"] == 1 and cfg["nnodes"] == 2
    assert cfg["nproc_per_node"] == nproc
    assert cfg["expect_gpus"] == int(gpus)  # 0 on CPU: the GPU check is skipped
    assert cfg["master_addr"] == "10.0.0.11"  # the first of SKYPILOT_NODE_IPS
    assert cfg["node_id"] == "j-1-a3-n1"
    assert (cfg["job_id"], cfg["attempt"]) == ("j-1", 3)
    assert cfg["service_url"] == "http://10.0.0.5:8470"
    assert (cfg["provider"], cfg["metadata_url"]) == ("aws", "http://169.254.169.254")
    assert (cfg["grace_s"], cfg["heartbeat_s"], cfg["poll_s"]) == (120.0, 1.0, 1.0)
    assert cfg["master_port"] == 29500
    assert cfg["local_dir"] == str(home / "skyresume" / "node")
    assert cfg["log_dir"] == str(home / "skyresume" / "logs")
    assert cfg["sky_task_id"] == env["SKYPILOT_TASK_ID"]
    assert cfg["command"] == ["python", "train.py", "--lr", "3e-4 warm"]
    # {node_disk} in the run context names this node's disk, for the ranks and staging
    assert doc["run_env"]["SKYRESUME_RUN_RESUME_FROM"] == f"{home}/skyresume/node/staged/step_300"


def test_flags_override_the_environment():
    env = {
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NUM_NODES": "4",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        "SKYRESUME_RUN_JOB_ID": "j-1",
        "SKYRESUME_RUN_ATTEMPT": "1",
        "SKYRESUME_MASTER_PORT": "29500",
        "SKYRESUME_COMMAND": "python env.py",
    }
    cfg = parse_args(
        ["--from-env", "--local-dir", "/tmp/d", "--nproc-per-node", "2", "--master-port", "4000"],
        env,
    )
    assert (cfg.nnodes, cfg.nproc_per_node, cfg.master_port) == (4, 2, 4000)
    assert cfg.expect_gpus == 8
    cfg = parse_args(["--from-env", "--local-dir", "/tmp/d", "--", "python", "argv.py"], env)
    assert cfg.command == ("python", "argv.py")


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({"SKYRESUME_RUN_ATTEMPT": "x"}, [], r"\$SKYRESUME_RUN_ATTEMPT must be an integer"),
        ({"SKYRESUME_GRACE_S": "soon"}, [], r"\$SKYRESUME_GRACE_S must be a number"),
        ({"SKYRESUME_COMMAND": "python 'unbalanced"}, [], r"\$SKYRESUME_COMMAND is not a valid"),
        ({"SKYRESUME_COMMAND": ""}, [], "no command"),
        ({}, ["--command", "a", "--", "b"], "not both"),
        ({"SKYRESUME_RUN_JOB_ID": ""}, [], r"missing --job-id \(or \$SKYRESUME_RUN_JOB_ID\)"),
    ],
    ids=["attempt", "grace", "quotes", "empty-command", "two-commands", "no-job"],
)
def test_a_bad_environment_value_is_a_usage_error_naming_the_variable(env, flags, message):
    from orchestrator.agent.main import UsageError

    base = {
        "SKYRESUME_RUN_JOB_ID": "j-1",
        "SKYRESUME_RUN_ATTEMPT": "1",
        "SKYRESUME_COMMAND": "python t.py",
    }
    with pytest.raises(UsageError, match=message):
        parse_args(["--from-env", "--local-dir", "/tmp/d", *flags], {**base, **env})


ARGV_RANK = (
    "import json, os, sys, time; "
    "json.dump(sys.argv[1:], open(os.environ['ARGV_OUT'] + '.' + os.environ['RANK'], 'w')); "
    "time.sleep(1.5)"  # long enough for the agent to see the rank it started
)


def test_the_command_reaches_the_rank_exactly_as_shlex_splits_it(tmp_path):
    """Nothing a shell would do happens: no $(...) runs, no glob, no variable, quotes
    group words. The run section and the agent pass the string on untouched."""
    canary = tmp_path / "canary"
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "a.txt").write_text("a glob would find me")
    command = (
        f"python -c {shlex.quote(ARGV_RANK)} "
        f"\"$(touch {canary})\" '*' * $HOME \"two words\" 'it'\"'\"'s' `id` \\$x"
    )
    env = node_env(
        tmp_path,
        "gpt-cpu",
        "0",
        SKYPILOT_NODE_RANK="0",
        SKYPILOT_NUM_NODES="1",
        SKYPILOT_NODE_IPS="127.0.0.1",
        SKYRESUME_RANKS_PER_NODE="1",
        SKYRESUME_MASTER_PORT=str(free_port()),
        SKYRESUME_PROVIDER="none",
        SKYRESUME_METADATA_URL="",
        SKYRESUME_RUN_SERVICE_URL="",  # no service: the agent runs the ranks alone
        SKYRESUME_COMMAND=command,
        SKYRESUME_AGENT_HEALTH_CHECKS="off",
        ARGV_OUT=str(tmp_path / "argv"),
    )
    env.pop("SKYRESUME_RUN_SERVICE_URL")
    out = subprocess.run(
        ["bash", "-c", yaml.safe_load((TEMPLATES / "gpt-cpu.yaml").read_text())["run"]],
        env=env,
        cwd=tmp_path / "work",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads((tmp_path / "argv.0").read_text())
    assert got == shlex.split(command)[3:]
    assert got == [
        f"$(touch {canary})",
        "*",
        "*",
        "$HOME",
        "two words",
        "it's",
        "`id`",
        "$x",
    ]
    assert not canary.exists()  # the $(...) never ran


# --- the setup section: the served wheel, nothing else --------------------------------


def _wheel(tmp_path: Path) -> Path:
    from orchestrator.package import WheelCache

    return WheelCache(tmp_path / "svc").wheel().path


def _setup(env: dict[str, str], template: str) -> subprocess.CompletedProcess:
    setup = yaml.safe_load((TEMPLATES / f"{template}.yaml").read_text())["setup"]
    return subprocess.run(
        ["bash", "-c", setup], env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("template", ["gpt-cpu", "skypilot-gpu"])
def test_setup_installs_the_pinned_wheel_where_the_agent_runs_from(tmp_path, template):
    wheel = _wheel(tmp_path)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    env = node_env(tmp_path, template, "0")
    env.pop("PYTHONPATH")
    env["SKYRESUME_PACKAGE"] = f"file://{wheel}#sha256={sha}"
    # No index: the node needs nothing but the served wheel (py-spy is optional).
    env["SKYRESUME_PIP_ARGS"] = "--no-index --no-cache-dir"
    out = _setup(env, template)
    assert out.returncode == 0, out.stderr
    pkg = tmp_path / "home" / "skyresume" / "pkg"
    assert (pkg / "orchestrator" / "agent" / "main.py").is_file()
    assert (pkg / "training").is_dir()
    assert not (pkg / "fastapi").exists()  # --no-deps: the service's deps stay off nodes
    # The run section's PYTHONPATH puts it first: this is the agent that runs.
    probe = subprocess.run(
        ["bash", "-c", 'export PYTHONPATH="$HOME/skyresume/pkg"; '
         "python3 -P -c 'import orchestrator.package as p, orchestrator; "
         "print(orchestrator.__file__); print(p.installed_build_id())'"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    where, build = probe.stdout.split()
    assert where.startswith(str(pkg))
    assert len(build) == 64  # the wheel's source digest, not "source"


@pytest.mark.slow
def test_setup_refuses_a_wheel_whose_hash_differs(tmp_path):
    wheel = _wheel(tmp_path)
    env = node_env(tmp_path, "gpt-cpu", "0")
    env["SKYRESUME_PACKAGE"] = f"file://{wheel}#sha256={'0' * 64}"
    env["SKYRESUME_PIP_ARGS"] = "--no-index"
    out = _setup(env, "gpt-cpu")
    assert out.returncode != 0
    assert "sha256" in (out.stderr + out.stdout).lower()
    assert not (tmp_path / "home" / "skyresume" / "pkg").exists()


def test_setup_without_a_package_says_the_launcher_sets_it(tmp_path):
    env = node_env(tmp_path, "gpt-cpu", "0")
    out = _setup(env, "gpt-cpu")  # the template's own SKYRESUME_PACKAGE is empty
    assert out.returncode != 0
    assert "SKYRESUME_PACKAGE" in out.stderr and "launcher" in out.stderr
