"""Round 7 of the classifier (issue 23): wordings the rules had not seen, from the
corpus's development part (tests/failures/corpus/round7.jsonl). Each case quotes the
thread it comes from; each rule also has a case it must leave alone."""

from __future__ import annotations

import pytest

from orchestrator.domain.failures import FailureClass, classify_failure

F = FailureClass


def _cls(text: str) -> FailureClass:
    return classify_failure(None, None, text).failure_class


@pytest.mark.parametrize(
    "text",
    [
        # https://github.com/InternLM/InternLM-XComposer/issues/106
        "The loss decreased to around 0.7X at 0.02, but it suddenly spiked to over 20.",
        # https://github.com/mosaicml/llm-foundry/issues/759
        "Loss was decreasing but after 42k iteration it got spiked and started exploding.",
        # https://github.com/mosaicml/llm-foundry/issues/232
        "hi, i'm pretrain mpt 125m and after some tokens (arround 2200), loss starts exploding",
        # https://github.com/SihanXU/nepa/issues/7
        "there are sudden jumps every few epochs in the training loss curves.",
        # https://github.com/xuannianz/EfficientDet/issues/21
        "1. The loss diverges during epoch 33.",
        # https://github.com/basilevh/gcd/issues/12
        "Initially, the loss decreases well, but at a certain point (about 3k steps), it "
        "suddenly starts to diverge.",
    ],
    ids=[
        "suddenly-spiked",
        "got-spiked",
        "starts-exploding",
        "sudden-jumps",
        "diverges",
        "starts-to-diverge",
    ],
)
def test_a_loss_spike_told_in_prose_is_a_loss_spike(text: str) -> None:
    assert _cls(text) is F.LOSS_SPIKE


def test_a_loss_that_diverged_to_nan_is_divergence_not_a_spike() -> None:
    c = classify_failure(None, None, "the loss diverged after step 900: loss is nan")
    assert c.failure_class is F.NAN_DIVERGENCE


def test_divergence_below_a_named_error_leaves_the_error_the_cause() -> None:
    text = "the loss started to diverge\nRuntimeError: CUDA out of memory. Tried to allocate 2 GiB"
    assert _cls(text) is F.CUDA_OOM


@pytest.mark.parametrize(
    "text",
    [
        # https://github.com/NVIDIA/nccl/issues/434
        "Occasionally I am seeing that the result of the reduction on one of the nodes "
        "(interestingly always the same one) differs from the results on all the other nodes.",
        # https://github.com/Xilinx/ACCL/issues/196
        "353th item is incorrect! (352.000000 != 704.000000)",
        # https://github.com/NVIDIA/nccl/issues/1199
        "i has run a allreduce test with this cmd on 2 node 8 x H800 which is with 8 x 400Gb "
        "NIC,but i got a lot of wrongs:",
        # https://github.com/KnowingNothing/MatmulTutorial/issues/17
        "Hi I noticed that the cuda kernel results don't match cpu in examples\\matmul\\this-sm80.",
        # https://github.com/ORNL/HeCBench/issues/61
        "Found that dxtc1-cuda is failing in CPU/GPU validation.",
    ],
    ids=["one-node-differs", "item-incorrect", "lot-of-wrongs", "not-match-cpu", "validation"],
)
def test_wrong_values_told_in_words_are_silent_corruption(text: str) -> None:
    assert _cls(text) is F.SILENT_CORRUPTION


def test_results_that_differ_from_a_paper_name_no_copy_and_stay_unknown() -> None:
    # No nodes, ranks or devices whose copies disagree: a reproduction gap, not corruption.
    assert _cls("my results differ from the paper by 2 points of accuracy") is F.UNKNOWN


def test_horovod_s_ready_ranks_list_names_a_late_rank() -> None:
    # https://github.com/horovod/horovod/issues/530
    line = (
        "Stalled ops: HorovodBroadcast_InceptionV3_Logits_Conv2d_1c_1x1_weights_0 "
        "[ready ranks: 5, 6, 3, 1, 4, 0]"
    )
    assert _cls(line) is F.SLOW_PEER


def test_a_tpu_that_cannot_be_opened_fails_the_node_check() -> None:
    # https://github.com/marin-community/marin/issues/4783 (the exception line alone)
    line = (
        "jax.errors.JaxRuntimeError: UNKNOWN: TPU initialization failed: open(/dev/vfio/0): "
        "Device or resource busy: Device or resource busy; Couldn't open iommu group /dev/vfio/0"
    )
    assert _cls(line) is F.HEALTH_CHECK_FAILED


def test_a_spot_vm_s_preemption_named_as_a_noun_is_a_notice() -> None:
    # https://github.com/nextflow-io/nextflow/issues/4410
    text = "GCP Batch jobs that fail due to Spot VM preemption lack an exit code"
    assert _cls(text) is F.PREEMPTION_NOTICE


def test_a_slurm_job_cancelled_due_to_preemption_stays_an_external_stop() -> None:
    # The scheduler's preemption, not a cloud reclaim (the noun rule needs a spot VM).
    line = (
        "slurmstepd: error: *** JOB 4242 ON gpu-17 CANCELLED AT 2024-05-01T10:00:00 "
        "DUE TO PREEMPTION ***"
    )
    assert _cls(line) is F.EXTERNAL_TERMINATION


def test_one_gpu_that_slows_down_the_whole_training_is_a_slow_peer() -> None:
    # https://github.com/mlfoundations/open_clip/issues/136
    assert _cls("One gpu can slow down the whole training") is F.SLOW_PEER


def test_a_certificate_that_fails_verification_is_no_wrong_result() -> None:
    line = "ssl.SSLCertVerificationError: certificate verify failed: unable to get local issuer"
    assert _cls(line) is not F.SILENT_CORRUPTION
    assert _cls("SSL certificate verification failed for s3.amazonaws.com") is not (
        F.SILENT_CORRUPTION
    )
