"""The global batch is fixed; micro-batch and accumulation adapt to world size and memory."""

from __future__ import annotations

import pytest

from training.knobs import nccl_fail_fast_env, plan_batch


@pytest.mark.parametrize(
    ("global_batch", "world", "micro", "want"),
    [
        (64, 8, None, (8, 1)),
        (64, 8, 2, (2, 4)),
        (64, 4, 2, (2, 8)),
        (64, 2, 3, (2, 16)),  # 3 does not divide 32: the next smaller that does
        (8, 4, None, (2, 1)),
    ],
    ids=["no-accum", "accum-4", "fewer-ranks", "round-down", "tiny"],
)
def test_global_batch_is_preserved(global_batch, world, micro, want):
    plan = plan_batch(global_batch, world, micro)
    assert (plan.micro_batch, plan.grad_accum) == want
    assert plan.micro_batch * plan.grad_accum * world == global_batch


def test_indivisible_global_batch_is_refused():
    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        plan_batch(64, 3)


def test_nccl_settings_fail_fast_and_dump_on_timeout():
    env = nccl_fail_fast_env(timeout_s=120)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
