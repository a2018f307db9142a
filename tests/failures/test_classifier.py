"""The classifier on labelled excerpts of real log text.

Excerpts are trimmed from public issue threads (URL in the comment above each group;
hostnames, pids and sizes shortened). Each case: (id, log, exit code, signal, class).
Where public threads have little text (stragglers, silent corruption, the cloud notice
bodies), the excerpt follows the documented format or the message our own agent and
training library print; those cases carry no URL.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contract import ExitCode
from orchestrator.domain.failures import (
    CLASSIFIABLE,
    Classification,
    FailureClass,
    classify_failure,
    exception_signature,
)

F = FailureClass

CASES: list[tuple[str, str, int | None, int | str | None, FailureClass]] = [
    # --- nccl_timeout ---
    # https://github.com/hiyouga/LlamaFactory/issues/7396
    (
        "watchdog-allreduce-600s",
        "[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, "
        "NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for 600060 "
        "milliseconds before timing out.",
        None,
        None,
        F.NCCL_TIMEOUT,
    ),
    # https://github.com/hiyouga/LlamaFactory/issues/6269
    (
        "watchdog-reduce-scatter",
        "[rank4]:[E1206 18:44:12.755262105 ProcessGroupNCCL.cpp:607] [Rank 4] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, "
        "NumelIn=544997376, NumelOut=68124672, Timeout(ms)=600000) ran for 600099 "
        "milliseconds before timing out.",
        -6,
        None,
        F.NCCL_TIMEOUT,
    ),
    # https://github.com/OFA-Sys/OFA/issues/271
    (
        "watchdog-old-format-30min",
        "[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=469508, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802212 "
        "milliseconds before timing out.",
        None,
        None,
        F.NCCL_TIMEOUT,
    ),
    # https://github.com/sgl-project/sglang/issues/1693
    (
        "watchdog-terminate-called",
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
        "  what():  [PG 3 Rank 5] Process group watchdog thread terminated with exception: "
        "[Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9141, "
        "OpType=_ALLGATHER_BASE, NumelIn=19008, NumelOut=152064, Timeout(ms)=600000) ran for "
        "600020 milliseconds before timing out.",
        None,
        "SIGABRT",
        F.NCCL_TIMEOUT,
    ),
    # https://github.com/meta-pytorch/torchtune/issues/2676 (gloo barrier)
    (
        "gloo-recv-timeout",
        "[rank2]:     work.wait()\n"
        "[rank2]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/"
        "unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete",
        1,
        None,
        F.NCCL_TIMEOUT,
    ),
    # --- nccl_transport ---
    # https://github.com/tatsu-lab/stanford_alpaca/issues/207
    (
        "ncclremoteerror-ib-err12",
        "what(): NCCL error: remote process exited or there was a network error, NCCL version "
        "2.14.3 ncclRemoteError: A call failed possibly due to a network error or a remote "
        "process exiting prematurely. Last error: NET/IB : Got completion from peer "
        "11.214.147.122<39138> with error 12, opcode 0, len 0, vendor err 129",
        None,
        None,
        F.NCCL_TRANSPORT,
    ),
    # https://github.com/NVIDIA/nccl-tests/issues/252
    (
        "net-ib-completion-error-4",
        "node2:25146:25854 [0] ib_plugin.c:1105 NCCL WARN NET/IB : Got completion from peer "
        "10.0.35.1<49189> with error 4, opcode 5327, len 5327, vendor err 81 (Send)\n"
        "node2:25146:25854 [0] NCCL INFO transport/net.cc:1137 -> 6",
        None,
        None,
        F.NCCL_TRANSPORT,
    ),
    # https://github.com/NVIDIA/nccl/issues/795
    (
        "socket-broken-pipe",
        "a100-22:183006:183220 [1] misc/socket.cc:518 NCCL WARN Net : Call to recv from "
        "10.200.84.247<58355> failed : Broken pipe\n"
        "a100-22:183006:183220 [1] NCCL INFO misc/socket.cc:535 -> 6",
        None,
        None,
        F.NCCL_TRANSPORT,
    ),
    # https://github.com/NVIDIA/nccl-tests/issues/185
    (
        "ibv-modify-qp-unreachable",
        "dgxh100-3:225140:225355 [0] misc/ibvwrap.cc:187 NCCL WARN Call to ibv_modify_qp "
        "failed with error Network is unreachable",
        None,
        None,
        F.NCCL_TRANSPORT,
    ),
    # https://github.com/NVIDIA/nccl/issues/2076
    (
        "distbackenderror-connection-reset",
        "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/"
        "c10d/NCCLUtils.hpp:268, remote process exited or there was a network error, NCCL "
        "version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a "
        "remote process exiting prematurely.\nLast error:\nsocketProgressOpt: Call to recv "
        "from 172.16.0.3<33759> failed : Connection reset by peer",
        1,
        None,
        F.NCCL_TRANSPORT,
    ),
    # --- rendezvous_failure ---
    # https://github.com/facebookresearch/av_hubert/issues/19
    (
        "rendezvous-timeout-json",
        "ERROR:torch.distributed.elastic.multiprocessing.errors.error_handler:{\n"
        '  "message": {\n    "message": "RendezvousTimeoutError: ",',
        1,
        None,
        F.RENDEZVOUS_FAILURE,
    ),
    # https://github.com/pytorch/pytorch/issues/79388
    (
        "c10d-store-client-timeout",
        "[E socket.cpp:793] [c10d] The client socket has timed out after 60s while trying to "
        "connect to (10.0.0.1, 2222).\n"
        '    "message": "RendezvousConnectionError: The connection to the C10d store has '
        'failed. See inner exception for details.",',
        1,
        None,
        F.RENDEZVOUS_FAILURE,
    ),
    # https://github.com/pytorch/pytorch/issues/116974
    (
        "rendezvous-closed",
        "Traceback (most recent call last):\n"
        '  File "/usr/bin/torchrun", line 8, in <module>\n'
        "torch.distributed.elastic.rendezvous.api.RendezvousClosedError",
        1,
        None,
        F.RENDEZVOUS_FAILURE,
    ),
    # https://github.com/pytorch/pytorch/issues/64926
    (
        "rendezvous-connection-multi-nic",
        '[ERROR] 2021-09-13 22:18:26,678 error_handler: {\n  "message": {\n    "message": '
        '"RendezvousConnectionError: The connection to the C10d store has failed. See inner '
        'exception for details.",',
        1,
        None,
        F.RENDEZVOUS_FAILURE,
    ),
    # https://github.com/ymcui/Chinese-LLaMA-Alpaca-2/issues/274
    (
        "rendezvous-timeout-traceback",
        "Traceback (most recent call last):\n"
        '  File "/opt/conda/bin/torchrun", line 33, in <module>\n'
        "    raise RendezvousTimeoutError()\n"
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
        1,
        None,
        F.RENDEZVOUS_FAILURE,
    ),
    # --- cuda_oom ---
    # https://github.com/pytorch/pytorch/issues/16417
    (
        "cuda-oom-new-format",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 "
        "has a total capacity of 23.65 GiB of which 11.06 MiB is free.",
        1,
        None,
        F.CUDA_OOM,
    ),
    # https://github.com/pytorch/pytorch/issues/59778
    (
        "cuda-oom-old-format",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 6.00 GiB total "
        "capacity; 781.59 MiB already allocated; 3.03 GiB free; 1.24 GiB reserved in total "
        "by PyTorch)",
        1,
        None,
        F.CUDA_OOM,
    ),
    # https://github.com/murong-xu/CADS/issues/4
    (
        "torch-outofmemoryerror",
        "Traceback (most recent call last):\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.78 GiB. GPU 0 has a "
        "total capacity of 31.47 GiB of which 12.73 GiB is free.",
        1,
        None,
        F.CUDA_OOM,
    ),
    # https://github.com/Li-Chongyi/Zero-DCE/issues/52
    (
        "outofmemoryerror-bare",
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.71 GiB (GPU 0; 6.00 GiB "
        "total capacity; 3.49 GiB already allocated; 1.04 GiB free)",
        1,
        None,
        F.CUDA_OOM,
    ),
    # OOM on one rank, watchdog timeouts on the others: the root cause wins.
    # https://github.com/wxian3/NeuroLens/issues/2 + LlamaFactory#7396
    (
        "cuda-oom-beats-collateral-timeout",
        "[rank1]: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 55.57 GiB."
        "\n[rank0]:[E321 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, Timeout(ms)=600000) ran "
        "for 600060 milliseconds before timing out.",
        1,
        None,
        F.CUDA_OOM,
    ),
    # --- host_oom_killed ---
    # https://github.com/pcyin/tranX/issues/41
    (
        "dmesg-killed-process",
        "[2059991.491436] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,"
        "mems_allowed=0,global_oom,task_memcg=/user.slice,task=python3,pid=25315,uid=0\n"
        "[2059991.491542] Out of memory: Killed process 25315 (python3) total-vm:53312244kB, "
        "anon-rss:31451456kB, file-rss:74816kB, shmem-rss:12296kB, UID:0",
        None,
        9,
        F.HOST_OOM_KILLED,
    ),
    # https://github.com/xxayt/MGSV/issues/2
    (
        "torchrun-exitcode-minus-9",
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: "
        "0 (pid: 178) of binary: /root/miniconda3/envs/env/bin/python",
        1,
        None,
        F.HOST_OOM_KILLED,
    ),
    # https://github.com/TorchSSL/TorchSSL/issues/4
    (
        "dataloader-worker-killed",
        "RuntimeError: DataLoader worker (pid 12847) is killed by signal: Killed.",
        1,
        None,
        F.HOST_OOM_KILLED,
    ),
    (
        "kernel-invoked-oom-killer",
        "[ 8712.118811] python invoked oom-killer: gfp_mask=0x100cca(GFP_HIGHUSER_MOVABLE), "
        "order=0, oom_score_adj=0",
        None,
        9,
        F.HOST_OOM_KILLED,
    ),
    # Bare SIGKILL, no text (https://github.com/noelshin/selfmask/issues/11): a low-
    # confidence guess, the most common cause.
    ("bare-exit-137", "Process finished with exit code 137", 137, None, F.HOST_OOM_KILLED),
    # --- gpu_hardware ---
    # https://github.com/wilicc/gpu-burn/issues/1
    (
        "xid-79-fallen-off-bus",
        "[74889.644138] NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.",
        None,
        None,
        F.GPU_HARDWARE,
    ),
    # https://github.com/NVIDIA/NVSentinel/issues/155
    (
        "fallen-off-bus-no-xid",
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
        "               NVRM: fallen off the bus and is not responding to commands.",
        None,
        None,
        F.GPU_HARDWARE,
    ),
    (
        "cuda-uncorrectable-ecc",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
        "CUDA kernel errors might be asynchronously reported at some other API call",
        1,
        None,
        F.GPU_HARDWARE,
    ),
    # https://github.com/leptonai/gpud/pull/1174
    (
        "xid-94-contained-ecc",
        "NVRM: Xid (PCI:0000:9b:00): 94, pid=1234, name=python3, Contained ECC error",
        None,
        None,
        F.GPU_HARDWARE,
    ),
    # https://github.com/NVIDIA/nccl-tests/issues/24
    (
        "illegal-memory-access",
        "gpu5:35917:35917 [1] init.cu:194 NCCL WARN Cuda failure 'an illegal memory access "
        "was encountered'",
        None,
        None,
        F.GPU_HARDWARE,
    ),
    # --- nan_divergence ---
    (
        "deit-loss-is-nan",  # facebookresearch/deit engine.py prints this, then sys.exit(1)
        "Loss is nan, stopping training",
        1,
        None,
        F.NAN_DIVERGENCE,
    ),
    (
        "fairseq-min-loss-scale",  # facebookresearch/fairseq
        "FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably "
        "exploding. Try lowering the learning rate, using gradient clipping or increasing the "
        "batch size.",
        1,
        None,
        F.NAN_DIVERGENCE,
    ),
    (
        "anomaly-mode-nan-backward",  # torch.autograd.detect_anomaly
        "RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output.",
        1,
        None,
        F.NAN_DIVERGENCE,
    ),
    (
        "megatron-found-nan-grad-norm",  # NVIDIA/Megatron-LM
        "AssertionError: found NaN in local grad norm in backward pass before data-parallel "
        "communication collective",
        1,
        None,
        F.NAN_DIVERGENCE,
    ),
    ("contract-exit-76", "", int(ExitCode.NAN_DETECTED), None, F.NAN_DIVERGENCE),
    # --- loss_spike ---
    # https://github.com/NVIDIA/waveglow/issues/32 (one step 1000x the trend)
    (
        "waveglow-single-step-spike",
        "step_78560:\tloss_-4.490265846\nstep_78580:\tloss_-4.454271317\n"
        "step_78600:\tloss_-4.322495461\nstep_78620:\tloss_4191.683593750\n"
        "step_78640:\tloss_-2.408614397",
        None,
        None,
        F.LOSS_SPIKE,
    ),
    # https://github.com/keras-team/keras/issues/7375 (jumps and stays up, never NaN)
    (
        "keras-loss-jumps-and-stays",
        "iteration 68 200285/200285 [=====] - 393s - loss: 1.3696\n"
        "iteration 69 200285/200285 [=====] - 460s - loss: 1.3275\n"
        "iteration 70 200285/200285 [=====] - 443s - loss: 1.6963\n"
        "iteration 71 200285/200285 [=====] - 449s - loss: 4.9700\n"
        "iteration 72 200285/200285 [=====] - 473s - loss: 7.8267\n"
        "iteration 73 200285/200285 [=====] - 441s - loss: 9.1923",
        None,
        None,
        F.LOSS_SPIKE,
    ),
    # --- silent_corruption ---
    ("contract-exit-79", "", int(ExitCode.SILENT_CORRUPTION), None, F.SILENT_CORRUPTION),
    (
        "reference-forward-drift",
        "skyresume: reference forward pass drifted by 3.2e-02 on rank 5: silent data "
        "corruption suspected",
        None,
        None,
        F.SILENT_CORRUPTION,
    ),
    (
        "sdc-detected-by-check",
        "SDC detected: GPU 5 produced a different result on the replayed step 41200",
        None,
        None,
        F.SILENT_CORRUPTION,
    ),
    (
        "weights-diverged-across-replicas",
        "ERROR: weights diverged across data-parallel replicas (max abs diff 3.1e-02)",
        None,
        None,
        F.SILENT_CORRUPTION,
    ),
    (
        "replica-checksum-mismatch",
        "ERROR: parameter checksum mismatch across data-parallel replicas at step 41200",
        None,
        None,
        F.SILENT_CORRUPTION,
    ),
    # --- checkpoint_io ---
    (
        "torch-load-truncated-zip",  # torch.load of a half-written file
        "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central "
        "directory",
        1,
        None,
        F.CHECKPOINT_IO,
    ),
    (
        "no-space-left",
        "OSError: [Errno 28] No space left on device: '/ckpt/step_1200/__0_0.distcp'",
        1,
        None,
        F.CHECKPOINT_IO,
    ),
    (
        "dcp-checkpoint-exception",
        "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:"
        "dict_keys([0, 1])",
        1,
        None,
        F.CHECKPOINT_IO,
    ),
    ("contract-exit-78", "", int(ExitCode.CHECKPOINT_INVALID), None, F.CHECKPOINT_IO),
    ("contract-exit-77", "", int(ExitCode.RESUME_MISMATCH), None, F.CHECKPOINT_IO),
    (
        "s3-slowdown",
        "botocore.exceptions.ClientError: An error occurred (SlowDown) when calling the "
        "PutObject operation: Please reduce your request rate.",
        1,
        None,
        F.CHECKPOINT_IO,
    ),
    # --- health_check_failed ---
    (
        "nvidia-smi-driver",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make "
        "sure that the latest NVIDIA driver is installed and running.",
        None,
        None,
        F.HEALTH_CHECK_FAILED,
    ),
    ("no-cuda-gpus", "RuntimeError: No CUDA GPUs are available", 1, None, F.HEALTH_CHECK_FAILED),
    (
        "found-no-driver",
        "RuntimeError: Found no NVIDIA driver on your system. Please check that you have an "
        "NVIDIA GPU and installed a driver",
        1,
        None,
        F.HEALTH_CHECK_FAILED,
    ),
    (
        "cuda-driver-init",
        "RuntimeError: CUDA driver initialization failed, you might not have a CUDA gpu.",
        1,
        None,
        F.HEALTH_CHECK_FAILED,
    ),
    (
        "preflight-health-check",
        "skyresume-agent: health check failed: dcgmi diag -r 1 reported Fail on GPU 3",
        None,
        None,
        F.HEALTH_CHECK_FAILED,
    ),
    # --- capacity_unavailable ---
    (
        "aws-insufficient-capacity",
        "An error occurred (InsufficientInstanceCapacity) when calling the RunInstances "
        "operation: We currently do not have sufficient p4d.24xlarge capacity in the "
        "Availability Zone you requested (us-east-1a).",
        None,
        None,
        F.CAPACITY_UNAVAILABLE,
    ),
    (
        "gcp-pool-exhausted",
        "code: ZONE_RESOURCE_POOL_EXHAUSTED message: The zone 'projects/p/zones/us-central1-a'"
        " does not have enough resources available to fulfill the request.",
        None,
        None,
        F.CAPACITY_UNAVAILABLE,
    ),
    (
        "skypilot-failed-to-provision",
        "sky.exceptions.ResourcesUnavailableError: Failed to provision all possible launchable"
        " resources. Relax the task's resource requirements: 2x AWS(p4d.24xlarge)",
        None,
        None,
        F.CAPACITY_UNAVAILABLE,
    ),
    (
        "azure-allocation-failed",
        "Code: AllocationFailed Message: Allocation failed. We do not have sufficient capacity"
        " for the requested VM size in this region.",
        None,
        None,
        F.CAPACITY_UNAVAILABLE,
    ),
    (
        "aws-spot-max-price",
        "An error occurred (SpotMaxPriceTooLow) when calling the RunInstances operation",
        None,
        None,
        F.CAPACITY_UNAVAILABLE,
    ),
    # --- slow_peer ---
    # nvidia-resiliency-ext's identify_stragglers() result, as printed in
    # https://github.com/flagos-ai/FlagScale/pull/697
    (
        "nvrx-identify-stragglers",
        "{'straggler_gpus_relative': {StragglerId(rank=3, node='node-1')}, "
        "'straggler_gpus_individual': set()}",
        None,
        None,
        F.SLOW_PEER,
    ),
    (
        "straggler-detector",
        "StragglerDetector: 2 stragglers detected: rank 40 (0.55), rank 41 (0.58)",
        None,
        None,
        F.SLOW_PEER,
    ),
    (
        "rank-is-a-straggler",
        "[skyresume-agent] rank 12 is a straggler: step time p50 4.1s vs job p50 1.3s",
        None,
        None,
        F.SLOW_PEER,
    ),
    (
        "slow-node-detected",
        "slow node detected: node-7 ran 38% below the median throughput for 20 steps",
        None,
        None,
        F.SLOW_PEER,
    ),
    (
        "slow-rank",
        "WARNING: rank 3 is slow: step time 2.9s vs median 1.1s",
        None,
        None,
        F.SLOW_PEER,
    ),
    # --- external_termination ---
    # https://github.com/pytorch/pytorch/issues/150916
    (
        "torchrun-death-signal-15",
        "W0409 07:28:49.530000 1359 torch/distributed/elastic/agent/server/api.py:719] "
        "Received 15 death signal, shutting down workers",
        1,
        None,
        F.EXTERNAL_TERMINATION,
    ),
    # https://github.com/pytorch/pytorch/issues/114097
    (
        "torchrun-death-signal-sigterm",
        "W0823 16:54:02.337000 139733055988160 torch/distributed/elastic/agent/server/"
        "api.py:688] Received Signals.SIGTERM death signal, shutting down workers",
        1,
        None,
        F.EXTERNAL_TERMINATION,
    ),
    ("sigterm-no-notice", "", None, "SIGTERM", F.EXTERNAL_TERMINATION),
    # --- node_lost ---
    # https://github.com/kubeflow/trainer/issues/1638 (a pod went down)
    (
        "gloo-peer-closed",
        "RuntimeError: [/opt/conda/conda-bld/pytorch/work/third_party/gloo/gloo/transport/"
        "tcp/pair.cc:598] Connection closed by peer [10.244.48.107]:12717",
        1,
        None,
        F.NODE_LOST,
    ),
    ("ssh-closed", "Connection to 10.0.0.7 closed by remote host.", 255, None, F.NODE_LOST),
    (
        "no-route-to-host",
        "ssh: connect to host 10.0.0.7 port 22: No route to host",
        255,
        None,
        F.NODE_LOST,
    ),
    # --- user_code_error ---
    (
        "device-side-assert",  # an index out of range inside a CUDA kernel
        "RuntimeError: CUDA error: device-side assert triggered\n"
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        1,
        None,
        F.USER_CODE_ERROR,
    ),
    (
        "keyerror-in-train",
        "Traceback (most recent call last):\n"
        '  File "/app/train.py", line 88, in <module>\n'
        "    batch = batch['input_ids']\n"
        "KeyError: 'input_ids'",
        1,
        None,
        F.USER_CODE_ERROR,
    ),
    (
        "rank-prefixed-shape-error",
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "/app/train.py", line 120, in <module>\n'
        "[rank0]: RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x512 and 768x10)\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        1,
        None,
        F.USER_CODE_ERROR,
    ),
    (
        "module-not-found",
        "Traceback (most recent call last):\n"
        '  File "train.py", line 3, in <module>\n'
        "ModuleNotFoundError: No module named 'transformers'",
        1,
        None,
        F.USER_CODE_ERROR,
    ),
    (
        "attribute-error",
        "Traceback (most recent call last):\n"
        "AttributeError: 'NoneType' object has no attribute 'shape'",
        1,
        None,
        F.USER_CODE_ERROR,
    ),
    (
        "syntax-error",
        "Traceback (most recent call last):\n"
        '  File "train.py", line 12\n'
        "SyntaxError: invalid syntax",
        1,
        None,
        F.USER_CODE_ERROR,
    ),
    # --- preemption_notice ---
    ("contract-exit-75", "", int(ExitCode.PREEMPTED_SAVED), None, F.PREEMPTION_NOTICE),
    # The documented notice bodies (AWS IMDS, Azure Scheduled Events, GCP audit log).
    (
        "aws-instance-action",
        'GET /latest/meta-data/spot/instance-action -> {"action": "terminate", '
        '"time": "2026-12-01T02:20:00Z"}',
        None,
        "SIGTERM",
        F.PREEMPTION_NOTICE,
    ),
    (
        "azure-scheduled-event",
        '{"DocumentIncarnation": 2, "Events": [{"EventId": "A1", "EventType": "Preempt", '
        '"NotBefore": "Tue, 01 Dec 2026 02:21:00 GMT"}]}',
        None,
        None,
        F.PREEMPTION_NOTICE,
    ),
    (
        "gcp-preempted-operation",
        "operationType: compute.instances.preempted targetLink: .../instances/node-3",
        None,
        None,
        F.PREEMPTION_NOTICE,
    ),
    (
        "aws-interruption-warning-event",
        "EC2 Spot Instance Interruption Warning for i-0abc123: action terminate",
        None,
        None,
        F.PREEMPTION_NOTICE,
    ),
    # --- unknown ---
    ("empty", "", None, None, F.UNKNOWN),
    ("nonsense", "step 1200 loss 2.31\nstep 1201 loss 2.30", 1, None, F.UNKNOWN),
]


@pytest.mark.parametrize(
    ("log", "exit_code", "signal", "want"),
    [pytest.param(log, code, sig, want, id=i) for i, log, code, sig, want in CASES],
)
def test_labelled_excerpt_is_classified_as_labelled(
    log: str, exit_code: int | None, signal: int | str | None, want: FailureClass
) -> None:
    got = classify_failure(exit_code, signal, log)
    assert got.failure_class is want, got
    assert 0.0 <= got.confidence <= 1.0
    if want is not F.UNKNOWN:
        assert got.evidence, "every class names its evidence"
    if want is not F.UNKNOWN and log:
        assert any(e in log for e in got.evidence) or got.evidence[0].startswith(
            ("exit code", "killed", "terminated")
        )


def test_every_class_has_at_least_one_labelled_case() -> None:
    labelled = {c[-1] for c in CASES}
    assert labelled == set(CLASSIFIABLE)


def test_taxonomy_has_exactly_the_issue_values() -> None:
    assert [c.value for c in FailureClass] == [
        "preemption_notice", "external_termination", "node_lost", "nccl_timeout", "nccl_transport",
        "rendezvous_failure", "slow_peer", "cuda_oom", "host_oom_killed", "gpu_hardware",
        "nan_divergence", "loss_spike", "silent_corruption", "checkpoint_io", "health_check_failed",
        "capacity_unavailable", "user_code_error", "unknown",
        # Not a failure: an elastic run's planned grow back (issue 20), never classified.
        "elastic_grow",
    ]  # fmt: skip
    assert set(FailureClass) - set(CLASSIFIABLE) == {F.ELASTIC_GROW}


def test_notice_outranks_the_collateral_nccl_timeout() -> None:
    log = "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)"
    got = classify_failure(None, "SIGTERM", log, notice_kind="terminate")
    assert got.failure_class is F.PREEMPTION_NOTICE
    assert got.confidence > 0.9


def test_contract_exit_code_outranks_log_text() -> None:
    got = classify_failure(76, None, "Traceback (most recent call last):\nValueError: x")
    assert got.failure_class is F.NAN_DIVERGENCE
    assert got.evidence == ("exit code 76 (NAN_DETECTED)",)


def test_agent_heartbeat_report_is_node_lost_unless_logs_name_a_root_cause() -> None:
    lost = classify_failure(None, None, "", agent_report={"event": "heartbeat_missed"})
    assert lost.failure_class is F.NODE_LOST
    oom = classify_failure(
        None,
        None,
        "Out of memory: Killed process 25315 (python3) total-vm:53312244kB",
        agent_report={"event": "heartbeat_missed"},
    )
    assert oom.failure_class is F.HOST_OOM_KILLED


def test_agent_message_is_scanned_like_the_log() -> None:
    got = classify_failure(
        None, None, "", agent_report={"message": "ZONE_RESOURCE_POOL_EXHAUSTED in us-east5-b"}
    )
    assert got.failure_class is F.CAPACITY_UNAVAILABLE


def test_only_user_code_errors_are_not_retryable() -> None:
    for i, log, code, sig, want in CASES:
        got = classify_failure(code, sig, log)
        assert got.retryable is (want is not F.USER_CODE_ERROR), i


def test_torchrun_wrapper_is_not_mistaken_for_the_users_exception() -> None:
    got = classify_failure(
        1,
        None,
        "Traceback (most recent call last):\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    )
    assert got.failure_class is F.UNKNOWN


def test_bad_signal_name_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="SIGFOO"):
        classify_failure(None, "SIGFOO", "")


def test_json_shape_matches_the_cli_contract() -> None:
    c = Classification(F.CUDA_OOM, True, 0.95, ("CUDA out of memory",), "CUDA out of memory")
    assert c.to_json_dict() == {
        "class": "cuda_oom",
        "retryable": True,
        "confidence": 0.95,
        "evidence": ["CUDA out of memory"],
        "decided_by": "CUDA out of memory",
    }
    # Above 0.9 a classification cannot be made without the line that decided it.
    with pytest.raises(ValueError, match="deciding line"):
        Classification(F.CUDA_OOM, True, 0.95, ("CUDA out of memory",))


@pytest.mark.parametrize(
    ("line", "strong"),
    [
        ("NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.", True),
        ("Xid 79 on node 3", True),
        ("NVRM: Xid (PCI:0000:3b:00): 13, pid=79, Graphics SM Warp Exception", False),
    ],
    ids=["pci-79", "plain-79", "xid-13-pid-79"],
)
def test_xid_code_is_read_where_it_stands_not_from_a_pid(line: str, strong: bool) -> None:
    got = classify_failure(None, None, line)
    assert got.failure_class is F.GPU_HARDWARE
    assert (got.confidence > 0.9) is strong


def test_a_clean_straggler_report_is_not_a_failure() -> None:
    # https://github.com/flagos-ai/FlagScale/pull/938 prints this every interval.
    log = "[default0]:=== Straggler Report at Step 10 ===\n[default0]:✓ No stragglers detected."
    assert classify_failure(None, None, log).failure_class is F.UNKNOWN


def test_evidence_lines_are_clipped() -> None:
    got = classify_failure(None, None, "CUDA out of memory. " + "x" * 10_000)
    assert got.failure_class is F.CUDA_OOM
    assert len(got.evidence[0]) <= 400


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=500),
    code=st.none() | st.integers(-64, 255),
    sig=st.none() | st.integers(1, 64),
)
def test_any_input_gets_a_valid_classification(
    text: str, code: int | None, sig: int | None
) -> None:
    got = classify_failure(code, sig, text)
    assert got.failure_class in set(FailureClass)
    assert 0.0 <= got.confidence <= 1.0
    assert got.retryable is (got.failure_class is not F.USER_CODE_ERROR)


@pytest.mark.parametrize(
    ("log", "want"),
    [
        ("Traceback (most recent call last):\nKeyError: 'input_ids'", "KeyError: 'input_ids'"),
        (
            "ValueError: got 17 items at /data/x_3.bin",
            "ValueError: got <n> items at <path>",
        ),
        (
            "[rank3]: RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x512 and 768x10)",
            "RuntimeError: mat1 and mat2 shapes cannot be multiplied (<n>x<n> and <n>x<n>)",
        ),
        (
            "RuntimeError: size mismatch, got torch.Size([4, 1024]) at 0x7f3a2b10 id 3f2a9c81d0e4",
            "RuntimeError: size mismatch, got torch.Size([<n>, <n>]) at <hex> id <hex>",
        ),
        (
            "FileNotFoundError: [Errno 2] No such file or directory: './data/train_07.json'",
            "FileNotFoundError: [Errno <n>] No such file or directory: '<path>'",
        ),
        ("[default0]:AssertionError", "AssertionError"),
        ("step 10 loss 2.3\nError: something went wrong", None),
        ("", None),
    ],
    ids=[
        "keyerror",
        "numbers-and-path",
        "rank-prefix-shape",
        "size-hex",
        "errno",
        "bare",
        "prose",
        "empty",
    ],
)
def test_exception_signature_normalises_the_last_exception_line(log: str, want: str | None) -> None:
    assert exception_signature(log) == want


def test_the_same_bug_on_two_ranks_and_shards_has_one_signature() -> None:
    a = "[rank0]: ValueError: shard /data/part-00017.bin has 3 rows, expected 512"
    b = "[rank5]: ValueError: shard /data/part-00201.bin has 9 rows, expected 512"
    assert exception_signature(a) == exception_signature(b) is not None
    assert exception_signature("KeyError: 'labels'") != exception_signature("KeyError: 'ids'")


def test_signature_is_the_users_exception_not_torchruns_wrapper() -> None:
    log = (
        "Traceback (most recent call last):\n"
        '  File "train.py", line 9, in <module>\n'
        "    raise TypeError(f'bad batch {i}')\n"
        "TypeError: bad batch 41\n"
        "Traceback (most recent call last):\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "train.py FAILED"
    )
    assert exception_signature(log) == "TypeError: bad batch <n>"


def test_signature_is_bounded() -> None:
    sig = exception_signature("ValueError: " + "abc " * 1000)
    assert sig is not None and len(sig) <= 300


# --- class boundaries (issue #13) ---


def test_an_unrecognised_traceback_is_unknown_never_a_user_error() -> None:
    log = (
        "Traceback (most recent call last):\n"
        '  File "/opt/lib/site-packages/somelib/engine.py", line 41, in run\n'
        "somelib.errors.EngineStateError: engine entered state 7\n"
    )
    got = classify_failure(1, None, log)
    assert got.failure_class is F.UNKNOWN
    assert got.retryable


@pytest.mark.parametrize(
    "exc",
    [
        "KeyError: 'labels'",
        "TypeError: forward() missing 1 required positional argument: 'x'",
        "ValueError: too many values to unpack (expected 2)",
        "IndexError: list index out of range",
        "NameError: name 'modle' is not defined",
        "FileNotFoundError: [Errno 2] No such file or directory: 'data/train.json'",
        "ModuleNotFoundError: No module named 'wandb'",
        "AssertionError: batch size must divide the world size",
    ],
)
def test_ordinary_python_errors_from_the_users_frames_are_user_errors(exc: str) -> None:
    log = (
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/job/train.py", line 77, in <module>\n'
        f"[rank1]: {exc}\n"
        "E1201 10:00:00 torch/distributed/elastic/multiprocessing/api.py:869] failed "
        "(exitcode: 1) local_rank: 1 (pid: 4242) of binary: /usr/bin/python\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    )
    got = classify_failure(1, None, log)
    assert got.failure_class is F.USER_CODE_ERROR, got
    assert not got.retryable


def test_a_user_error_outranks_torchrun_sigterming_its_peers() -> None:
    log = (
        "Traceback (most recent call last):\n"
        "KeyError: 'input_ids'\n"
        "W1201 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 11 "
        "closing signal SIGTERM\n"
        "  traceback : Signal 15 (SIGTERM) received by PID 11"
    )
    assert classify_failure(1, None, log).failure_class is F.USER_CODE_ERROR


def test_an_exception_whose_message_names_a_cause_takes_that_cause() -> None:
    log = "ValueError: (InvalidArgument) TCP send error. Details: Broken pipe."
    assert classify_failure(1, None, log).failure_class is F.NODE_LOST


def test_a_cuda_oom_outranks_the_watchdog_timeouts_it_causes_on_the_peers() -> None:
    log = (
        "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "[rank0]:[E1201 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 "
        "milliseconds before timing out."
    )
    assert classify_failure(1, None, log).failure_class is F.CUDA_OOM


def test_runtime_error_cuda_out_of_memory_is_cuda_oom() -> None:
    got = classify_failure(1, None, "RuntimeError: CUDA error: out of memory")
    assert got.failure_class is F.CUDA_OOM


def test_a_flat_noisy_loss_is_not_a_spike() -> None:
    losses = [2.31, 2.28, 2.35, 2.22, 2.40, 2.19, 2.33, 2.26, 2.38, 2.21]
    log = "\n".join(f"step {i} loss: {v}" for i, v in enumerate(losses))
    assert classify_failure(None, None, log).failure_class is F.UNKNOWN


def test_a_falling_loss_is_not_a_spike() -> None:
    log = "\n".join(f"step {i} loss: {10 / (i + 1):.3f}" for i in range(12))
    assert classify_failure(None, None, log).failure_class is F.UNKNOWN


def test_a_single_moderate_bump_does_not_persist_and_is_not_a_spike() -> None:
    losses = [2.0, 2.0, 2.1, 2.0, 4.0, 2.0, 2.1, 2.0]
    log = "\n".join(f"step {i} loss: {v}" for i, v in enumerate(losses))
    assert classify_failure(None, None, log).failure_class is F.UNKNOWN


def test_a_nan_loss_is_nan_divergence_not_a_spike() -> None:
    log = "\n".join(f"step {i} loss: {v}" for i, v in enumerate([2.0, 2.1, 9.0, 12.0, "nan"]))
    assert classify_failure(None, None, log).failure_class is F.NAN_DIVERGENCE


def test_one_rank_far_slower_than_its_peers_is_a_slow_peer() -> None:
    log = "\n".join(f"rank {r} step time {t} s" for r, t in enumerate([1.02, 0.98, 3.9, 1.01]))
    got = classify_failure(None, None, log)
    assert got.failure_class is F.SLOW_PEER
    assert got.evidence == ("rank 2 step time 3.9 s",)


def test_ranks_within_noise_of_each_other_are_not_slow_peers() -> None:
    log = "\n".join(f"rank {r} step time {t} s" for r, t in enumerate([1.02, 0.98, 1.3, 1.01]))
    assert classify_failure(None, None, log).failure_class is F.UNKNOWN


def test_a_gpu_copy_that_arrives_as_zeros_is_silent_corruption() -> None:
    log = "tensor([1., 2.], device='cuda:0')\ntensor([0., 0.], device='cuda:1')"
    got = classify_failure(None, None, log)
    assert got.failure_class is F.SILENT_CORRUPTION
    assert got.evidence == ("tensor([0., 0.], device='cuda:1')",)


@pytest.mark.parametrize(
    "log",
    [
        "slurmstepd: error: *** JOB 4242 ON gpu-07 CANCELLED AT 2026-12-01T09:00:00 "
        "DUE TO TIME LIMIT ***",
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 17 got signal: 15",
        "Received SIGTERM. Terminating subprocesses.",
    ],
    ids=["slurm-time-limit", "signal-exception", "received-sigterm"],
)
def test_a_stop_from_outside_is_external_termination_not_node_lost(log: str) -> None:
    assert classify_failure(None, None, log).failure_class is F.EXTERNAL_TERMINATION


def test_a_user_error_on_one_rank_outranks_the_watchdog_timeouts_on_its_peers() -> None:
    log = (
        "[rank3]: Traceback (most recent call last):\n"
        "[rank3]: KeyError: 'attention_mask'\n"
        "[rank0]:[E1201 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, Timeout(ms)=600000) ran "
        "for 600000 milliseconds before timing out."
    )
    assert classify_failure(1, None, log).failure_class is F.USER_CODE_ERROR


def test_a_librarys_own_c_assert_is_unknown_not_a_user_error() -> None:
    log = (
        "python: ../nptl/pthread_mutex_lock.c:81: __pthread_mutex_lock: Assertion "
        "`mutex->__data.__owner == 0' failed.\nAborted (core dumped)"
    )
    assert classify_failure(134, None, log).failure_class is F.UNKNOWN


@pytest.mark.parametrize(
    ("line", "want"),
    [
        ("(RayWorkerWrapper pid=24271, ip=10.0.0.1) KeyError: 'pixel_values'", "KeyError"),
        ("worker-3: ValueError: bad shard 7", "ValueError"),
        ("[1,0]<stderr>:TypeError: unsupported operand", "TypeError"),
        ("ray.exceptions.RayTaskError(AttributeError): ray::Trainer.step()", "AttributeError"),
    ],
    ids=["ray-actor", "pdsh-host", "mpirun", "ray-task-error"],
)
def test_launcher_prefixes_do_not_hide_the_exception(line: str, want: str) -> None:
    sig = exception_signature(line)
    assert sig is not None and sig.startswith(want)
    assert classify_failure(1, None, line).failure_class is F.USER_CODE_ERROR


def test_a_launchers_called_process_error_is_not_the_users_exception() -> None:
    log = (
        "IndexError: index 7 is out of bounds for dimension 0 with size 4\n"
        "subprocess.CalledProcessError: Command '['python', '-u', 'train.py']' returned "
        "non-zero exit status 1."
    )
    assert exception_signature(log) == (
        "IndexError: index <n> is out of bounds for dimension <n> with size <n>"
    )


def test_a_loss_printed_as_a_tensor_or_camel_case_key_is_read() -> None:
    tensors = "\n".join(
        f"step {i} loss: tensor({v}, device='cuda:0', grad_fn=<NllLossBackward0>)"
        for i, v in enumerate([2.31, 2.30, 2.29, 6.10, 6.40])
    )
    assert classify_failure(None, None, tensors).failure_class is F.LOSS_SPIKE
    camel = "\n".join(f"train/CrossEntropyLoss={v}" for v in [2.31, 2.30, 2.29, 6.10, 6.40])
    assert classify_failure(None, None, camel).failure_class is F.LOSS_SPIKE


def test_a_loss_that_doubles_after_the_first_point_and_stays_is_a_spike() -> None:
    log = "{'loss': 3.03}\n{'loss': 14.41}\n{'loss': 15.25}"
    assert classify_failure(None, None, log).failure_class is F.LOSS_SPIKE


def test_a_per_rank_time_table_with_one_slow_row_is_a_slow_peer() -> None:
    log = (
        "rank   data_time   step_time\n"
        "  0      0.021      1.02\n"
        "  1      0.019      0.99\n"
        "  2      0.020      3.90\n"
        "  3      0.022      1.01"
    )
    got = classify_failure(None, None, log)
    assert got.failure_class is F.SLOW_PEER
    assert got.evidence == ("  2      0.020      3.90",)


def test_ddp_s_warning_that_every_healthy_run_prints_is_not_a_user_error():
    """Seen in the demo: a survivor of a killed node prints DDP's find_unused_parameters
    warning and then gloo's connection reset; the reset names the class."""
    warning = (
        "[rank2]:[W1201 09:33:17.706186386 reducer.cpp:1529] Warning: "
        "find_unused_parameters=True was specified in DDP constructor, but did not find any "
        "unused parameters in the forward pass. This flag results in an extra traversal of "
        "the autograd graph every iteration,  which can adversely affect performance."
    )
    reset = (
        "[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        "pair.cc:537] Read error [127.0.0.1]:46744: Connection reset by peer. This is "
        "typically caused by a remote worker hanging or bugs in the application."
    )
    assert classify_failure(1, None, f"{warning}\n{reset}").failure_class is F.NODE_LOST
    assert classify_failure(1, None, warning).failure_class is F.UNKNOWN


_GRAD_BLOCK = (
    "I put the values of final_layernorm.weight.main_grad below:\n"
    "TP rank 0 has value:\n"
    "tensor([2.9907e-03, -3.1120e-04,  9.9897e-05,  ...,  1.7762e-04, -7.4244e-04]\n"
    "TP rank 1:\n"
    "tensor([{first}, -3.1120e-04,  9.9897e-05,  ...,  1.7762e-04, -7.4244e-04]"
)


def test_a_replicated_gradient_that_differs_across_ranks_is_silent_corruption() -> None:
    # https://github.com/NVIDIA/Megatron-LM/issues/1446 (trimmed to two ranks)
    got = classify_failure(None, None, _GRAD_BLOCK.format(first="3.0289e-03"))
    assert got.failure_class is F.SILENT_CORRUPTION
    assert got.evidence == (
        "tensor([3.0289e-03, -3.1120e-04,  9.9897e-05,  ...,  1.7762e-04, -7.4244e-04]",
    )


def test_identical_replicas_are_not_silent_corruption() -> None:
    got = classify_failure(None, None, _GRAD_BLOCK.format(first="2.9907e-03"))
    assert got.failure_class is F.UNKNOWN


def test_per_rank_inputs_that_differ_are_not_silent_corruption() -> None:
    # Each rank's own batch differs by design: only replicated state must agree.
    log = "\n".join(f"rank {r}: tensor([{r}.5, 1.0, 2.0, 3.0])" for r in range(3))
    assert classify_failure(None, None, log).failure_class is F.UNKNOWN


def test_the_same_expression_disagreeing_on_gpu_and_cpu_is_silent_corruption() -> None:
    # https://github.com/pytorch/pytorch/issues/57919
    log = (
        "x = tensor([[1.]], device='cuda:0'), n(x) = tensor([[1.]], device='cuda:0')\n"
        "x = tensor([[1.]]), n(x) = tensor([[0.2164]])"
    )
    got = classify_failure(None, None, log)
    assert got.failure_class is F.SILENT_CORRUPTION
    assert got.evidence == (log.splitlines()[0],)


def test_gpu_and_cpu_agreeing_is_not_silent_corruption() -> None:
    log = "n(x) = tensor([[0.2164]], device='cuda:0')\nn(x) = tensor([[0.2164]])"
    assert classify_failure(None, None, log).failure_class is F.UNKNOWN


def test_a_timeout_while_forming_the_process_group_is_a_rendezvous_failure() -> None:
    # https://github.com/pytorch/gloo/issues/148
    log = (
        'File "/opt/lib/python3.6/site-packages/torch/distributed/distributed_c10d.py", '
        "line 283, in init_process_group\n"
        "_default_pg = ProcessGroupGloo(store, rank, world_size)\n"
        "RuntimeError: Wait timeout"
    )
    assert classify_failure(1, None, log).failure_class is F.RENDEZVOUS_FAILURE


def test_a_users_error_raised_while_forming_the_process_group_stays_a_user_error() -> None:
    log = (
        'File "/opt/lib/python3.10/site-packages/torch/distributed/rendezvous.py", '
        "line 246, in _env_rendezvous_handler\n"
        '    rank = int(_get_env_or_raise("RANK"))\n'
        "ValueError: Error initializing torch.distributed using env:// rendezvous: "
        "environment variable RANK expected, but not set"
    )
    assert classify_failure(1, None, log).failure_class is F.USER_CODE_ERROR


def test_a_store_that_cannot_resolve_master_addr_is_a_rendezvous_failure_not_a_user_error():
    # https://github.com/pytorch/examples/issues/540 (old c10d raises it as ValueError)
    log = (
        'File "/apps/pytorch/lib/python3.6/site-packages/torch/distributed/rendezvous.py", '
        "line 143, in _env_rendezvous_handler\n"
        "store = TCPStore(master_addr, master_port, world_size, start_daemon)\n"
        "ValueError: host not found: Name or service not known"
    )
    assert classify_failure(1, None, log).failure_class is F.RENDEZVOUS_FAILURE


def test_a_traceback_ending_in_the_stores_constructor_is_a_rendezvous_failure() -> None:
    # https://github.com/pytorch/pytorch/issues/118666 (the error line itself was lost
    # to two ranks writing at once)
    log = (
        '  File "/opt/conda/lib/python3.10/site-packages/torch/distributed/rendezvous.py", '
        "line 174, in _create_c10d_store\n"
        '  File "/opt/conda/lib/python3.10/site-packages/deepspeed/comm/torch.py", '
        "line 120, in __init__\n"
        "    return TCPStore("
    )
    assert classify_failure(1, None, log).failure_class is F.RENDEZVOUS_FAILURE


def test_nccls_own_socket_call_is_nccl_transport_not_a_store() -> None:
    # https://github.com/modelscope/ms-swift/issues/8043: "Connection refused" alone is
    # the c10d store's word (rendezvous_failure); NCCL's socketPollConnect names NCCL.
    line = "socketPollConnect: connect to 169.254.20.10<52597> returned Connection refused"
    assert classify_failure(1, None, line).failure_class is F.NCCL_TRANSPORT


# The frames of a DataLoader's local IPC (https://github.com/pytorch/pytorch/issues/9127,
# https://github.com/open-mmlab/mmdetection/issues/234).
_RESOURCE_SHARER = (
    '  File "/usr/lib/python3.6/multiprocessing/resource_sharer.py", line 87, in get_connection\n'
    "    c = Client(address, authkey=process.current_process().authkey)\n"
    '  File "/usr/lib/python3.6/multiprocessing/connection.py", line 614, in SocketClient\n'
    "    s.connect(address)\n"
)


@pytest.mark.parametrize(
    "error",
    [
        "ConnectionRefusedError: [Errno 111] Connection refused",
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        "BrokenPipeError: [Errno 32] Broken pipe",
    ],
    ids=["refused", "reset", "broken-pipe"],
)
def test_a_socket_error_between_a_process_and_its_dataloader_workers_names_no_peer(
    error: str,
) -> None:
    # Between processes of one host: no store failed to form and no node was lost, so
    # the bare socket words give way to unknown (retried within limits).
    c = classify_failure(1, None, _RESOURCE_SHARER + error)
    assert c.failure_class is F.UNKNOWN
    # The same words with no such frames still say what they said.
    assert classify_failure(1, None, error).failure_class in (
        F.RENDEZVOUS_FAILURE,
        F.NODE_LOST,
    )


def test_a_named_cause_beside_dataloader_ipc_frames_still_speaks() -> None:
    log = _RESOURCE_SHARER + "RuntimeError: DataLoader worker (pid 42) is killed by signal: Killed"
    assert classify_failure(1, None, log).failure_class is F.HOST_OOM_KILLED


@pytest.mark.parametrize(
    "line",
    [
        # https://github.com/HiFiLES/HiFiLES-solver/issues/135
        "mpirun noticed that process rank 2 with PID 31203 on node subbaiah10 exited on "
        "signal 11 (Segmentation fault).",
        # https://github.com/pmodels/mpich/issues/6563
        "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Segmentation fault: 11 (signal 11)",
        # https://github.com/deepspeedai/DeepSpeedExamples/issues/626
        "[ERROR] [launch.py:324:sigkill_handler] ['python3.10', '-u', 'trainCLM.py', "
        "'--local_rank=1'] exits with return code = -11",
        # https://github.com/Lightning-AI/pytorch-lightning/issues/2124
        "Exception: process 3 terminated with signal SIGSEGV",
    ],
    ids=["mpirun", "hydra", "deepspeed", "mp-spawn"],
)
def test_a_launchers_report_of_a_segfault_names_no_cause(line: str) -> None:
    # Not a lost node (mpirun names the node it ran on), not the OOM killer (-11 is
    # not -9): the launchers' words for SIGSEGV stay unknown.
    assert classify_failure(1, None, line).failure_class is F.UNKNOWN


@pytest.mark.parametrize(
    "line",
    [
        # https://github.com/yangjianxin1/Firefly/issues/154 (the deepspeed launcher)
        "error: unrecognized arguments: --local_rank=0",
        # https://github.com/XPixelGroup/BasicSR/issues/626 (PyTorch 2.0's launcher)
        "train.py: error: unrecognized arguments: --local-rank=0",
    ],
    ids=["local_rank", "local-rank"],
)
def test_argparse_refusing_the_launchers_local_rank_is_a_user_error(line: str) -> None:
    assert classify_failure(2, None, line).failure_class is F.USER_CODE_ERROR


@pytest.mark.parametrize(
    ("log", "want"),
    [
        # https://github.com/THUDM/SwissArmyTransformer/issues/161
        (
            "Skipping backward and optimizer step for nan or inf in forwarding metrics/loss!",
            F.NAN_DIVERGENCE,
        ),
        # https://github.com/googlecodelabs/feedback (GCP quota refusal)
        (
            "MemAllocPerProjectRegion requested: 85899345920 allowed: 42949672960",
            F.CAPACITY_UNAVAILABLE,
        ),
    ],
    ids=["skipping-for-nan-or-inf", "quota-requested-allowed"],
)
def test_library_wordings_name_their_class(log: str, want: FailureClass) -> None:
    assert classify_failure(None, None, log).failure_class is want


# --- benign start-up and shutdown lines (issue 27) ---------------------------------------
# Lines healthy ranks print, quoted from real logs: the ones marked "here" were printed
# by training/examples/minimal.py under torchrun (2 ranks, SIGTERMed) on this machine.
# None of them names a cause; a rank the agent's own SIGTERM stopped, whatever of these
# its tail holds, is an external termination, never a rendezvous failure.
BENIGN_LINES: list[tuple[str, str]] = [
    # https://github.com/pytorch/pytorch/issues/159007 (no reverse DNS, as on a netns host)
    (
        "c10d-hostname-err-3",
        "[W724 18:22:38.909218572 socket.cpp:200] [c10d] The hostname of the client "
        "socket cannot be retrieved. err=-3",
    ),
    # https://github.com/pytorch/pytorch/issues/73656 (IPv6 first, then IPv4)
    (
        "c10d-client-ipv6-errno-97",
        "[W508 19:42:29.081090059 socket.cpp:759] [c10d] The client socket cannot be "
        "initialized to connect to [jwb0129i.juwels]:21068 (errno: 97 - Address family "
        "not supported by protocol).",
    ),
    # https://github.com/microsoft/vidur/issues/49
    (
        "c10d-server-ipv6-errno-97",
        "[W socket.cpp:464] [c10d] The server socket cannot be initialized on [::]:50704 "
        "(errno: 97 - Address family not supported by protocol).",
    ),
    # https://github.com/meta-pytorch/monarch/pull/1571
    (
        "c10d-ipv6-addresses",
        "[W1008 23:40:22.781961348 socket.cpp:767] [c10d] The IPv6 network addresses of "
        "(job-01k72wn5f8waqw7d81mfggagn4.internal, 50745) cannot be retrieved (gai error: "
        "-2 - Name or service not known).",
    ),
    # https://github.com/pytorch/pytorch/issues/159007 (torchrun's banner)
    (
        "torchrun-omp-banner",
        "W0724 18:22:28.488000 40628 site-packages/torch/distributed/run.py:766] Setting "
        "OMP_NUM_THREADS environment variable for each process to be 1 in default, to "
        "avoid your system being overloaded, please further tune the variable for "
        "optimal performance in your application as needed. ",
    ),
    (
        "torchrun-banner-stars",
        "W0724 18:22:28.488000 40628 site-packages/torch/distributed/run.py:766] "
        "*****************************************",
    ),
    # here
    (
        "torchrun-closing-signal",
        "W1201 21:02:37.578000 9492 .venv/lib/python3.11/site-packages/torch/distributed/"
        "elastic/multiprocessing/api.py:1028] Sending process 9576 closing signal SIGTERM",
    ),
    (
        "torchrun-death-signal-15",  # here
        "W1201 21:02:37.577000 9492 .venv/lib/python3.11/site-packages/torch/distributed/"
        "elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers",
    ),
    # https://github.com/pytorch/pytorch/issues/114097
    (
        "torchrun-death-signal-sigterm",
        "W0823 16:54:02.337000 139733055988160 torch/distributed/elastic/agent/server/"
        "api.py:688] Received Signals.SIGTERM death signal, shutting down workers",
    ),
    (
        "torchrun-signal-exception",  # here
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 9492 got "
        "signal: 15",
    ),
    ("training-stop-saved", "rank 1: stop requested; saved step 486"),  # here
    # https://github.com/pytorch/pytorch/issues/126275
    (
        "pg-not-destroyed",
        "[rank0]:[W515 07:06:42.829549331 ProcessGroupNCCL.cpp:1117] WARNING: process "
        "group has NOT been destroyed before it is being destructed. On normal program "
        "exit, the application should call destroy_process_group to ensure that any "
        "pending NCCL data transfers have finished in this process.",
    ),
    # https://github.com/anhvth/opensloth/issues/17
    (
        "pg-destroy-not-called",
        "[rank0]:[W730 15:32:17.841273251 ProcessGroupNCCL.cpp:1479] Warning: WARNING: "
        "destroy_process_group() was not called before program exit, which can leak "
        "resources. For more info, please see "
        "https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())",
    ),
]

#: torchrun's own shutdown lines say how the rank was stopped: from outside.
_SAY_HOW_IT_STOPPED = {
    "torchrun-death-signal-15",
    "torchrun-death-signal-sigterm",
    "torchrun-signal-exception",
}


@pytest.mark.parametrize(("line_id", "line"), BENIGN_LINES, ids=[i for i, _ in BENIGN_LINES])
def test_a_rank_our_sigterm_stopped_is_never_a_rendezvous_failure(line_id: str, line: str) -> None:
    got = classify_failure(None, "SIGTERM", line)
    assert got.failure_class is F.EXTERNAL_TERMINATION, got


@pytest.mark.parametrize(("line_id", "line"), BENIGN_LINES, ids=[i for i, _ in BENIGN_LINES])
def test_a_benign_line_names_no_cause_on_its_own(line_id: str, line: str) -> None:
    got = classify_failure(None, None, line)
    want = F.EXTERNAL_TERMINATION if line_id in _SAY_HOW_IT_STOPPED else F.UNKNOWN
    assert got.failure_class is want, got


def test_the_whole_tail_of_a_stopped_rank_is_an_external_termination() -> None:
    tail = "\n".join(line for _, line in BENIGN_LINES)
    got = classify_failure(None, 15, tail)
    assert got.failure_class is F.EXTERNAL_TERMINATION, got
    assert not any("hostname" in e or "errno: 97" in e for e in got.evidence)


@pytest.mark.parametrize(
    ("cause", "want"),
    [
        (
            "[E socket.cpp:610] [c10d] The client socket has failed to connect to any "
            "network address of (192.168.1.99, 1234).",
            F.RENDEZVOUS_FAILURE,
        ),
        (
            "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
            F.RENDEZVOUS_FAILURE,
        ),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", F.CUDA_OOM),
    ],
    ids=["c10d-connect-failed", "rdzv-timeout", "cuda-oom"],
)
def test_benign_lines_do_not_hide_a_real_cause(cause: str, want: FailureClass) -> None:
    startup = [line for i, line in BENIGN_LINES if i not in _SAY_HOW_IT_STOPPED]
    got = classify_failure(1, None, "\n".join([*startup, cause]))
    assert got.failure_class is want, got
