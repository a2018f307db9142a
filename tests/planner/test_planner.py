"""The pure ranking: price, decayed preemptions, cool-down, fit, nodes (no SkyPilot)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from orchestrator.domain.plan import Placement
from orchestrator.domain.planner import (
    Candidate,
    FailureRecord,
    PlannerPolicy,
    rank,
    rank_candidates,
    recent_preemptions,
    replacement_after_preemption,
)
from orchestrator.domain.spec import validate_job_spec

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

MODEL_7B = dict(
    parameters=6_738_000_000,
    layers=32,
    hidden_size=4096,
    heads=32,
    seq_len=4096,
    global_batch=512,
    micro_batch=4,
    sharding="fsdp",
)


def spec(**kw):
    doc = {
        "name": "t",
        "task": {"template": "skypilot-gpu", "command": "python train.py"},
        "num_nodes": 2,
        "accelerators": ["A100:8"],
        "checkpoint": {"uri": "s3://bucket/ckpt"},
        **kw,
    }
    return validate_job_spec(doc)


def cand(cloud, region, itype, spot, *, acc="A100", mem=40.0, n=8, price=None, pref=0):
    return Candidate(
        cloud=cloud,
        region=region,
        instance_type=itype,
        accelerator=acc,
        accelerator_count=n,
        gpu_memory_gib=mem,
        price_per_node_hour=price or spot * 3,
        spot_price_per_node_hour=spot,
        preference=pref,
    )


# A small catalog: the same A100 box in three places, a bigger-memory box, and H100s.
CATALOG = [
    cand("aws", "us-west-2", "p4d.24xlarge", 10.84),
    cand("aws", "us-east-1", "p4d.24xlarge", 11.57),
    cand("gcp", "us-central1", "a2-highgpu-8g", 9.70),
    cand("gcp", "europe-west4", "a2-highgpu-8g", 10.49),
    cand("aws", "us-west-2", "p4de.24xlarge", 14.36, acc="A100-80GB", mem=80.0),
    cand("gcp", "us-central1", "a2-ultragpu-8g", 13.08, acc="A100-80GB", mem=80.0),
]


def where(p: Placement) -> str:
    return f"{p.cloud}/{p.region}/{p.instance_type}"


def test_without_history_the_cheapest_that_fits_comes_first():
    ranked = rank_candidates(spec(), CATALOG, [], NOW)
    prices = [p.price_per_node_hour for p in ranked]
    assert prices == sorted(prices)
    assert where(ranked[0]) == "gcp/us-central1/a2-highgpu-8g"
    assert ranked[0].num_nodes == 2 and ranked[0].spot


def test_on_demand_jobs_are_priced_on_demand():
    ranked = rank_candidates(spec(spot=False), CATALOG, [], NOW)
    assert ranked[0].price_per_node_hour == pytest.approx(9.70 * 3)
    assert "on-demand" in ranked[0].reasons[0]


def test_replacement_after_a_preemption_goes_to_another_region():
    s = spec()
    top = rank_candidates(s, CATALOG, [], NOW)[0]
    after = replacement_after_preemption(s, CATALOG, [], NOW, top)
    assert after.ranked, after.why_empty()
    new = after.ranked[0].placement
    assert (new.cloud, new.region) != (top.cloud, top.region)
    # every offering in the region that just preempted us is blocked, not just that type
    blocked = [r for r in after.rejected if r.constraint == "cooldown"]
    assert {(r.candidate.region, r.candidate.instance_type) for r in blocked} == {
        ("us-central1", "a2-highgpu-8g"),
        ("us-central1", "a2-ultragpu-8g"),
    }
    assert "blocked until 2026-12-01T12:30" in blocked[0].reason


def test_replacement_goes_to_another_cloud_when_its_cloud_has_no_other_region():
    s = spec()
    gcp_only_central = [c for c in CATALOG if c.region != "europe-west4"]
    top = rank_candidates(s, gcp_only_central, [], NOW)[0]
    assert top.cloud == "gcp"
    new = replacement_after_preemption(s, gcp_only_central, [], NOW, top).ranked[0].placement
    assert new.cloud == "aws"


def test_cooldown_ends_and_then_a_decaying_penalty_remains():
    s = spec()
    central = next(c for c in CATALOG if c.region == "us-central1" and c.accelerator == "A100")
    west = next(c for c in CATALOG if c.region == "europe-west4")
    rec = FailureRecord("gcp", "us-central1", "a2-highgpu-8g", NOW - timedelta(minutes=31))
    ranking = rank(s, [central, west], [rec], NOW)
    # no longer blocked, but the fresh preemption outweighs a 0.79 $/h price gap
    assert [r.placement.region for r in ranking.ranked] == ["europe-west4", "us-central1"]
    assert ranking.ranked[1].recent_preemptions == pytest.approx(0.5 ** (31 / 360), rel=1e-6)
    # a week later the same preemption hardly counts, and price wins again
    old = FailureRecord("gcp", "us-central1", "a2-highgpu-8g", NOW - timedelta(days=7))
    assert rank_candidates(s, [central, west], [old], NOW)[0].region == "us-central1"


def test_penalty_is_per_instance_type_and_decays_with_age():
    c = CATALOG[0]
    policy = PlannerPolicy()
    one_hour = FailureRecord(c.cloud, c.region, c.instance_type, NOW - timedelta(hours=1))
    one_day = FailureRecord(c.cloud, c.region, c.instance_type, NOW - timedelta(days=1))
    other_type = FailureRecord(c.cloud, c.region, "g5.48xlarge", NOW - timedelta(hours=1))
    not_placement = FailureRecord(
        c.cloud, c.region, c.instance_type, NOW, failure_class="user_code_error"
    )
    assert recent_preemptions(c, [one_hour], NOW, policy) > recent_preemptions(
        c, [one_day], NOW, policy
    )
    assert recent_preemptions(c, [other_type, not_placement], NOW, policy) == 0


def test_user_errors_do_not_cool_a_region_down():
    rec = FailureRecord("gcp", "us-central1", "a2-highgpu-8g", NOW, failure_class="cuda_oom")
    assert rank_candidates(spec(), CATALOG, [rec], NOW)[0].region == "us-central1"


def test_a_smaller_gpu_turns_checkpointing_on_and_keeps_the_global_batch():
    s = spec(accelerators=["A100-80GB:8", "A100:8"], model=MODEL_7B)
    ranking = rank(s, CATALOG, [], NOW)
    by_mem = {r.placement.gpu_memory_gib: r.placement.knobs for r in ranking.ranked}
    big, small = by_mem[80.0], by_mem[40.0]
    assert big is not None and small is not None
    assert small.activation_checkpoint_every == 1
    assert big.activation_checkpoint_every > 1  # every Nth block only
    for k in (big, small):
        assert k.micro_batch * k.grad_accum * 2 * 8 == 512
    # recompute counts: the 40 GiB boxes cost more per useful hour than their price says
    small_r = next(r for r in ranking.ranked if r.placement.gpu_memory_gib == 40.0)
    assert small_r.score > small_r.price_per_job_hour * 1.3


def test_a_model_that_fits_nowhere_empties_the_ranking_and_says_why():
    s = spec(model={**MODEL_7B, "sharding": "ddp"})
    ranking = rank(s, CATALOG, [], NOW)
    assert ranking.ranked == ()
    why = ranking.why_empty()
    assert "6 by fit" in why and "does not fit a 40 GiB GPU" in why


def test_filters_name_the_constraint_that_emptied_the_set():
    s = spec(clouds=["azure"])
    why = rank(s, CATALOG, [], NOW).why_empty()
    assert why.startswith("all 6 candidates were rejected: 6 by cloud")
    s = spec(regions=["ap-south-1"])
    assert "6 by region" in rank(s, CATALOG, [], NOW).why_empty()
    assert "no candidates" in rank(spec(), [], [], NOW).why_empty()


@pytest.mark.parametrize(
    "excluded,gone",
    [
        (["us-central1"], {"us-central1"}),
        (["gcp/us-central1"], {"us-central1"}),
        (["aws:us-west-2", "europe-west4"], {"us-west-2", "europe-west4"}),
    ],
    ids=["region", "cloud/region", "cloud:region+region"],
)
def test_excluded_regions(excluded, gone):
    ranked = rank_candidates(spec(), CATALOG, [], NOW, exclude_regions=excluded)
    assert ranked and not {p.region for p in ranked} & gone


def test_spot_needs_a_spot_price():
    no_spot = Candidate("aws", "us-east-1", "p4d.24xlarge", "A100", 8, 40.0, 32.77, None)
    r = rank(spec(), [no_spot], [], NOW)
    assert r.rejected[0].constraint == "spot"
    assert rank_candidates(spec(spot=False), [no_spot], [], NOW)[0].price_per_node_hour == 32.77


def test_min_nodes_lets_a_short_region_run_on_fewer_nodes():
    s = spec(num_nodes=4, min_nodes=2)
    c = CATALOG[2]
    key = (c.cloud, c.region, c.instance_type)
    placed = rank_candidates(s, [c], [], NOW, available_nodes={key: 3})[0]
    assert placed.num_nodes == 3
    assert any("fewer nodes (3 of 4" in r for r in placed.reasons)
    r = rank(s, [c], [], NOW, available_nodes={key: 1})
    assert r.rejected[0].constraint == "nodes" and "at least 2" in r.rejected[0].reason
    # without min_nodes, a short region is no candidate at all
    assert rank(spec(num_nodes=4), [c], [], NOW, available_nodes={key: 3}).rejected


def test_a_capacity_refusal_offers_an_elastic_job_one_node_fewer_there_down_to_min_nodes():
    s = spec(num_nodes=4, min_nodes=2)
    c = CATALOG[2]
    refused = FailureRecord(c.cloud, c.region, c.instance_type, NOW - timedelta(minutes=5),
                            "capacity_unavailable", num_nodes=4)  # fmt: skip
    (placed,) = rank_candidates(s, [c], [refused], NOW)
    assert placed.num_nodes == 3 and any("fewer nodes (3 of 4" in r for r in placed.reasons)
    # refused at 3 as well: 2, the min; refused at 2: the placement cools down
    again = replace(refused, num_nodes=3)
    assert rank_candidates(s, [c], [refused, again], NOW)[0].num_nodes == 2
    last = rank(s, [c], [refused, again, replace(refused, num_nodes=2)], NOW)
    assert not last.ranked and "had no capacity" in last.rejected[0].reason


def test_a_capacity_refusal_still_cools_the_placement_down_for_a_job_without_min_nodes():
    c = CATALOG[2]
    refused = FailureRecord(c.cloud, c.region, c.instance_type, NOW - timedelta(minutes=5),
                            "capacity_unavailable", num_nodes=4)  # fmt: skip
    assert not rank(spec(num_nodes=4), [c], [refused], NOW).ranked
    # a refusal that does not say how many it asked for blocks an elastic job too
    unknown = replace(refused, num_nodes=None)
    assert not rank(spec(num_nodes=4, min_nodes=2), [c], [unknown], NOW).ranked


def test_fewer_nodes_cost_throughput_so_a_full_region_wins_at_equal_price():
    s = spec(num_nodes=4, min_nodes=2)
    a = cand("gcp", "us-central1", "a2-highgpu-8g", 10.0)
    b = cand("aws", "us-west-2", "p4d.24xlarge", 10.0)
    ranked = rank_candidates(
        s, [a, b], [], NOW, available_nodes={("gcp", "us-central1", "a2-highgpu-8g"): 3}
    )
    assert [p.region for p in ranked] == ["us-west-2", "us-central1"]


def test_node_counts_whose_ranks_do_not_split_the_global_batch_are_skipped():
    # 48 sequences over 8 GPUs per node: 3 nodes (24 ranks) splits it, 4 nodes does not
    # need to be tried because capacity is 3, 2 nodes would also do; the planner takes 3.
    model = {**MODEL_7B, "global_batch": 48, "micro_batch": 2}
    s = spec(num_nodes=5, min_nodes=2, model=model)
    c = CATALOG[5]  # 80 GiB
    placed = rank_candidates(
        s, [c], [], NOW, available_nodes={(c.cloud, c.region, c.instance_type): 5}
    )
    assert placed[0].num_nodes == 3  # 5 nodes = 40 ranks and 4 = 32 do not divide 48
    k = placed[0].knobs
    assert k is not None and k.micro_batch * k.grad_accum * 3 * 8 == 48


def test_ties_break_on_the_jobs_preference_then_name():
    a = cand("aws", "us-west-2", "p4d.24xlarge", 10.0, pref=1)
    b = cand("gcp", "us-central1", "a2-highgpu-8g", 10.0, pref=0)
    assert [p.cloud for p in rank_candidates(spec(), [a, b], [], NOW)] == ["gcp", "aws"]
    assert [p.cloud for p in rank_candidates(spec(), [b, a], [], NOW)] == ["gcp", "aws"]


def test_unknown_gpu_memory_is_rejected_only_when_a_model_needs_checking():
    c = Candidate("aws", "us-east-1", "x.large", "A100", 8, None, 30.0, 10.0)
    assert rank_candidates(spec(), [c], [], NOW)
    r = rank(spec(model=MODEL_7B), [c], [], NOW)
    assert r.rejected[0].constraint == "fit" and "memory unknown" in r.rejected[0].reason


def test_policy_refuses_nonsense():
    with pytest.raises(ValueError, match="half_life"):
        PlannerPolicy(half_life=timedelta(0))
    with pytest.raises(ValueError, match="max_lost_fraction"):
        PlannerPolicy(max_lost_fraction=1.0)


@pytest.mark.parametrize(
    "accelerators, first",
    [
        ({"ordered": ["H100:8", "A100:8"]}, "p5.48xlarge"),  # strict: H100 though dearer
        ({"any_of": ["H100:8", "A100:8"]}, "p4d.24xlarge"),  # free: the cheaper A100
        (["H100:8", "A100:8"], "p4d.24xlarge"),  # a plain list is any_of
    ],
    ids=["ordered", "any_of", "plain-list"],
)
def test_ordered_accelerators_are_a_strict_preference_any_of_is_ranked_by_cost(accelerators, first):
    cands = [
        cand("aws", "us-east-1", "p5.48xlarge", 30.0, acc="H100", mem=80.0, pref=0),
        cand("aws", "us-east-1", "p4d.24xlarge", 10.0, pref=1),
    ]
    r = rank(spec(accelerators=accelerators), cands, [], NOW)
    assert r.ranked[0].placement.instance_type == first


def test_an_ordered_first_choice_without_capacity_falls_to_the_next():
    cands = [
        cand("aws", "us-east-1", "p5.48xlarge", 30.0, acc="H100", mem=80.0, pref=0),
        cand("aws", "us-east-1", "p4d.24xlarge", 10.0, pref=1),
    ]
    stockout = [FailureRecord("aws", "us-east-1", "p5.48xlarge", NOW, "capacity_unavailable")]
    s = spec(accelerators={"ordered": ["H100:8", "A100:8"]})
    assert rank(s, cands, stockout, NOW).ranked[0].placement.instance_type == "p4d.24xlarge"


def test_a_spec_s_accelerator_choice_needs_exactly_one_form():
    from orchestrator.domain.spec import SpecError

    with pytest.raises(SpecError, match="exactly one of ordered or any_of"):
        spec(accelerators={"ordered": ["A100:8"], "any_of": ["H100:8"]})
    with pytest.raises(SpecError, match="not an accelerator"):
        spec(accelerators={"ordered": ["A100:x"]})
