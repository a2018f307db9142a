"""The job spec's side of the integrations: ``task.framework`` names them, a task
template per framework installs the framework's pinned extra on the node (and is
gpt-cpu's node setup otherwise), and ``skyresume plan`` shows the knobs in the
framework's own terms."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from orchestrator.commands.plan import _knobs
from orchestrator.domain.spec import validate_job_spec

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "task_templates"
FRAMEWORKS = ("hf", "accelerate", "lightning")


def _outside_markers(text: str) -> str:
    """The template without its own header and its framework block."""
    text = re.sub(r"  # --- framework .*?  # --- end framework ---\n", "", text, flags=re.S)
    return text[text.index("# SkyPilot task that the SkyPilot launcher") :]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_framework_template_is_the_node_setup_plus_its_pinned_extra(framework):
    text = (TEMPLATES / f"{framework}.yaml").read_text()
    assert _outside_markers(text) == (TEMPLATES / "gpt-cpu.yaml").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pinned = {r for r in extras[framework] if not r.startswith("skyresume")}
    setup = yaml.safe_load(text)["setup"]
    block = setup[setup.index("# --- framework") : setup.index("# --- end framework")]
    assert set(re.findall(r'"([a-z-]+==[0-9.]+)"', block)) == pinned
    assert '-c "$HOME/skyresume/torch-pin.txt"' in block  # torch stays the image's


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_job_spec_names_its_framework(framework):
    doc = yaml.safe_load((TEMPLATES / "job.example.yaml").read_text())
    doc["task"] = {**doc["task"], "template": framework, "framework": framework}
    assert validate_job_spec(doc).task.framework == framework


@pytest.mark.parametrize(
    "framework,shown",
    [
        ("skyresume", "micro 2 x accum 4, AC every block"),
        (
            "hf",
            "per_device_train_batch_size 2, gradient_accumulation_steps 4, "
            "gradient_checkpointing every block",
        ),
        (
            "lightning",
            "batch_size 2, accumulate_grad_batches 4, activation checkpointing every block",
        ),
    ],
)
def test_plan_shows_the_knobs_in_the_frameworks_terms(framework, shown):
    knobs = SimpleNamespace(micro_batch=2, grad_accum=4, activation_checkpoint_every=1)
    assert _knobs(SimpleNamespace(knobs=knobs), framework) == shown


@pytest.mark.parametrize("example", ["hf_trainer", "accelerate_loop", "lightning_fit"])
def test_the_docs_show_each_tested_script_as_it_is_and_under_60_lines(example):
    text = (REPO / "training" / "integrations" / "examples" / f"{example}.py").read_text()
    blocks = re.findall(
        r"```python\n(.*?)```", (REPO / "docs" / "integrations.md").read_text(), re.S
    )
    assert text in blocks  # the script the in-process tests run, verbatim
    assert len(text.splitlines()) < 60
