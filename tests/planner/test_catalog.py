"""Candidates from SkyPilot's real catalog code, reading the shipped test catalog."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from orchestrator.contract import CLOUDS
from orchestrator.domain.planner import rank_candidates
from orchestrator.domain.spec import validate_job_spec
from orchestrator.launchers.catalog import (
    CATALOG_CLOUDS,
    CatalogUnavailable,
    UnknownAccelerator,
    gather_candidates,
    parse_accelerator,
    require_catalog,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def spec(**kw):
    return validate_job_spec(
        {
            "name": "t",
            "task": {"template": "skypilot-gpu", "command": "python train.py"},
            "num_nodes": 2,
            "checkpoint": {"uri": "s3://bucket/ckpt"},
            **kw,
        }
    )


def test_every_catalog_cloud_is_a_cloud_a_spec_may_name():
    # A catalog cloud the spec refuses could never be planned onto by name.
    assert set(CATALOG_CLOUDS) <= set(CLOUDS)


def test_rows_carry_region_prices_and_gpu_memory(sky):
    rows = gather_candidates(["A100:8"])
    by = {(c.cloud, c.region): c for c in rows}
    assert set(by) == {
        ("aws", "us-east-1"),
        ("aws", "us-west-2"),
        ("gcp", "us-central1"),
        ("gcp", "europe-west4"),
    }
    p4d = by[("aws", "us-west-2")]
    assert (p4d.instance_type, p4d.accelerator_count, p4d.gpu_memory_gib) == (
        "p4d.24xlarge",
        8,
        40.0,
    )
    # the cheapest zone's spot price stands for the region
    assert p4d.spot_price_per_node_hour == 10.84 and p4d.price_per_node_hour == 32.7726
    # GCP prices the GPUs on top of the a2 host VM; SkyPilot adds them up
    a2 = by[("gcp", "us-central1")]
    assert a2.instance_type == "a2-highgpu-8g"
    assert a2.spot_price_per_node_hour == pytest.approx(8.80 + 0.9023)


def test_memory_form_expands_through_skypilots_metadata(sky):
    rows = gather_candidates(["nvidia:40GB+:8"], clouds=["aws"])
    assert {c.accelerator for c in rows} == {"A100", "A100-80GB", "H100"}
    assert {c.instance_type for c in rows} == {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge"}
    only_80 = gather_candidates(["80GB:8"], clouds=["gcp"])
    assert {c.accelerator for c in only_80} == {"A100-80GB", "H100"}


def test_an_offering_is_kept_once_under_the_first_preference(sky):
    rows = gather_candidates(["A100-80GB:8", "nvidia:40GB+:8"], clouds=["gcp"])
    keys = [(c.region, c.instance_type) for c in rows]
    assert len(keys) == len(set(keys))
    assert all(c.preference == 0 for c in rows if c.accelerator == "A100-80GB")
    assert all(c.preference == 1 for c in rows if c.accelerator != "A100-80GB")


def test_clouds_and_regions_filter_rows(sky):
    rows = gather_candidates(["A10G:8"], clouds=["aws"], regions=["eu-west-1", "aws/us-west-2"])
    assert sorted(c.region for c in rows) == ["eu-west-1", "us-west-2"]
    assert {c.instance_type for c in rows} == {"g5.48xlarge"}


def test_an_accelerator_nobody_offers_is_named_with_what_is_offered(sky):
    with pytest.raises(
        UnknownAccelerator, match=r"'B300' is not offered by aws, gcp.*A100, A100-80GB"
    ):
        gather_candidates(["B300:8"])
    with pytest.raises(UnknownAccelerator, match="counts offered: 1, 4, 8"):
        gather_candidates(["A10G:2"])
    with pytest.raises(UnknownAccelerator, match="not an accelerator"):
        parse_accelerator("A100:eight")
    with pytest.raises(UnknownAccelerator, match="no accelerator with 200GB"):
        gather_candidates(["nvidia:200GB+:8"])


def test_a_cloud_without_a_catalog_here_is_named(sky):
    with pytest.raises(CatalogUnavailable, match=r"no SkyPilot catalog for azure/vms\.csv"):
        require_catalog(["azure"])
    with pytest.raises(CatalogUnavailable, match="kubernetes: it has no price catalog"):
        require_catalog(["kubernetes"])


def test_no_catalog_at_all_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(CatalogUnavailable) as e:
        gather_candidates(["A100:8"])
    msg = str(e.value)
    assert "common/accelerators.csv" in msg and "sky show-gpus" in msg
    assert "no cloud credentials are needed" in msg


def test_with_no_history_the_planner_agrees_with_skypilots_optimizer(sky, enabled_clouds):
    """The same catalog, two rankers: skyresume's top pick (no history, no model) is
    the plan SkyPilot's own cost optimizer chooses for the same request."""
    s = spec(accelerators=["nvidia:40GB+:8"])
    ours = rank_candidates(s, gather_candidates(s.accelerators), [], NOW)[0]

    task = sky.Task(run="true", num_nodes=2)
    task.set_resources(
        sky.Resources.from_yaml_config({"accelerators": "nvidia:40GB+:8", "use_spot": True})
    )
    dag = sky.Dag()
    dag.add(task)
    sky.Optimizer.optimize(dag, minimize=sky.OptimizeTarget.COST, quiet=True)
    best = task.best_resources
    assert (str(best.cloud).lower(), best.region, best.instance_type) == (
        ours.cloud,
        ours.region,
        ours.instance_type,
    )


def test_a_cpu_option_naming_its_instance_type_is_planned_over_the_regions_offering_it(sky):
    from orchestrator.launchers.catalog import demand_from_task, gather_for_task

    task = sky.Task.from_yaml_config(
        {"resources": {"infra": "aws", "instance_type": "m6i.2xlarge", "use_spot": True},
         "run": "true"}
    )  # fmt: skip
    found = gather_for_task(demand_from_task(task))
    assert sorted(c.region for c in found) == ["eu-west-1", "us-east-1", "us-west-2"]
    assert {(c.cloud, c.instance_type, c.accelerator, c.accelerator_count) for c in found} == {
        ("aws", "m6i.2xlarge", None, 0)
    }
    assert {(c.price_per_node_hour, c.spot_price_per_node_hour) for c in found} == {(0.384, 0.1524)}
