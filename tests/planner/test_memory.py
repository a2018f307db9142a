"""The memory planner: knobs that fit, the least recompute first, the global batch kept."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.domain.memory import (
    GIB,
    BatchNotDivisible,
    DoesNotFit,
    activation_bytes,
    checkpointed_blocks,
    estimate,
    plan_memory,
)
from orchestrator.domain.plan import TrainingKnobs
from orchestrator.domain.spec import ModelProfile

LLAMA_7B = dict(
    parameters=6_738_000_000,
    layers=32,
    hidden_size=4096,
    heads=32,
    seq_len=4096,
    global_batch=512,
    micro_batch=4,
)
LLAMA_13B = dict(
    parameters=13_016_000_000,
    layers=40,
    hidden_size=5120,
    heads=40,
    seq_len=4096,
    global_batch=512,
    micro_batch=8,
)


def profile(base: dict[str, int], **kw: object) -> ModelProfile:
    return ModelProfile(**{**base, **kw})


# (model, sharding, GPU GiB, data parallel) -> expected knobs, or None for "fits nowhere"
KNOWN_CASES = [
    ("7b", "fsdp", 80, 8, TrainingKnobs(4, 16, 5)),
    ("7b", "fsdp", 40, 8, TrainingKnobs(4, 16, 1)),
    ("13b", "fsdp", 80, 8, TrainingKnobs(8, 8, 1)),
    ("13b", "fsdp", 40, 8, TrainingKnobs(4, 16, 1)),
    ("13b", "fsdp", 24, 8, None),  # FSDP too: states alone leave no room
    ("13b", "fsdp", 80, 16, TrainingKnobs(8, 4, 1)),
    ("7b", "ddp", 80, 8, None),
    ("7b", "ddp", 40, 8, None),
    ("13b", "ddp", 80, 8, None),
    ("13b", "ddp", 40, 8, None),
]


@pytest.mark.parametrize(
    "model,sharding,gib,dp,expected",
    KNOWN_CASES,
    ids=[f"{m}-{s}-{g}GiB-dp{d}" for m, s, g, d, _ in KNOWN_CASES],
)
def test_known_cases(model, sharding, gib, dp, expected):
    prof = profile(LLAMA_7B if model == "7b" else LLAMA_13B, sharding=sharding)
    if expected is None:
        with pytest.raises(DoesNotFit) as e:
            plan_memory(prof, gib, dp)
        msg = str(e.value)
        assert "parameter model" in msg and f"{gib} GiB GPU" in msg and "smallest estimate" in msg
        assert e.value.smallest.fits is False
        assert e.value.smallest.total_bytes > e.value.smallest.usable_bytes
        return
    plan = plan_memory(prof, gib, dp)
    assert plan.knobs == expected
    assert plan.fits and plan.total_bytes <= plan.usable_bytes
    assert plan.knobs.micro_batch * plan.knobs.grad_accum * dp == prof.global_batch


def test_smaller_gpu_turns_checkpointing_on_and_keeps_global_batch():
    prof = profile(LLAMA_7B, sharding="fsdp")
    big = plan_memory(prof, 80, 8)
    small = plan_memory(prof, 40, 8)
    assert big.knobs.activation_checkpoint_every in (0, 5)
    # every block checkpointed on 40 GiB: more blocks recomputed than on 80 GiB
    assert small.compute_overhead > big.compute_overhead
    for p in (big, small):
        assert p.knobs.micro_batch * p.knobs.grad_accum * 8 == 512


def test_least_checkpointing_is_chosen_first():
    # A 1.3B model on a big GPU needs nothing; the same on a small one needs some.
    small_model = dict(
        parameters=1_300_000_000,
        layers=24,
        hidden_size=2048,
        heads=16,
        seq_len=2048,
        global_batch=64,
        micro_batch=4,
    )
    roomy = plan_memory(profile(small_model, sharding="fsdp"), 24, 8)
    assert roomy.knobs == TrainingKnobs(4, 2, 0) and roomy.compute_overhead == 0
    tight = plan_memory(profile(small_model, sharding="fsdp"), 16, 8)
    assert tight.knobs.activation_checkpoint_every > 0
    assert tight.knobs.micro_batch == 4  # checkpointing comes before a smaller micro-batch
    # nothing with less checkpointing fits (the choice is the least that does)
    every = tight.knobs.activation_checkpoint_every
    assert every not in (0, 1)  # every Nth block, not all of them
    less = estimate(profile(small_model, sharding="fsdp"), TrainingKnobs(4, 2, every + 1), 16, 8)
    assert not less.fits


def test_micro_batch_is_a_divisor_of_the_per_rank_batch():
    prof = profile(LLAMA_13B, sharding="fsdp", global_batch=48, micro_batch=6)
    plan = plan_memory(prof, 40, 8)  # per rank 6: micro 6 does not fit, 3 does
    assert 6 % plan.knobs.micro_batch == 0
    assert plan.knobs.micro_batch * plan.knobs.grad_accum * 8 == 48


def test_batch_that_cannot_be_split_is_refused():
    with pytest.raises(BatchNotDivisible, match=r"global batch 512 .* 24 data-parallel ranks"):
        plan_memory(profile(LLAMA_7B, sharding="fsdp"), 80, 24)


def test_fsdp_divides_states_ddp_does_not():
    ddp = estimate(profile(LLAMA_7B), TrainingKnobs(1, 64, 1), 80, 8)
    fsdp = estimate(profile(LLAMA_7B, sharding="fsdp"), TrainingKnobs(1, 64, 1), 80, 8)
    assert ddp.optimizer_bytes == pytest.approx(6_738_000_000 * 12)
    assert fsdp.optimizer_bytes == pytest.approx(6_738_000_000 * 12 / 8, rel=1e-6)
    assert fsdp.weights_bytes * 8 == pytest.approx(ddp.weights_bytes, rel=1e-6)


def test_korthikanti_activation_sizes():
    prof = profile(LLAMA_7B)
    s, b, h, a = 4096, 1, 4096, 32
    per_block = s * b * h * 34
    assert activation_bytes(prof, 1, 0) == 32 * per_block
    # attention scores stored (no fused attention): the 5as/h term comes back
    assert activation_bytes(prof, 1, 0, attention_scores_stored=True) == int(
        32 * s * b * h * (34 + 5 * a * s / h)
    )
    # every block checkpointed: inputs only, plus one block recomputed at a time
    assert activation_bytes(prof, 1, 1) == 32 * 2 * s * b * h + per_block
    # fp32 activations are twice the 16-bit ones
    assert activation_bytes(profile(LLAMA_7B, dtype="fp32"), 1, 0) == 2 * 32 * per_block


def test_headroom_is_respected():
    prof = profile(LLAMA_7B, sharding="fsdp")
    loose = plan_memory(prof, 80, 8, headroom=0.0)
    strict = plan_memory(prof, 80, 8, headroom=0.3)
    assert strict.usable_bytes == int(80 * GIB * 0.7)
    assert strict.total_bytes <= strict.usable_bytes
    assert strict.compute_overhead >= loose.compute_overhead


@pytest.mark.parametrize("bad", [dict(gpu=0), dict(dp=0), dict(headroom=1.0)])
def test_bad_arguments_are_named(bad):
    with pytest.raises(ValueError, match=r"gpu_memory_gib|data_parallel|headroom"):
        plan_memory(
            profile(LLAMA_7B, sharding="fsdp"),
            bad.get("gpu", 80),
            bad.get("dp", 8),
            headroom=bad.get("headroom", 0.1),
        )


def test_to_dict_reports_components():
    d = plan_memory(profile(LLAMA_7B, sharding="fsdp"), 40, 8).to_dict()
    for key in ("weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "total_gib"):
        assert d[key] >= 0
    assert d["fits"] is True and d["knobs"]["activation_checkpoint_every"] == 1


@st.composite
def profiles(draw):
    heads = draw(st.sampled_from([8, 16, 32, 40]))
    layers = draw(st.integers(2, 48))
    return ModelProfile(
        parameters=draw(st.integers(10**8, 3 * 10**10)),
        layers=layers,
        hidden_size=heads * draw(st.sampled_from([64, 128])),
        heads=heads,
        seq_len=draw(st.sampled_from([512, 2048, 4096, 8192])),
        global_batch=draw(st.sampled_from([64, 128, 256, 512, 1024])),
        micro_batch=draw(st.integers(1, 16)),
        dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
        sharding=draw(st.sampled_from(["ddp", "fsdp"])),
    )


@settings(max_examples=150, deadline=None)
@given(
    prof=profiles(),
    gib=st.sampled_from([16, 24, 40, 48, 80, 141]),
    dp=st.sampled_from([1, 2, 4, 8, 16, 64]),
)
def test_any_plan_fits_keeps_the_global_batch_and_is_the_least_recompute(prof, gib, dp):
    try:
        plan = plan_memory(prof, gib, dp)
    except DoesNotFit as e:
        # nothing at all fits: not even the smallest setting
        assert e.smallest.total_bytes > e.smallest.usable_bytes
        return
    k = plan.knobs
    assert plan.fits and plan.total_bytes <= plan.usable_bytes
    assert k.micro_batch * k.grad_accum * dp == prof.global_batch
    assert k.micro_batch <= prof.micro_batch
    # the largest micro-batch that divides the per-rank batch and fits was kept ...
    per_rank = prof.global_batch // dp
    for bigger in range(k.micro_batch + 1, min(prof.micro_batch, per_rank) + 1):
        if per_rank % bigger == 0:
            full = TrainingKnobs(bigger, per_rank // bigger, 1)
            assert not estimate(prof, full, gib, dp).fits
    # ... and no lighter checkpointing (fewer blocks recomputed) fits at that micro-batch
    chosen = checkpointed_blocks(prof.layers, k.activation_checkpoint_every)
    for every in range(prof.layers + 1):
        if checkpointed_blocks(prof.layers, every) < chosen:
            lighter = TrainingKnobs(k.micro_batch, k.grad_accum, every)
            assert not estimate(prof, lighter, gib, dp).fits
