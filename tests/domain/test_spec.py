"""Job specs: every bad input is refused with an error that names the field."""

from __future__ import annotations

import pytest
import yaml
from testkit import job_spec

from orchestrator.domain.spec import (
    MAX_SPEC_BYTES,
    SpecError,
    parse_job_spec_yaml,
    validate_job_spec,
)


def test_valid_spec_round_trips_through_yaml():
    spec = parse_job_spec_yaml(yaml.safe_dump(job_spec()))
    assert spec.num_nodes == 2 and spec.effective_min_nodes == 1
    assert spec.checkpoint.keep == 2


def _leaves(doc: object, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    if isinstance(doc, dict):
        return {k: v for key, sub in doc.items() for k, v in _leaves(sub, (*path, key)).items()}
    return {path: doc}


def test_the_example_spec_in_task_templates_parses_to_every_value_it_sets():
    """Not only valid: no value it shows an operator is renamed, dropped or coerced."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "task_templates" / "job.example.yaml").read_text()
    written = _leaves(yaml.safe_load(text))
    read = _leaves(parse_job_spec_yaml(text).model_dump(mode="json"))
    assert len(written) > 20  # the whole example, not an empty file
    assert {k: read.get(k) for k in written} == written


BAD = [
    ("unknown_field", {"num_node": 2}, "num_node", "unknown field"),
    ("negative_nodes", {"num_nodes": -1}, "num_nodes", "greater than or equal to 1"),
    ("zero_nodes", {"num_nodes": 0}, "num_nodes", "greater than or equal to 1"),
    ("min_over_num", {"num_nodes": 2, "min_nodes": 3}, "", "min_nodes (3) exceeds num_nodes (2)"),
    ("bad_accelerator", {"accelerators": ["A100:eight"]}, "accelerators", "not an accelerator"),
    ("bad_accelerator_count", {"accelerators": ["H100:0"]}, "accelerators", "not an accelerator"),
    ("unknown_cloud", {"clouds": ["ibm"]}, "clouds.0", "Input should be"),
    ("bad_uri_scheme", {"checkpoint": {"uri": "ftp://x/y"}}, "checkpoint.uri", "file://, s3://"),
    ("relative_file_uri", {"checkpoint": {"uri": "file://rel/path"}}, "checkpoint.uri", "absolute"),
    ("missing_bucket", {"checkpoint": {"uri": "s3://"}}, "checkpoint.uri", "bucket"),
    ("keep_one", {"checkpoint": {"uri": "file:///c", "keep": 1}}, "checkpoint.keep", "2"),
    (
        "two_task_sources",
        {"task": {"template": "t", "skypilot_yaml": "x.yaml", "command": "c"}},
        "task",
        "exactly one",
    ),
    ("template_without_command", {"task": {"template": "t"}}, "task", "needs a command"),
    ("bad_name", {"name": "Has Spaces"}, "name", "lower-case"),
    ("wrong_type", {"spot": "maybe"}, "spot", "boolean"),
]


@pytest.mark.parametrize(
    ("overrides", "field", "reason"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_invalid_spec_error_names_field_and_reason(overrides, field, reason):
    with pytest.raises(SpecError) as info:
        validate_job_spec(job_spec(**overrides))
    assert any(loc == field and reason in msg for loc, msg in info.value.errors), info.value.errors


def test_missing_required_fields_are_each_named():
    with pytest.raises(SpecError) as info:
        validate_job_spec({"name": "x"})
    assert {loc for loc, _ in info.value.errors} >= {"task", "num_nodes", "checkpoint"}


def test_unreadable_yaml_names_the_line():
    with pytest.raises(SpecError, match=r"unreadable YAML: line \d+, column \d+: expected"):
        parse_job_spec_yaml("name: x\nnum_nodes: [1, 2\nspot: true\n")


def test_yaml_bomb_is_refused_before_expansion():
    bomb = "a: &a ['x','x','x','x','x','x','x','x','x']\n"
    for i in range(1, 10):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        bomb += f"{cur}: &{cur} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]\n"
    with pytest.raises(SpecError, match="aliases"):
        parse_job_spec_yaml(bomb)


def test_oversized_document_is_refused():
    with pytest.raises(SpecError, match="limit"):
        parse_job_spec_yaml("# " + "x" * MAX_SPEC_BYTES)


@pytest.mark.parametrize(
    "doc", ["just a string", "[1, 2]", "42", ""], ids=["str", "list", "int", "empty"]
)
def test_non_mapping_document_is_refused(doc):
    with pytest.raises(SpecError, match="must be a mapping"):
        parse_job_spec_yaml(doc)


# --- the plain-script contract and the start-up timeout (issue 27) -----------------------

_CKPT = {"uri": "file:///c"}
_TASK = {"template": "t", "command": "python multinode.py 2000 10"}
PLAIN_BAD = [
    (
        "own_relative_path",
        {"checkpoint": {**_CKPT, "own": {"path": "snapshot.pt", "resume_arg": "--snapshot"}}},
        "checkpoint.own.path",
        "absolute path or one under {node_disk}",
    ),
    (
        "own_path_traversal",
        {"checkpoint": {**_CKPT, "own": {"path": "/a/../etc", "resume_arg": "--snapshot"}}},
        "checkpoint.own.path",
        "'..'",
    ),
    (
        "own_arg_not_an_option",
        {"checkpoint": {**_CKPT, "own": {"path": "/s.pt", "resume_arg": "snapshot; rm -rf"}}},
        "checkpoint.own.resume_arg",
        "not a command-line option",
    ),
    (
        "own_without_arg",
        {"checkpoint": {**_CKPT, "own": {"path": "/s.pt"}}},
        "checkpoint.own.resume_arg",
        "Field required",
    ),
    (
        "unknown_framework",
        {"task": {**_TASK, "framework": "keras"}},
        "task.framework",
        "'plain'",
    ),
    (
        "zero_validate_timeout",
        {"restarts": {"validate_timeout_s": 0}},
        "restarts.validate_timeout_s",
        "greater than 0",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "field", "reason"), [b[1:] for b in PLAIN_BAD], ids=[b[0] for b in PLAIN_BAD]
)
def test_a_bad_plain_script_setting_names_its_field(overrides, field, reason):
    with pytest.raises(SpecError) as info:
        validate_job_spec(job_spec(**overrides))
    assert any(loc == field and reason in msg for loc, msg in info.value.errors), info.value.errors


def test_a_plain_script_with_its_own_checkpoint_is_accepted():
    spec = validate_job_spec(
        job_spec(
            task={**_TASK, "framework": "plain"},
            checkpoint={
                **_CKPT,
                "own": {"path": "{node_disk}/snapshot.pt", "resume_arg": "--snapshot_path"},
            },
            restarts={"validate_timeout_s": 900, "exit_zero_is_success": False},
        )
    )
    assert spec.task.framework == "plain"
    assert spec.checkpoint.own is not None and spec.checkpoint.own.resume_arg == "--snapshot_path"
    assert spec.restarts.validate_timeout_s == 900 and not spec.restarts.exit_zero_is_success


def test_by_default_a_script_uses_training_run_and_exit_zero_is_success():
    spec = validate_job_spec(job_spec())
    assert spec.task.framework == "skyresume" and spec.checkpoint.own is None
    assert spec.restarts.validate_timeout_s is None and spec.restarts.exit_zero_is_success
