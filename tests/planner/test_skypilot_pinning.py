"""What the SkyPilot launcher submits: the task after pinning the planner's placement.

Pinning replaces where and what (infra, instance type, accelerators, spot) and keeps
everything else the user wrote in the chosen resource option: image, disk, ports,
labels, cpus/memory, autostop (SKYPILOT.md 1.11, defect 1, defect 17). A task whose
nodes would have no torch is refused before anything is submitted. ``render`` is the
YAML a launch would submit, as SkyPilot reads it (``skyresume submit --dry-run``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.domain.plan import Placement
from orchestrator.domain.spec import TaskSpec
from orchestrator.launchers.base import LaunchRequest, TaskRejected
from orchestrator.launchers.skypilot import (
    NODE_DIR_ENV,
    SkyPilotLauncher,
    _templates_dir,
    build_task_from_user_yaml,
    pinned_resources,
    sky_client_environment,
)

pytestmark = pytest.mark.filterwarnings("ignore::Warning:sky")

YAMLS = Path(__file__).parent / "yamls"
OWN = YAMLS / "own_resources.yaml"
A2 = Placement("gcp", "us-central1", "a2-highgpu-8g", "A100", 8, 2, True)
P4D = Placement("aws", "us-west-2", "p4d.24xlarge", "A100", 8, 2, True)
GCP_IMAGE = "projects/deeplearning-platform-release/global/images/family/pytorch-latest-gpu"


def request(placement: Placement = A2, **kw) -> LaunchRequest:
    return LaunchRequest(
        job_id="j-7", attempt=2, placement=placement, command="python train.py", **kw
    )


def only(resources):
    (r,) = list(resources)
    return r


def test_the_users_image_disk_ports_and_labels_survive_pinning_to_a_gcp_option(sky):
    task = build_task_from_user_yaml(OWN, request(A2))
    r = only(task.resources)
    assert (str(r.cloud), r.region, r.instance_type, r.use_spot) == (
        "GCP", "us-central1", "a2-highgpu-8g", True,
    )  # fmt: skip
    assert r.image_id == {"us-central1": "projects/my-project/global/images/torch-2-3"}
    assert r.disk_size == 500  # the option's own, over the section's 300
    assert r.ports == ["8080"] and r.labels == {"team": "ml"}
    assert r.autostop_config is not None and r.autostop_config.idle_minutes == 30
    assert task.num_nodes == 2


def test_the_aws_option_keeps_its_own_docker_image_cpus_and_memory(sky):
    task = build_task_from_user_yaml(OWN, request(P4D))
    r = only(task.resources)
    assert (str(r.cloud), r.region, r.instance_type) == ("AWS", "us-west-2", "p4d.24xlarge")
    assert r.extract_docker_image() == "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime"
    assert r.disk_size == 300  # the section's: this option names none
    assert (r.cpus, r.memory) == ("32+", "256+")
    # nothing of the GCP option came along
    assert "my-project" not in str(r.image_id)


def test_an_option_of_another_cloud_lends_the_placement_nothing(sky):
    resources = {"any_of": [{"infra": "gcp", "accelerators": "A100:8", "image_id": "x"}]}
    assert pinned_resources(resources, P4D) == {
        "infra": "aws/us-west-2",
        "instance_type": "p4d.24xlarge",
        "use_spot": True,
        "accelerators": {"A100": 8},
    }


def test_ordered_options_pin_the_first_that_offers_the_placement(sky):
    resources = {
        "ordered": [
            {"infra": "gcp/us-central1", "accelerators": "A100-80GB:8", "disk_size": 900},
            {"infra": "gcp", "accelerators": "A100:8", "disk_size": 700},
            {"infra": "gcp", "accelerators": "A100:8", "disk_size": 100},
        ]
    }
    assert pinned_resources(resources, A2)["disk_size"] == 700


def test_a_task_whose_nodes_would_have_no_torch_is_refused_before_anything_is_submitted(sky):
    calls: list[str] = []

    class Sdk:
        def __getattr__(self, name):
            calls.append(name)
            raise AssertionError(f"sky.{name} called for a refused task")

    launcher = SkyPilotLauncher(sdk=Sdk())
    with pytest.raises(TaskRejected, match=r"no node image is named.*SKYRESUME_SKYPILOT_IMAGE_ID"):
        launcher.launch(request(task=TaskSpec(template="skypilot-gpu", command="python t.py")))
    assert calls == []


def test_an_image_from_the_settings_or_a_setup_that_installs_torch_is_enough(sky, tmp_path):
    class Settings:
        skypilot_image_id = GCP_IMAGE

    spec = TaskSpec(template="skypilot-gpu", command="python t.py")
    task = SkyPilotLauncher(Settings()).build(request(), spec)
    assert only(task.resources).image_id == {"us-central1": GCP_IMAGE}
    own = tmp_path / "own.yaml"
    own.write_text(
        "resources: {accelerators: A100:8}\n"
        "setup: |\n  python3 -m pip install 'torch==2.3.*'\n"
        "run: python train.py\n"
    )
    task = SkyPilotLauncher().build(request(), TaskSpec(skypilot_yaml=str(own)))
    assert only(task.resources).image_id is None  # SkyPilot's default image, torch from setup


def test_a_users_image_wins_over_the_settings_default(sky):
    task = SkyPilotLauncher(image_id="projects/p/global/images/other").build(
        request(A2), TaskSpec(skypilot_yaml=str(OWN))
    )
    assert only(task.resources).image_id == {
        "us-central1": "projects/my-project/global/images/torch-2-3"
    }


def test_render_yaml_is_the_pinned_task_as_skypilot_reads_it_with_secrets_redacted(sky):
    launcher = SkyPilotLauncher(token_for=lambda j, a: "tok-s3cr3t")
    text = launcher.render_yaml(request(A2), TaskSpec(skypilot_yaml=str(OWN)))
    doc = yaml.safe_load(text)
    res = doc["resources"]
    assert res["infra"] == "gcp/us-central1" and res["instance_type"] == "a2-highgpu-8g"
    assert res["image_id"] == {"us-central1": "projects/my-project/global/images/torch-2-3"}
    assert res["disk_size"] == 500 and res["ports"] == ["8080"]
    assert doc["num_nodes"] == 2 and doc["name"] == "sr-j-7-a2"
    assert "tok-s3cr3t" not in text and doc["secrets"] == {"SKYRESUME_AGENT_TOKEN": "<redacted>"}
    # what SkyPilot reads back is this same task
    again = sky.Task.from_yaml_config({**doc, "secrets": {"SKYRESUME_AGENT_TOKEN": "x"}})
    assert only(again.resources).disk_size == 500


def test_every_try_has_its_own_task_name_and_node_directory(sky):
    first = build_task_from_user_yaml(OWN, request(A2))
    retry = build_task_from_user_yaml(OWN, request(A2, launch_try=1))
    assert (first.name, retry.name) == ("sr-j-7-a2", "sr-j-7-a2-t1")
    assert first.envs[NODE_DIR_ENV] == "~/skyresume/sr-j-7-a2"
    assert retry.envs[NODE_DIR_ENV] == "~/skyresume/sr-j-7-a2-t1"
    assert first.envs["SKYPILOT_DISABLE_USAGE_COLLECTION"] == "1"


def test_the_templates_are_found_in_an_installed_wheel(tmp_path):
    site = tmp_path / "site-packages" / "orchestrator"
    (site / "launchers").mkdir(parents=True)
    module = site / "launchers" / "skypilot.py"
    module.write_text("")
    # no _task_templates beside the package: a checkout, whose templates sit at the root
    assert _templates_dir(module) == tmp_path / "site-packages" / "task_templates"
    (site / "_task_templates").mkdir()
    assert _templates_dir(module) == site / "_task_templates"


def test_the_services_sky_client_sends_no_telemetry_and_never_starts_a_server():
    env = {"SKYPILOT_DISABLE_USAGE_COLLECTION": "0"}
    sky_client_environment(env)
    # an operator's own choice stands; the auto-start is off
    assert env == {
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "0",
        "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1",
    }


def test_an_option_that_names_its_zone_or_instance_type_offers_only_that(sky):
    from orchestrator.launchers.catalog import demand_from_task, gather_for_task

    task = sky.Task.from_yaml_config(
        {
            "run": "python train.py",
            "resources": {
                "use_spot": True,
                "any_of": [
                    {"infra": "aws/us-west-2/us-west-2b", "accelerators": "A100:8"},
                    {"infra": "gcp", "accelerators": "A100:8", "instance_type": "a2-highgpu-8g"},
                ],
            },
        }
    )
    found = gather_for_task(demand_from_task(task))
    aws = [c for c in found if c.cloud == "aws"]
    gcp = [c for c in found if c.cloud == "gcp"]
    assert aws and {(c.region, c.zone) for c in aws} == {("us-west-2", "us-west-2b")}
    assert gcp and {c.instance_type for c in gcp} == {"a2-highgpu-8g"}
