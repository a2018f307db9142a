"""``skyresume plan`` as an operator runs it: a subprocess, the shipped catalog, no
network (``netguard`` is on the child's PYTHONPATH), no credentials."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, cli_env, seed_runtime_dir

pytestmark = pytest.mark.slow

YAMLS = Path(__file__).parent / "yamls"
EXAMPLE = REPO / "task_templates" / "job.example.yaml"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Path:
    return seed_runtime_dir(tmp_path_factory.mktemp("plan-cli"))


def plan(runtime_dir: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "plan", *args],
        env=cli_env(runtime_dir),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_json_plan_of_the_example_job(runtime):
    r = plan(runtime, str(EXAMPLE), "--output", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # stdout is only the plan: no SkyPilot spinner payloads
    assert doc["kind"] == "job" and doc["job"] == "gpt-small"
    ranked = doc["ranked"]
    assert ranked and [x["score"] for x in ranked] == sorted(x["score"] for x in ranked)
    for x in ranked:
        k = x["knobs"]
        ranks = x["num_nodes"] * x["accelerator_count"]
        assert k["micro_batch"] * k["grad_accum"] * ranks == 512  # the global batch holds
        assert x["memory"]["fits"] is True
    by_mem = {x["gpu_memory_gib"]: x["knobs"]["activation_checkpoint_every"] for x in ranked}
    assert by_mem[40.0] == 1 and by_mem[80.0] > 1  # less memory, more recompute
    top = ranked[0]
    repl = doc["replacement_after_preemption"]
    assert repl["preempted"]["region"] == top["region"]
    assert (repl["cloud"], repl["region"]) != (top["cloud"], top["region"])


def test_table_for_a_plain_skypilot_yaml_with_an_excluded_region(runtime):
    r = plan(runtime, str(YAMLS / "ordered.yaml"), "--exclude-region", "aws/us-west-2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ordered-ft: 4 node(s), spot" in out
    assert "aws/us-east-1" in out and "gcp/us-central1" in out
    assert "aws/us-west-2" not in out.split("rejected:")[0]
    assert "rejected: 1 by excluded" in out
    # ordered options keep their infra: no A100-80GB on AWS, nothing GCP but us-central1
    assert "p4de" not in out and "europe-west4" not in out
    # ordered is a strict preference (SkyPilot's semantics): GCP's 80 GB A100s first,
    # whatever their price, and AWS only after GCP took the nodes back.
    assert "after a preemption in gcp/us-central1: aws/us-east-1 p4d.24xlarge" in out


def test_without_a_catalog_it_says_how_to_get_one(tmp_path):
    r = plan(tmp_path, str(EXAMPLE))
    assert r.returncode == 1
    assert "no SkyPilot catalog" in r.stderr and "sky show-gpus" in r.stderr
    assert r.stdout == ""


def test_an_accelerator_no_cloud_offers_is_a_bad_input(sky, tmp_path):
    # In process (the command itself, through Typer), sharing this session's sky import.
    from typer.testing import CliRunner

    from orchestrator.cli import app

    f = tmp_path / "b300.yaml"
    f.write_text(EXAMPLE.read_text().replace("- A100-80GB:8", "- B300:8"))
    r = CliRunner().invoke(app, ["plan", str(f)])
    assert r.exit_code == 2
    assert "error: 'B300:8': accelerator 'B300' is not offered by aws, gcp" in r.stderr


def test_a_model_that_fits_nowhere_names_the_constraint(runtime, tmp_path):
    spec = EXAMPLE.read_text().replace("sharding: fsdp", "sharding: ddp")
    assert "sharding: ddp" in spec
    f = tmp_path / "ddp.yaml"
    f.write_text(spec)
    r = plan(runtime, str(f), "-o", "json")
    assert r.returncode == 2 and r.stdout == ""
    assert "no placement for 'gpt-small'" in r.stderr and "by fit" in r.stderr
    assert "smallest estimate is" in r.stderr
