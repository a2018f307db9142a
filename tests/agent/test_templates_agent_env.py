"""The task templates start the real agent from the environment SkyPilot gives a node.

The setup section installs the served wheel (pinned by its hash) into a directory of
its own; the run section is ``python3 -m orchestrator.agent --from-env`` with that
directory first on PYTHONPATH. These tests run both sections in bash as SkyPilot
would, with a ``python3`` on PATH that is this interpreter, and read what the agent
resolved (``--print-config``) or what a rank received."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
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


# --- the run section: the agent is a child, and the run exits 0 -------------------------
#
# SkyPilot cancels every other node's run as soon as one node's run exits non-zero
# (SIGTERM, SIGKILL 30 s later: SKYPILOT.md 1.9), which would cut the peers' 90 s grace
# while they still save. So the run section never execs the agent and exits 0, keeping
# the agent's code in $HOME/skyresume/agent.exit and its pid in agent.pid.

SLEEPING_RANK = (
    "import os, time; open(os.environ['RANK_PID'], 'w').write(str(os.getpid())); time.sleep(600)"
)


def _start_run(tmp_path: Path, **extra: str) -> subprocess.Popen[str]:
    env = node_env(
        tmp_path, "gpt-cpu", "0",
        SKYPILOT_NODE_RANK="0", SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_IPS="127.0.0.1",
        SKYRESUME_RANKS_PER_NODE="1", SKYRESUME_MASTER_PORT=str(free_port()),
        SKYRESUME_PROVIDER="none", SKYRESUME_METADATA_URL="", SKYRESUME_GRACE_S="10",
        SKYRESUME_AGENT_HEALTH_CHECKS="off", RANK_PID=str(tmp_path / "rank.pid"),
        SKYRESUME_COMMAND=f"python -c {shlex.quote(SLEEPING_RANK)}", **extra,
    )  # fmt: skip
    env.pop("SKYRESUME_RUN_SERVICE_URL")  # no service: the agent runs the ranks alone
    return subprocess.Popen(
        ["bash", "-c", yaml.safe_load((TEMPLATES / "gpt-cpu.yaml").read_text())["run"]],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_for_file(path: Path, proc: subprocess.Popen[str]) -> int:
    """The pid in ``path`` once it is written (the process still running)."""
    import time

    while not (path.is_file() and path.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    return int(path.read_text())


def test_the_run_exits_0_whatever_the_agent_exits_and_keeps_the_agents_code(tmp_path):
    env = node_env(tmp_path, "gpt-cpu", "0", SKYRESUME_GRACE_S="soon")  # a usage error: 2
    run = yaml.safe_load((TEMPLATES / "gpt-cpu.yaml").read_text())["run"]
    out = subprocess.run(
        ["bash", "-c", run], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "$SKYRESUME_GRACE_S must be a number" in out.stderr  # the agent's own words
    assert (tmp_path / "home" / "skyresume" / "agent.exit").read_text().strip() == "2"
    assert "the agent exited 2" in out.stderr


def test_a_signal_to_the_run_shell_alone_reaches_the_agent_which_stops_its_ranks(tmp_path):
    proc = _start_run(tmp_path)
    try:
        home = tmp_path / "home" / "skyresume"
        agent = _wait_for_file(home / "agent.pid", proc)
        rank = _wait_for_file(tmp_path / "rank.pid", proc)  # the agent's handlers are set
        assert agent != proc.pid  # agent.pid is the agent's own, not the shell's
        proc.send_signal(signal.SIGTERM)  # the shell only, not its group
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        code = int((home / "agent.exit").read_text())
        assert code not in (128 + signal.SIGTERM, 128 + signal.SIGKILL)  # it exited itself
        assert not _alive(agent) and not _alive(rank)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_kill_of_the_nodes_process_tree_still_kills_the_agent_and_its_ranks(tmp_path):
    """What SkyPilot's cancel does (subprocess_daemon's kill_process_tree: the run's
    process and every descendant, ranks in torchrun's own sessions included), like the
    local provisioner's down. Nothing of the node survives it."""
    import psutil

    proc = _start_run(tmp_path)
    try:
        agent = _wait_for_file(tmp_path / "home" / "skyresume" / "agent.pid", proc)
        rank = _wait_for_file(tmp_path / "rank.pid", proc)
        run = psutil.Process(proc.pid)
        tree = [run, *run.children(recursive=True)]
        assert {agent, rank} <= {p.pid for p in tree}
        for p in tree:
            p.kill()
        proc.communicate(timeout=60)
        _, alive = psutil.wait_procs(tree, timeout=60)
        assert not alive and not _alive(agent) and not _alive(rank)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# --- the setup section: what the image lacks, in one line --------------------------------


PY = "%d.%d" % sys.version_info[:2]  # noqa: UP031 (as the setup prints it)


def _image(tmp_path: Path, **lacks: str) -> dict[str, str]:
    """A node whose ``python3`` is this interpreter, except for what ``lacks`` says:
    ``old`` (it reports 3.8), ``pip`` (no pip module), ``torch`` (no torch until the
    file named exists: a user's setup that installs it)."""
    env = node_env(tmp_path, "gpt-cpu", "0")
    fake = (
        "#!/bin/bash\n"
        'case "$*" in\n'
        '  *"version_info < (3, 9)"*) [ -n "${LACKS_OLD:-}" ] && exit 1 ;;\n'
        '  *"print("*"version_info"*) [ -n "${LACKS_OLD:-}" ] && { echo 3.8; exit 0; } ;;\n'
        '  "-m pip --version") [ -n "${LACKS_PIP:-}" ] && { echo "No module named pip" >&2; exit 1; } ;;\n'  # noqa: E501
        '  "-c import torch") [ -n "${LACKS_TORCH:-}" ] && [ ! -e "$LACKS_TORCH" ] && exit 1 ;;\n'
        "esac\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    (tmp_path / "bin" / "python3").write_text(fake)
    env.update({f"LACKS_{k.upper()}": v for k, v in lacks.items()})
    return env


@pytest.mark.parametrize(
    ("lacks", "line"),
    [
        ({"old": "1"}, "skyresume setup: python3 3.8 on this image; the agent needs 3.9+ "
                       "(set resources.image_id to an image with it)"),
        ({"pip": "1"}, f"skyresume setup: python3 {PY} on this image has no pip"),
    ],
    ids=["python-3.8", "no-pip"],
)  # fmt: skip
def test_setup_names_what_the_image_lacks_in_one_line_and_fails(tmp_path, lacks, line):
    env = _image(tmp_path, **lacks)
    env["SKYRESUME_PACKAGE"] = "skyresume-never-installed"
    out = _setup(env, "gpt-cpu")
    assert out.returncode != 0
    assert out.stderr.strip().startswith(line) and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "home" / "skyresume" / "pkg").exists()  # nothing was installed


@pytest.mark.slow
@pytest.mark.parametrize("installed_by_user", [False, True], ids=["no-torch", "user-installs"])
def test_setup_checks_torch_after_the_users_setup(tmp_path, installed_by_user):
    """The user's setup runs after the node's (the launcher appends it): torch is
    looked for when the whole setup is done, so a setup that installs it passes."""
    wheel = _wheel(tmp_path)
    torch_marker = tmp_path / "torch-installed"
    env = _image(tmp_path, torch=str(torch_marker))
    env["SKYRESUME_PACKAGE"] = (
        f"file://{wheel}#sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}"
    )
    env["SKYRESUME_PIP_ARGS"] = "--no-index --no-cache-dir"
    setup = yaml.safe_load((TEMPLATES / "gpt-cpu.yaml").read_text())["setup"]
    user = f"touch {shlex.quote(str(torch_marker))}\n" if installed_by_user else "true\n"
    out = subprocess.run(
        ["bash", "-c", setup + user], env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    if installed_by_user:
        assert out.returncode == 0, out.stderr[-3000:]
    else:
        assert out.returncode != 0
        assert (
            out.stderr.strip()
            .splitlines()[-1]
            .startswith("skyresume setup: python3 3.11 on this image cannot import torch")
        )


@pytest.mark.slow
def test_setup_installs_the_served_wheel_for_a_python_3_9_node(tmp_path):
    """pip judges ``Requires-Python`` (the service's >=3.11) against the node's Python;
    ``--python-version 3.9`` has this pip judge as a 3.9 node's would. The setup's
    install still takes the wheel: what a node runs of it is checked for 3.9 in CI."""
    wheel = _wheel(tmp_path)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    env = node_env(tmp_path, "gpt-cpu", "0")
    env["SKYRESUME_PACKAGE"] = f"file://{wheel}#sha256={sha}"
    env["SKYRESUME_PIP_ARGS"] = "--no-index --no-cache-dir --python-version 3.9 --only-binary=:all:"
    out = _setup(env, "gpt-cpu")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "home" / "skyresume" / "pkg" / "orchestrator" / "agent").is_dir()


def test_the_launchers_node_dir_keeps_two_attempts_agents_apart(tmp_path):
    # SkyPilot never cancels an old job by itself (SKYPILOT.md defect 6): the launcher
    # names a node directory per attempt and try, so an old agent still alive on a kept
    # node never shares control.json or logs with the new one.
    env = node_env(tmp_path, "gpt-cpu", "0", SKYRESUME_NODE_DIR="~/skyresume/sr-j-1-a3-t1")
    out = run_section("gpt-cpu", env, "--print-config")
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)["config"]
    home = tmp_path / "home"
    assert cfg["local_dir"] == str(home / "skyresume" / "sr-j-1-a3-t1")
    assert cfg["log_dir"] == str(home / "skyresume" / "sr-j-1-a3-t1" / "logs")
