"""The SkyPilot launcher: real ``sky.Task`` / ``sky.Resources`` built from the templates
and from users' SkyPilot YAMLs, the run section executed by bash, and SkyPilot's own dry
run where it runs offline. (Its requests: test_skypilot_requests.py, against a fake SDK,
and test_skypilot_api_server.py, against SkyPilot's API server.)"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.contract import Env
from orchestrator.domain.plan import Placement, TrainingKnobs
from orchestrator.domain.spec import TaskSpec, validate_job_spec
from orchestrator.launchers.base import ClusterState, LaunchError, LaunchHandle, LaunchRequest
from orchestrator.launchers.skypilot import (
    TEMPLATES_DIR,
    SkyPilotLauncher,
    TaskRejected,
    build_task,
    build_task_from_user_yaml,
    cluster_name_for,
    dry_run,
    status_from_records,
)

pytestmark = pytest.mark.filterwarnings("ignore::Warning:sky")

YAMLS = Path(__file__).parent / "yamls"
ROOT = Path(__file__).resolve().parents[2]
#: The one command every template's run section starts the agent with, configured
#: from the environment (orchestrator/agent/main.py: NodeEnv): as a child of the run's
#: shell, which then exits 0 (a non-zero run would have SkyPilot cancel the peers).
AGENT_START = (
    'python3 -c \'import runpy, sys; sys.path[:1] == [""] and sys.path.pop(0); '
    'runpy.run_module("orchestrator.agent", run_name="__main__", alter_sys=True)\' --from-env'
)

P4D = Placement(
    cloud="aws",
    region="us-west-2",
    instance_type="p4d.24xlarge",
    accelerator="A100",
    accelerator_count=8,
    num_nodes=2,
    spot=True,
    gpu_memory_gib=40.0,
    price_per_node_hour=10.84,
    knobs=TrainingKnobs(2, 16, 1),
)
A2 = Placement(
    cloud="gcp",
    region="us-central1",
    instance_type="a2-highgpu-8g",
    accelerator="A100",
    accelerator_count=8,
    num_nodes=2,
    spot=True,
)


def request(placement=P4D, **kw):
    return LaunchRequest(
        job_id="j-0a1b2c3d4e",
        attempt=3,
        placement=placement,
        command=kw.pop("command", "python -m training.examples.train_gpt --max-steps 200"),
        env={
            Env.SERVICE_URL: "http://10.0.0.5:8470",
            Env.CHECKPOINT_URI: "s3://bucket/ckpt",
            Env.RESUME_FROM: "{node_disk}/staged/step_300",
            Env.EXPECTED_STEP: "300",
        },
        ranks_per_node=8,
        grace_s=120.0,
        **kw,
    )


def only(resources):
    (r,) = list(resources)
    return r


@pytest.mark.parametrize("template", ["skypilot-gpu", "gpt-cpu"])
def test_templates_render_into_a_pinned_valid_task(sky, template):
    task = build_task(request(), template=template, token="tok-123")
    assert isinstance(task, sky.Task)
    assert task.name == "sr-j-0a1b2c3d4e-a3" and task.num_nodes == 2
    r = only(task.resources)
    assert isinstance(r, sky.Resources)
    assert (str(r.cloud), r.region, r.instance_type, r.use_spot) == (
        "AWS",
        "us-west-2",
        "p4d.24xlarge",
        True,
    )
    assert r.accelerators == {"A100": 8}
    env = task.envs
    assert env[Env.SERVICE_URL] == "http://10.0.0.5:8470"
    assert env[Env.JOB_ID] == "j-0a1b2c3d4e" and env[Env.ATTEMPT] == "3"
    assert (env[Env.MICRO_BATCH], env[Env.GRAD_ACCUM], env[Env.ACTIVATION_CHECKPOINT_EVERY]) == (
        "2",
        "16",
        "1",
    )
    assert env["SKYRESUME_PROVIDER"] == "aws"
    assert env["SKYRESUME_METADATA_URL"] == "http://169.254.169.254"
    assert env["SKYRESUME_GRACE_S"] == "120"
    # the token is a secret, never an env or argv, and not in the YAML SkyPilot keeps
    assert "SKYRESUME_AGENT_TOKEN" not in env
    assert task.secrets["SKYRESUME_AGENT_TOKEN"].get_secret_value() == "tok-123"
    assert "tok-123" not in (task._user_specified_yaml or "")
    assert task.run.lstrip().startswith("set -euo pipefail")
    assert task.run.count(AGENT_START) == 1 and task.run.rstrip().endswith("exit 0")
    # setup installs the agent package the launcher names (the run section runs it)
    assert env["SKYRESUME_PACKAGE"] == "skyresume"
    assert '"$SKYRESUME_PACKAGE"' in task.setup


def test_gcp_placement_polls_gcp_metadata(sky):
    task = build_task(request(A2))
    r = only(task.resources)
    assert (str(r.cloud), r.region, r.instance_type) == ("GCP", "us-central1", "a2-highgpu-8g")
    assert task.envs["SKYRESUME_METADATA_URL"] == "http://metadata.google.internal"


def _run_section(task, tmp_path: Path, rank: int, **node: str) -> dict:
    """Run the task's run section in bash as SkyPilot would on node ``rank`` of a
    2-node cluster (``node`` overrides SkyPilot's facts), with the real agent asked
    for ``--print-config``: what it resolved, as JSON. The ``python3`` on PATH is a
    wrapper that records the argv and environment the run section gave it, then runs
    this interpreter with the checkout on PYTHONPATH (standing in for the wheel that
    setup installs)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    # A wrapper, not a symlink: a venv's interpreter finds its site-packages from its
    # own path.
    py = bindir / "python3"
    py.write_text(
        "#!/bin/bash\n"
        'printf "%s\\0" "$@" > "$OUT/argv"\n'
        'env -0 > "$OUT/env"\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    py.chmod(0o755)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "OUT": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NODE_IPS": "10.0.0.11\n10.0.0.12",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        **node,
        **task.envs,
        **{k: v.get_secret_value() for k, v in task.secrets.items()},
    }
    # The run section as rendered, with the agent asked only to print its configuration.
    assert task.run.count(AGENT_START) == 1
    run = task.run.replace(AGENT_START, AGENT_START + " --print-config")
    out = subprocess.run(
        ["bash", "-c", run], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    doc["argv"] = (tmp_path / "argv").read_text().split("\0")[:-1]
    doc["env"] = dict(
        item.split("=", 1) for item in (tmp_path / "env").read_text().split("\0") if "=" in item
    )
    doc["stdout"] = out.stdout
    return doc


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_run_section_starts_the_agent_with_skypilots_node_facts(sky, tmp_path):
    task = build_task(
        request(command="python train.py --lr '3e-4 warm' --steps 10"), token="tok-s3cr3t"
    )
    got = _run_section(task, tmp_path, rank=1)
    cfg = got["config"]
    # the run section starts the agent, which takes everything from the environment
    assert got["argv"][0] == "-c" and 'run_module("orchestrator.agent"' in got["argv"][1]
    assert got["argv"][2:] == ["--from-env", "--print-config"]
    assert cfg["node_rank"] == 1 and cfg["nnodes"] == 2
    assert cfg["nproc_per_node"] == 8 and cfg["expect_gpus"] == 8
    assert cfg["master_addr"] == "10.0.0.11"  # the first of SKYPILOT_NODE_IPS
    assert cfg["node_id"] == "j-0a1b2c3d4e-a3-n1"
    assert cfg["job_id"] == "j-0a1b2c3d4e" and cfg["attempt"] == 3
    assert cfg["service_url"] == "http://10.0.0.5:8470"
    assert cfg["provider"] == "aws" and cfg["metadata_url"] == "http://169.254.169.254"
    assert cfg["grace_s"] == 120.0
    # the user's command, split like shlex.split (quotes kept together)
    assert cfg["command"] == [
        "python",
        "train.py",
        "--lr",
        "3e-4 warm",
        "--steps",
        "10",
    ]
    # {node_disk} in the run context names this node's disk: the node directory the
    # launcher names for this attempt (one per attempt and try, SKYPILOT.md defect 6)
    disk = f"{tmp_path}/home/skyresume/sr-j-0a1b2c3d4e-a3"
    assert cfg["local_dir"] == disk
    assert got["run_env"][Env.RESUME_FROM] == f"{disk}/staged/step_300"
    assert got["env"]["SKYRESUME_AGENT_TOKEN"] == "tok-s3cr3t"  # from secrets, not argv
    assert not any("tok-s3cr3t" in a for a in got["argv"])
    assert "tok-s3cr3t" not in got["stdout"]  # nor in what the agent prints


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_cpu_nodes_fall_back_to_ranks_per_node(sky, tmp_path):
    task = build_task(request(), template="gpt-cpu")
    cfg = _run_section(
        task,
        tmp_path,
        rank=0,
        SKYPILOT_NODE_IPS="10.0.0.11",
        SKYPILOT_NUM_NODES="1",
        SKYPILOT_NUM_GPUS_PER_NODE="0",
    )["config"]
    assert cfg["nproc_per_node"] == 8  # ranks_per_node
    assert cfg["expect_gpus"] == 0  # no GPUs: the GPU check is skipped
    assert cfg["nnodes"] == 1 and cfg["master_addr"] == "10.0.0.11"


def test_user_yaml_any_of_is_kept_and_pinned(sky):
    # as SkyPilot reads it: three options, and the memory form expands to A100/A100-80GB/H100
    original = sky.Task.from_yaml(str(YAMLS / "any_of.yaml"))
    assert len(original.resources) == 9 and original.num_nodes == 2
    task = build_task_from_user_yaml(YAMLS / "any_of.yaml", request(), token="t")
    r = only(task.resources)
    assert (str(r.cloud), r.region, r.instance_type) == ("AWS", "us-west-2", "p4d.24xlarge")
    assert task.num_nodes == 2
    assert task.envs["MODEL"] == "llama-7b"  # the user's envs survive
    assert task.file_mounts == {"/data": "s3://my-bucket/data"}
    assert "pip install -r requirements.txt" in task.setup
    # the user's run, SKYPILOT_* variables and all, becomes the agent's command
    assert task.envs["SKYRESUME_COMMAND"].startswith("bash -c ")
    assert "$SKYPILOT_NODE_RANK" in task.envs["SKYRESUME_COMMAND"]
    # the node's own setup (installing the agent) runs first, and its run starts the agent
    template = yaml.safe_load((TEMPLATES_DIR / "skypilot-gpu.yaml").read_text())
    assert task.setup.startswith(template["setup"].rstrip())
    assert task.run == template["run"] and task.run.count(AGENT_START) == 1


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_user_run_reaches_the_agent_as_one_bash_command(sky, tmp_path):
    task = build_task_from_user_yaml(YAMLS / "ordered.yaml", request(A2))
    cmd = _run_section(task, tmp_path, rank=0)["config"]["command"]
    assert cmd[:2] == ["bash", "-c"] and len(cmd) == 3
    assert 'echo "node $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES' in cmd[2]
    assert cmd[2] == sky.Task.from_yaml(str(YAMLS / "ordered.yaml")).run  # the run, as written


def test_user_yaml_ordered_becomes_options_in_order(sky):
    from orchestrator.launchers.catalog import demand_from_task

    task = sky.Task.from_yaml(str(YAMLS / "ordered.yaml"))
    assert isinstance(task.resources, list)
    d = demand_from_task(task)
    assert d.num_nodes == 4 and d.spot
    assert d.options == (
        ("A100-80GB:8", ("gcp",), ("gcp/us-central1",), 0),
        ("A100:8", ("aws",), (), 1),
    )


@pytest.mark.parametrize(
    "name,message",
    [
        ("bad_field.yaml", "did you mean 'resources'"),
        ("bad_accelerator_count.yaml", "Found: 'A100:eight'"),
        ("bad_region.yaml", "Invalid region 'mars-north-1'"),
        ("no_run.yaml", "no run section"),
    ],
)
def test_yaml_skypilot_rejects_is_refused_with_its_reason_and_never_launched(sky, name, message):
    sdk = RecordingSdk(sky)
    launcher = SkyPilotLauncher(sdk=sdk)
    with pytest.raises(TaskRejected, match="SkyPilot task .*" + name) as e:
        launcher.launch(request(), TaskSpec(skypilot_yaml=str(YAMLS / name)))
    assert message in str(e.value)
    assert sdk.calls == []


def test_bad_templates_and_commands_are_refused(sky):
    with pytest.raises(TaskRejected, match=r"no task template 'nope'.*skypilot-gpu"):
        build_task(request(), template="nope")
    with pytest.raises(TaskRejected, match="plain file name"):
        build_task(request(), template="../etc/passwd")
    with pytest.raises(TaskRejected, match="no command"):
        build_task(request(command="  "))
    bad = Placement("aws", "us-west-2", "p9.huge", "A100", 8, 1, True)
    with pytest.raises(TaskRejected, match=r"p9\.huge"):
        build_task(request(bad))


def test_cluster_names_are_valid_for_skypilot_and_unique_per_attempt(sky):
    names = {cluster_name_for("j-0a1b2c3d4e", a) for a in (1, 2, 10)}
    assert len(names) == 3
    long = cluster_name_for("J_" + "x" * 80, 12)
    assert len(long) <= 35 and long.endswith("-a12") and long.startswith("sr-j-")
    from sky.utils import common_utils

    for n in [*names, long]:
        common_utils.check_cluster_name_is_valid(n)


class RecordingSdk:
    """Records every SDK call; the launcher must make none for a task it refuses.
    (The request flow is tested against a fake SDK in test_skypilot_requests.py and
    against SkyPilot's API server in test_skypilot_api_server.py.)"""

    def __init__(self, sky):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *a, **kw: self.calls.append((name, a, kw))


def test_status_mapping(sky):
    h = LaunchHandle("c", "skypilot", ("n0",))
    rec = lambda s: [{"name": "c", "status": sky.ClusterStatus(s)}]  # noqa: E731
    assert status_from_records(h, rec("UP")).state is ClusterState.UP
    # INIT is provisioning, or nodes lost, or a failed ray health check on a healthy
    # cluster; not listed may be another user hash's: neither says a node is dead
    assert status_from_records(h, rec("INIT")).state is ClusterState.UNKNOWN
    assert status_from_records(h, rec("STOPPED")).state is ClusterState.DOWN
    assert status_from_records(h, []).state is ClusterState.UNKNOWN


def test_placement_for_uses_the_catalog_and_names_why_nothing_fits(sky):
    launcher = SkyPilotLauncher()
    doc = {
        "name": "t",
        "task": {"template": "skypilot-gpu", "command": "python train.py"},
        "num_nodes": 2,
        "accelerators": ["A100:8"],
        "checkpoint": {"uri": "s3://bucket/c"},
    }
    p = launcher.placement_for(validate_job_spec(doc))
    assert (p.cloud, p.region, p.instance_type) == ("gcp", "us-central1", "a2-highgpu-8g")
    ddp_7b = {
        "parameters": 7_000_000_000,
        "layers": 32,
        "hidden_size": 4096,
        "heads": 32,
        "seq_len": 4096,
        "global_batch": 512,
        "micro_batch": 4,
        "sharding": "ddp",
    }
    with pytest.raises(LaunchError, match=r"4 by fit .*does not fit a 40 GiB GPU"):
        launcher.placement_for(validate_job_spec({**doc, "model": ddp_7b}))
    with pytest.raises(LaunchError, match="'B300' is not offered"):
        launcher.placement_for(validate_job_spec({**doc, "accelerators": ["B300:8"]}))


def test_placement_for_a_job_with_its_own_skypilot_yaml_plans_the_yamls_options(sky):
    doc = {
        "name": "t",
        "task": {"skypilot_yaml": str(YAMLS / "ordered.yaml")},
        "num_nodes": 4,
        "checkpoint": {"uri": "s3://bucket/c"},
    }
    p = SkyPilotLauncher().placement_for(validate_job_spec(doc))
    # ordered.yaml prefers A100-80GB on gcp/us-central1, then A100 on AWS: ordered is a
    # strict preference (SkyPilot's semantics), so GCP wins although AWS is cheaper
    assert (p.cloud, p.region, p.instance_type, p.num_nodes) == (
        "gcp",
        "us-central1",
        "a2-ultragpu-8g",
        4,
    )


def test_job_example_renders_with_its_template(sky):
    spec_doc = yaml.safe_load((TEMPLATES_DIR / "job.example.yaml").read_text())
    spec = validate_job_spec(spec_doc)
    launcher = SkyPilotLauncher(image_id="docker:pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime")
    placement = launcher.placement_for(spec)
    assert placement.knobs is not None  # the example has a model profile
    task = launcher.build(request(placement, command=spec.task.command), spec.task)
    assert task.num_nodes == placement.num_nodes


@pytest.mark.slow
def test_dry_run_on_gcp_runs_offline(sky, enabled_clouds, caplog):
    """SkyPilot's own dry-run launch (optimizer, provisioning config) with the test
    catalog and no credentials: nothing is launched, nothing reaches the network."""
    task = build_task(request(A2))
    dry_run(task, "sr-j-0a1b2c3d4e-a3")
    out = caplog.text
    assert "a2-highgpu-8g[Spot]" in out and "Dryrun finished" in out


@pytest.mark.long
def test_dry_run_on_aws_runs_offline(sky, enabled_clouds, caplog):
    """The AWS path spends ~90 s retrying its client without credentials."""
    dry_run(build_task(request()), "sr-j-0a1b2c3d4e-a3")
    assert "p4d.24xlarge[Spot]" in caplog.text
