"""Issue 26's defects, one test each: a user's SkyPilot YAML means what SkyPilot
says it means. ``skyresume plan`` runs in process (Typer's runner), on the test
catalog, with no credentials and no ``sky check`` (no enabled-cloud patch here: the
planner must not need one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.filterwarnings("ignore::Warning")


def plan(path: Path, *args: str) -> tuple[int, dict | None, str]:
    from orchestrator.cli import app

    r = CliRunner().invoke(app, ["plan", str(path), "-o", "json", "--no-history", *args])
    doc = json.loads(r.stdout) if r.exit_code == 0 else None
    return r.exit_code, doc, r.stderr


def write(tmp_path: Path, text: str, name: str = "task.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def top(doc: dict) -> tuple[str, str, str]:
    t = doc["ranked"][0]
    return t["cloud"], t["region"], t["instance_type"]


def test_1_ports_plan_without_cloud_access(sky, tmp_path):
    code, doc, err = plan(
        write(tmp_path, "resources:\n  accelerators: A100:8\n  ports: 8080\nrun: x\n")
    )
    assert code == 0, err
    assert "sky check" not in err
    assert top(doc) == ("gcp", "us-central1", "a2-highgpu-8g")
    assert "ports: 8080" in doc["resources_kept"]


@pytest.mark.parametrize(
    "resources",
    [
        "  accelerators: {H100:8, B200:8}\n",
        "  accelerators: [B200:8, H100:8]\n",
        "  any_of:\n    - accelerators: B200:8\n    - accelerators: H100:8\n",
    ],
    ids=["set", "list", "any_of"],
)
def test_2_an_unavailable_option_is_skipped_as_skypilot_skips_it(sky, tmp_path, resources):
    code, doc, err = plan(write(tmp_path, f"resources:\n{resources}run: x\n"))
    assert code == 0, err
    assert doc["ranked"][0]["accelerator"] == "H100"
    assert {r["accelerator"] for r in doc["ranked"]} == {"H100"}


def test_3_an_any_of_naming_a_cloud_without_a_price_table_plans_the_rest(sky, tmp_path):
    text = (
        "resources:\n  accelerators: A100:8\n  any_of:\n    - infra: paperspace\n"
        "    - infra: aws\n    - infra: fluidstack\nrun: x\n"
    )
    code, doc, err = plan(write(tmp_path, text))
    assert code == 0, err
    assert {r["cloud"] for r in doc["ranked"]} == {"aws"}


def test_4_cpus_and_memory_minimums_are_skypilots(sky, tmp_path):
    code, doc, err = plan(
        write(tmp_path, "resources:\n  accelerators: A10G:1\n  cpus: 32+\nrun: x\n")
    )
    assert code == 2 and doc is None
    # SkyPilot's reason, in one line
    assert "SkyPilot refuses it: Catalog does not contain any instances" in err
    assert "cpus=32+" in err and len(err.strip().splitlines()) == 1
    yaml_text = "resources:\n  accelerators: A10G:4\n  memory: {}\nrun: x\n"
    code, doc, err = plan(write(tmp_path, yaml_text.format("128+")))
    assert code == 0, err
    assert {r["instance_type"] for r in doc["ranked"]} == {"g5.12xlarge"}  # 192 GiB
    code, doc, err = plan(write(tmp_path, yaml_text.format("256+")))
    assert code == 2 and "mem=256+" in err


def test_5_a_per_region_image_map_restricts_the_regions(sky, tmp_path):
    text = (
        "resources:\n  infra: aws\n  accelerators: A100:8\n  image_id:\n"
        "    us-west-2: ami-0123\nrun: x\n"
    )
    code, doc, err = plan(write(tmp_path, text))
    assert code == 0, err
    assert {(r["cloud"], r["region"]) for r in doc["ranked"]} == {("aws", "us-west-2")}


def test_6_per_option_use_spot_in_an_any_of_stays_spot(sky, tmp_path):
    text = (
        "resources:\n  any_of:\n    - accelerators: H100:8\n      use_spot: true\n"
        "    - accelerators: A100-80GB:8\nrun: x\n"
    )
    code, doc, err = plan(write(tmp_path, text))
    assert code == 0, err
    first = doc["ranked"][0]
    assert first["spot"] is True and first["accelerator"] == "H100"
    assert first["price_per_job_hour"] == pytest.approx(22.544 + 3.512)  # GCP H100 spot
    assert doc["skypilot_choice"] == {
        "cloud": "gcp", "region": first["region"], "instance_type": "a3-highgpu-8g", "spot": True,
    } or doc["skypilot_choice"]["spot"] is True  # fmt: skip
    # the on-demand option stays on-demand
    assert any(r["accelerator"] == "A100-80GB" and r["spot"] is False for r in doc["ranked"])


def test_8_a_job_specs_default_spot_leaves_the_yamls_use_spot(sky, tmp_path):
    write(tmp_path, "resources:\n  accelerators: A100:8\n  use_spot: false\nrun: x\n", "t.yaml")
    spec = (
        "name: j\nnum_nodes: 1\ntask: {skypilot_yaml: t.yaml}\ncheckpoint: {uri: 'file:///tmp/c'}\n"
    )
    code, doc, err = plan(write(tmp_path, spec, "job.yaml"))
    assert code == 0, err
    assert all(r["spot"] is False for r in doc["ranked"])
    _, alone, _ = plan(tmp_path / "t.yaml")
    assert top(doc) == top(alone)  # plan task.yaml and plan job.yaml agree
    assert any("the YAML's use_spot" in n for n in doc["notes"])
    # an explicit spec spot overrides it, and plan says so
    code, doc, err = plan(write(tmp_path, spec + "spot: true\n", "job2.yaml"))
    assert code == 0, err
    assert all(r["spot"] is True for r in doc["ranked"])
    assert any("from the job spec" in n for n in doc["notes"])


def test_8b_the_specs_num_nodes_over_the_yamls_is_said(sky, tmp_path):
    write(tmp_path, "num_nodes: 2\nresources:\n  accelerators: A100:8\nrun: x\n", "t.yaml")
    spec = (
        "name: j\nnum_nodes: 4\ntask: {skypilot_yaml: t.yaml}\ncheckpoint: {uri: 'file:///tmp/c'}\n"
    )
    code, doc, err = plan(write(tmp_path, spec, "job.yaml"))
    assert code == 0, err
    assert "nodes: 4 from the job spec (the YAML says 2)" in doc["notes"]


def test_9_k8s_with_an_image_is_one_line_not_a_traceback(sky, tmp_path):
    text = (
        "resources:\n  infra: k8s\n  accelerators: A100:8\n  image_id: docker:nvcr.io/x:1\nrun: x\n"
    )
    code, doc, err = plan(write(tmp_path, text))
    assert code == 2 and doc is None
    assert "Traceback" not in err and "Kubernetes" in err
    assert len(err.strip().splitlines()) == 1


def test_empty_envs_are_given_with_env_and_secrets_with_secret(sky, tmp_path):
    text = "envs:\n  HF_TOKEN:\nresources:\n  accelerators: A100:8\nrun: x\n"
    path = write(tmp_path, text)
    code, _, err = plan(path)
    assert code == 2 and "HF_TOKEN" in err  # SkyPilot refuses an empty env, with its reason
    code, doc, err = plan(path, "--env", "HF_TOKEN=abc")
    assert code == 0, err
    text = "secrets:\n  WANDB_API_KEY:\nresources:\n  accelerators: A100:8\nrun: x\n"
    code, doc, err = plan(write(tmp_path, text, "s.yaml"), "--secret", "WANDB_API_KEY=s3cr3t")
    assert code == 0, err
    assert "s3cr3t" not in json.dumps(doc) and "s3cr3t" not in err
    code, _, err = plan(path, "--env", "no-equals")
    assert code == 2 and "KEY=VALUE" in err


def test_a_job_group_and_unsupported_fields_get_one_line_each(sky, tmp_path):
    code, _, err = plan(write(tmp_path, "name: g\n---\nname: a\nrun: x\n---\nname: b\nrun: y\n"))
    assert code == 2 and "job groups are not supported" in err
    text = (
        "resources:\n  accelerators: A100:8\n  job_recovery:\n    max_restarts_on_errors: 1\n"
        "run: x\n"
    )
    code, doc, err = plan(write(tmp_path, text, "r.yaml"))
    assert code == 0, err
    assert any(n.startswith("resources.job_recovery:") for n in doc["notes"])


def test_the_launch_task_gets_the_specs_envs_and_secrets_and_shows_no_secret(sky, tmp_path):
    from orchestrator.domain.plan import Placement
    from orchestrator.launchers.base import LaunchRequest
    from orchestrator.launchers.skypilot import build_task_from_user_yaml, task_yaml

    path = write(tmp_path, "envs:\n  HF_TOKEN:\nsecrets:\n  WANDB_API_KEY:\nrun: python t.py\n")
    placement = Placement("gcp", "us-central1", "a2-highgpu-8g", "A100", 8, 1, True)
    request = LaunchRequest(job_id="j-1", attempt=1, placement=placement, command="")
    task = build_task_from_user_yaml(
        path, request, envs={"HF_TOKEN": "hf_x"}, secrets={"WANDB_API_KEY": "s3cr3t-value"}
    )
    assert task.envs["HF_TOKEN"] == "hf_x"
    secret = task.secrets["WANDB_API_KEY"]
    assert getattr(secret, "get_secret_value", lambda: secret)() == "s3cr3t-value"
    shown = task_yaml(task)
    assert "s3cr3t-value" not in shown and "hf_x" in shown
