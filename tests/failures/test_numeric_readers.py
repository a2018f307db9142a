"""The readers that take numbers out of a log (loss values, step times, per-rank
figures), on real excerpts. Each case quotes the thread it comes from."""

from __future__ import annotations

from orchestrator.domain import failures
from orchestrator.domain.failures import FailureClass, classify_failure

F = FailureClass

# https://github.com/BVLC/caffe/issues/6373 (times and pid cut): a healthy GoogLeNet
# test pass. Its layer names end in digits (loss1/, loss2/, loss3/), which once read as
# loss values 1, 2, 3: a rising loss, so a healthy log was called a loss spike.
CAFFE_GOOGLENET = """\
I0427 solver.cpp:330] Iteration 3000, Testing net (#0)
I0427 solver.cpp:397]     Test net output #0: loss1/loss1 = 0.286547 (* 0.3 = 0.0859641 loss)
I0427 solver.cpp:397]     Test net output #1: loss1/top-1 = 0.8822
I0427 solver.cpp:397]     Test net output #2: loss1/top-5 = 1
I0427 solver.cpp:397]     Test net output #3: loss2/loss2 = 0.245257 (* 0.3 = 0.0735772 loss)
I0427 solver.cpp:397]     Test net output #4: loss2/top-1 = 0.9106
I0427 solver.cpp:397]     Test net output #5: loss2/top-5 = 1
I0427 solver.cpp:397]     Test net output #6: loss3/loss3 = 0.247474 (* 1 = 0.247474 loss)
I0427 solver.cpp:397]     Test net output #7: loss3/top-1 = 0.9138
I0427 solver.cpp:397]     Test net output #8: loss3/top-5 = 1
"""


def _series(text: str) -> dict[str, list[float]]:
    lines = failures.log_lines(text)
    return {k: [v for v, _ in pts] for k, pts in failures._loss_series(lines).items()}


def test_a_digit_glued_to_loss_is_part_of_the_name_not_a_value() -> None:
    assert _series(CAFFE_GOOGLENET) == {
        "loss1/loss1": [0.286547],
        "loss2/loss2": [0.245257],
        "loss3/loss3": [0.247474],
    }


def test_layer_names_ending_in_digits_are_not_a_rising_loss() -> None:
    c = classify_failure(None, None, CAFFE_GOOGLENET, model_fallback=False)
    assert c.failure_class is not F.LOSS_SPIKE, c.evidence


def test_the_loss_wordings_the_reader_was_built_for_still_read() -> None:
    lines = [
        "loss: 1.23",
        "Total loss: 0.5",
        "lm loss: 2.3E+00",
        "{'loss': 0.4, 'grad_norm': 201.18}",
        "step_78540:\tloss_-4.065555573",
        "loss_rpn_cls: 0.4217, loss: 1.6328",
        "val_loss=tensor(0.5)",
        "loss2 0.7",
    ]
    got = [_series(line) for line in lines]
    assert got == [
        {"loss": [1.23]},
        {"total loss": [0.5]},
        {"lm loss": [2.3]},
        {"loss": [0.4]},
        {"loss": [-4.065555573]},
        {"loss_rpn_cls": [0.4217], "loss": [1.6328]},
        {"val_loss": [0.5]},
        {"loss2": [0.7]},
    ]


# --- stragglers: each rank's own step time, round by round ---

# https://github.com/rwth-i6/returnn/issues/1485 (4-GPU distributed training, one slow
# epoch): the rank on cuda:1 is the slowest in both steps, 2.3x its peers in step 0 and
# 1.5x in step 1. Read from each rank's last line alone, the 2.3x was never compared.
RETURNN_STEPS = """\
ep 29 train, step 0, ce 5.274, ctc_17 6.704, fer 0.844, mem_usage:cuda:0 6.5GB, 1.209 sec/step
ep 29 train, step 0, ce 5.327, ctc_17 6.773, fer 0.853, mem_usage:cuda:3 6.2GB, 0.917 sec/step
ep 29 train, step 0, ce 5.034, ctc_17 6.311, fer 0.835, mem_usage:cuda:2 6.1GB, 1.396 sec/step
ep 29 train, step 0, ce 5.506, ctc_17 6.769, fer 0.835, mem_usage:cuda:1 6.0GB, 2.771 sec/step
ep 29 train, step 1, ce 5.511, ctc_17 6.852, fer 0.848, mem_usage:cuda:2 6.1GB, 2.100 sec/step
ep 29 train, step 1, ce 5.264, ctc_17 6.642, fer 0.874, mem_usage:cuda:3 6.2GB, 2.155 sec/step
ep 29 train, step 1, ce 5.476, ctc_17 6.839, fer 0.836, mem_usage:cuda:0 6.5GB, 2.238 sec/step
ep 29 train, step 1, ce 5.396, ctc_17 6.655, fer 0.832, mem_usage:cuda:1 6.2GB, 3.249 sec/step
"""

# https://github.com/flagos-ai/FlagScale/pull/938: a healthy run's straggler report,
# per-rank times within 10% of each other.
FLAGSCALE_NO_STRAGGLER = """\
[default0]:  optimizer:
[default0]:    Min: 9.17ms, Max: 10.12ms, Avg: 9.55ms, Slowdown: 1.10x
[default0]:    Rank 0: 9.98ms
[default0]:    Rank 1: 10.12ms
[default0]:    Rank 2: 9.46ms
[default0]:    Rank 3: 9.40ms
[default0]:    Rank 4: 9.17ms
[default0]:    Rank 5: 9.58ms
"""


def test_a_rank_slow_in_one_step_of_several_is_found_in_that_step() -> None:
    c = classify_failure(None, None, RETURNN_STEPS, model_fallback=False)
    assert c.failure_class is F.SLOW_PEER
    assert c.decided_by is not None and "cuda:1 6.0GB, 2.771 sec/step" in c.decided_by


def test_the_last_step_alone_is_not_enough_to_call_a_straggler() -> None:
    # Step 1 by itself: 1.5x, under the factor. The finding above comes from step 0.
    step_1 = "\n".join(RETURNN_STEPS.splitlines()[4:])
    assert classify_failure(None, None, step_1, model_fallback=False).failure_class is F.UNKNOWN


def test_ranks_within_ten_percent_are_no_straggler() -> None:
    c = classify_failure(None, None, FLAGSCALE_NO_STRAGGLER, model_fallback=False)
    assert c.failure_class is not F.SLOW_PEER, c.evidence


# https://github.com/NVIDIA/nccl-tests/issues/106: two-node all_reduce busbw per host
# pair; every pair with se02gn644 runs at ~49 GB/s, the others at ~88 (one crossing the
# top-of-rack switch is slow too, but its hosts are fast in their other pairs).
NCCL_TESTS_PAIRS = """\
se02gn644,se02gn699     49.36
se02gn632,se02gn641     88.36
se02gn284,se02gn678     49.28  # crossing TOR
se02gn641,se02gn644     49.30
se02gn404,se02gn699     86.81  # crossing TOR
"""


def test_the_host_slow_in_every_pair_of_a_pairwise_sweep_is_the_slow_peer() -> None:
    c = classify_failure(None, None, NCCL_TESTS_PAIRS, model_fallback=False)
    assert c.failure_class is F.SLOW_PEER
    assert c.decided_by is not None and "se02gn644" in c.decided_by


def test_a_host_fast_in_another_pair_is_not_the_slow_one() -> None:
    # Without se02gn644's second pair, no host is slow in at least two pairs.
    lines = [ln for ln in NCCL_TESTS_PAIRS.splitlines() if not ln.startswith("se02gn641,se02gn644")]
    assert failures._slow_host_in_pairs(lines) is None


# --- a copy cut short ---

# https://github.com/NVIDIA/nccl/issues/1950: a one-rank avg reduction leaves the last 8
# of 10 elements as zeros; the reporter's own assertion compares the two copies.
NCCL_AVG_TAIL_ZEROS = """\
AssertionError: Last entries are: tensor([-1.1953,  0.2295,  0.0000,  0.0000,  0.0000,  0.0000,  0.0000,  0.0000,
         0.0000,  0.0000], device='cuda:0', dtype=torch.bfloat16) vs tensor([-1.1953,  0.2295,  1.6016,  0.2891,  1.9844, -0.5703, -0.1904,  0.6172,
         1.4141,  1.2578], device='cuda:0', dtype=torch.bfloat16)
"""  # noqa: E501


def test_an_assertion_showing_a_copy_zeroed_after_a_matching_prefix_is_corruption() -> None:
    c = classify_failure(1, None, NCCL_AVG_TAIL_ZEROS, model_fallback=False)
    assert c.failure_class is F.SILENT_CORRUPTION
    assert c.retryable


def test_two_different_tensors_are_not_a_truncated_copy() -> None:
    # The same layout, but the prefixes differ: two values, not a copy and its source.
    text = NCCL_AVG_TAIL_ZEROS.replace(
        "tensor([-1.1953,  0.2295,  1.6016", "tensor([0.5,  0.75,  1.6016"
    )
    assert failures._truncated_copy(text) is None


# --- what the words say ---

# https://github.com/intel/ipex-llm/issues/1486 (BigDL's DistriOptimizer, trimmed).
BIGDL_LOSS_INFINITY = """\
[Epoch 64 736512/1281167][Iteration 45457] Throughput is 408.40378 records/second. Loss is 1.2645824. Current learning rate is 0.046
[Epoch 64 738304/1281167][Iteration 45458] Throughput is 398.6954 records/second. Loss is 1.308916. Current learning rate is 0.046
[Epoch 64 740096/1281167][Iteration 45459] Throughput is 447.22968 records/second. Loss is Infinity. Current learning rate is 0.046
"""  # noqa: E501


def test_bigdl_s_loss_is_read_and_its_infinity_is_divergence() -> None:
    assert _series(BIGDL_LOSS_INFINITY)["loss"] == [1.2645824, 1.308916]
    c = classify_failure(None, None, BIGDL_LOSS_INFINITY, model_fallback=False)
    assert c.failure_class is F.NAN_DIVERGENCE


# https://github.com/ray-project/ray/pull/58638: Ray's NODE_DIED error lists preemption
# as one possible cause among others; the fact it states is a dead node.
RAY_NODE_DIED = (
    "Task failed because the node it was running on is dead or unavailable. Node IP: "
    "127.0.0.1, node ID: e55b8ca03ebf3f7418f51533d8d55abeaab75fa9b29e2e6282b47646. This "
    "can happen if the node was preempted, had a hardware failure, or its raylet crashed "
    "unexpectedly."
)


def test_a_preemption_named_only_as_a_possible_cause_is_no_notice() -> None:
    c = classify_failure(None, None, RAY_NODE_DIED, model_fallback=False)
    assert c.failure_class is F.NODE_LOST


def test_a_preemption_stated_as_a_fact_is_still_a_notice() -> None:
    # https://github.com/broadinstitute/cromwell/pull/7457
    line = (
        "java.lang.Exception: Task myWorkflow.myTask:NA:1 failed: A Spot VM for the job was "
        "preempted during run time"
    )
    assert classify_failure(None, None, line, model_fallback=False).failure_class is (
        F.PREEMPTION_NOTICE
    )


def test_a_spot_instance_its_own_user_terminated_is_an_external_stop() -> None:
    # https://github.com/Coalfire-Research/npk/issues/45
    line = (
        "2019-08-14T15:41:08+0000 : 2019-08-14T15:41:08+0000 : Spot Instance terminated due "
        "to user-initiated termination. [instance-terminated-by-user]"
    )
    c = classify_failure(None, None, line, model_fallback=False)
    assert c.failure_class is F.EXTERNAL_TERMINATION
