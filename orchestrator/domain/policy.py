"""Recovery policy: which action each failure class gets, as data.

``decide()`` looks up :data:`POLICY` for the incident's class (``remedy.remedy_for``);
whether the job may go on at all is ``remedy.refuse_to_continue``'s, because those
rules need history: the same user code error ``restarts.max_same_user_error`` times
(2 by default) means retrying is wasted money, so the job fails fast.

Each action with an example event sequence (``R`` = attempt):

``replace_node_block_region``
    preemption_notice, node_lost, external_termination (an outside SIGTERM: the host
    is likely going away too, but the region is not blamed). ``R1 (spot notice in
    us-east-1) -> emergency save committed -> R2 launched in us-west-2 (us-east-1
    ranked lower for a while) -> ok``.
``restart_in_place``
    nccl_timeout, nccl_transport, rendezvous_failure, unknown. The hardware is fine; a
    fresh rendezvous usually is too. ``R1 (ncclRemoteError, IB flap) -> R2 same nodes,
    new rendezvous id, from the last checkpoint -> ok``.
``rollback_last_good``
    nan_divergence, loss_spike, silent_corruption. The newest checkpoint may already hold the bad
    state, so resume from the last one saved before the anomaly. ``R1 (loss NaN at step
    4120) -> R2 from step 4000 (saved before the spike) -> ok``.
``replan_memory``
    cuda_oom, host_oom_killed. Same nodes, the memory planner turns on activation
    checkpointing or a smaller micro-batch with more accumulation (global batch kept).
    ``R1 (CUDA OOM, micro-batch 8) -> R2 (micro-batch 4, grad-accum x2) -> ok``.
``drain_node``
    gpu_hardware, health_check_failed, slow_peer. The node's host is excluded from
    every later placement of the job; the region is not blamed. ``R1 (Xid 79 on node
    3) -> node 3 drained -> R2 with a replacement node -> ok``.
``retry_from_checkpoint``
    checkpoint_io. Fall back to the previous complete checkpoint (we keep two) and
    retry. ``R1 (PytorchStreamReader failed) -> R2 from the previous COMMIT -> ok``.
``wait_retry_elsewhere``
    capacity_unavailable. Back off and try the next region/cloud in the plan.
    ``R1 (InsufficientInstanceCapacity us-east-1) -> wait -> R2 in us-east-2 -> ok``.
``restart_then_fail_fast``
    user_code_error. One retry (the error may come from a flaky input), then stop:
    ``R1 (KeyError 'input_ids') -> R2 (KeyError 'input_ids') -> FAILED``.
``fail_fast``
    what ``restart_then_fail_fast`` becomes on the second identical user error.
"""

from __future__ import annotations

from enum import StrEnum

from orchestrator.domain.failures import FailureClass


class RecoveryAction(StrEnum):
    REPLACE_NODE_BLOCK_REGION = "replace_node_block_region"  # new node elsewhere
    RESTART_IN_PLACE = "restart_in_place"  # same nodes, fresh rendezvous
    ROLLBACK_LAST_GOOD = "rollback_last_good"  # resume from before the anomaly
    REPLAN_MEMORY = "replan_memory"  # activation checkpointing / smaller micro-batch
    DRAIN_NODE = "drain_node"  # remove the node from the pool, replace it
    RETRY_FROM_CHECKPOINT = "retry_from_checkpoint"  # previous complete checkpoint
    WAIT_RETRY_ELSEWHERE = "wait_retry_elsewhere"  # back off, next region/cloud
    RESTART_THEN_FAIL_FAST = "restart_then_fail_fast"  # one retry for user errors
    FAIL_FAST = "fail_fast"  # stop the job; retrying cannot help
    GROW_BACK = "grow_back"  # an elastic run returns to full size onto its replacement


_F = FailureClass
_A = RecoveryAction

POLICY: dict[FailureClass, RecoveryAction] = {
    _F.PREEMPTION_NOTICE: _A.REPLACE_NODE_BLOCK_REGION,
    _F.EXTERNAL_TERMINATION: _A.REPLACE_NODE_BLOCK_REGION,
    _F.NODE_LOST: _A.REPLACE_NODE_BLOCK_REGION,
    _F.NCCL_TIMEOUT: _A.RESTART_IN_PLACE,
    _F.NCCL_TRANSPORT: _A.RESTART_IN_PLACE,
    _F.RENDEZVOUS_FAILURE: _A.RESTART_IN_PLACE,
    _F.SLOW_PEER: _A.DRAIN_NODE,
    _F.CUDA_OOM: _A.REPLAN_MEMORY,
    _F.HOST_OOM_KILLED: _A.REPLAN_MEMORY,
    _F.GPU_HARDWARE: _A.DRAIN_NODE,
    _F.NAN_DIVERGENCE: _A.ROLLBACK_LAST_GOOD,
    _F.LOSS_SPIKE: _A.ROLLBACK_LAST_GOOD,
    _F.SILENT_CORRUPTION: _A.ROLLBACK_LAST_GOOD,
    _F.CHECKPOINT_IO: _A.RETRY_FROM_CHECKPOINT,
    _F.HEALTH_CHECK_FAILED: _A.DRAIN_NODE,
    _F.CAPACITY_UNAVAILABLE: _A.WAIT_RETRY_ELSEWHERE,
    _F.USER_CODE_ERROR: _A.RESTART_THEN_FAIL_FAST,
    _F.UNKNOWN: _A.RESTART_IN_PLACE,
    _F.ELASTIC_GROW: _A.GROW_BACK,
}

#: Classes whose failures count against the region (the cloud took the node back).
#: Hardware faults blame the node, not the region.
BLAMES_REGION: frozenset[FailureClass] = frozenset({_F.PREEMPTION_NOTICE, _F.NODE_LOST})
