"""Failure taxonomy and a pure classifier.

Every failure the service sees becomes one :class:`FailureClass`, because each class
has its own recovery (see :mod:`orchestrator.domain.policy`): one response for every
failure either pays too much for rare events or has no path for common ones.

The classifier weighs evidence in this order, strongest first:

1. a cloud preemption notice (the root cause; NCCL timeouts on survivors follow it);
2. an exit code from :class:`orchestrator.contract.ExitCode` (a rank said why it stopped);
3. the agent's report (missed heartbeats, health checks, stragglers, launch errors);
4. the tail of each rank's log: rules written from the libraries' own messages
   (PyTorch, NCCL, gloo, CUDA, torchrun, SLURM, Kubernetes, the clouds...), the last
   Python exception (an ordinary error type is the user's bug), the innermost frame
   (checkpoint code), and the numbers (a loss spike, a slow peer, a zeroed copy). When
   several classes match, the one with the highest confidence wins: root causes (GPU
   hardware, OOM) are scored above their collateral symptoms (NCCL watchdog timeouts on
   the *other* ranks, torchrun's teardown), so a hung collective after an OOM is an OOM.
5. the signal alone (a bare SIGKILL is most often the kernel OOM killer; a SIGTERM
   without a notice is a stop from outside);
6. where all of that ends at ``unknown``, a learned fallback (a logistic regression
   over the tail's normalised words, trained on the corpus's development part by
   scripts/train_classifier.py, weights in :mod:`orchestrator.domain.failure_model`)
   may name the class when it is sure; it never says ``user_code_error`` nor a class
   whose cause is a fact about numbers, and its evidence names it.

Nothing recognisable is ``unknown`` (retried within limits), never ``user_code_error``.
Measured on real excerpts by ``bench/classify.py`` (docs/failures.md). Pure: no I/O.
The caller reads logs and passes text in.
"""

from __future__ import annotations

import itertools
import math
import re
import signal as _signal
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from orchestrator.contract import ExitCode
from orchestrator.domain import failure_model as _fm


class FailureClass(StrEnum):
    PREEMPTION_NOTICE = "preemption_notice"  # the cloud announced a reclaim
    # SIGTERM/SIGINT from outside (torchrun "Received 15 death signal", a SLURM cancel):
    # someone stopped the job; preemption-like, the node itself is not known to be gone.
    EXTERNAL_TERMINATION = "external_termination"
    NODE_LOST = "node_lost"  # a node vanished: heartbeats stopped, host unreachable
    NCCL_TIMEOUT = "nccl_timeout"  # a collective hung past the watchdog timeout
    NCCL_TRANSPORT = "nccl_transport"  # IB/socket errors inside NCCL (often transient)
    RENDEZVOUS_FAILURE = "rendezvous_failure"  # torchrun/c10d could not form the group
    SLOW_PEER = "slow_peer"  # a straggler holds every rank back
    CUDA_OOM = "cuda_oom"  # the GPU allocator ran out of device memory
    HOST_OOM_KILLED = "host_oom_killed"  # the kernel OOM killer SIGKILLed a rank
    GPU_HARDWARE = "gpu_hardware"  # ECC, Xid, fallen off the bus
    NAN_DIVERGENCE = "nan_divergence"  # loss or gradients went NaN/Inf
    LOSS_SPIKE = "loss_spike"  # the loss jumped far above its trend and stayed, not NaN
    SILENT_CORRUPTION = "silent_corruption"  # results drifted without any error
    CHECKPOINT_IO = "checkpoint_io"  # save/load failed or loaded state is unusable
    HEALTH_CHECK_FAILED = "health_check_failed"  # pre-flight / periodic node check failed
    CAPACITY_UNAVAILABLE = "capacity_unavailable"  # the cloud had no instances to give
    USER_CODE_ERROR = "user_code_error"  # a Python exception in the user's script
    UNKNOWN = "unknown"  # nothing recognisable; restart limits bound the retries
    # No failure: an elastic run's planned return to full size once its replacement is
    # up (``EventKind.GROW``). It opens an incident so that the reshape runs the same
    # protocol (save at the step boundary, confirm, restart, validate) and its pause is
    # measured like any other.
    ELASTIC_GROW = "elastic_grow"


_F = FailureClass

#: Whether another attempt can succeed. Only a bug in the user's code cannot be fixed by
#: retrying (the policy still fails fast after repeats of other classes via limits).
RETRYABLE: dict[FailureClass, bool] = {c: c is not _F.USER_CODE_ERROR for c in FailureClass}

#: Classes no log or report is classified as: the reconciler's own planned reshapes.
PLANNED: frozenset[FailureClass] = frozenset({_F.ELASTIC_GROW})
#: What the classifier can answer (every class but the planned ones).
CLASSIFIABLE: tuple[FailureClass, ...] = tuple(c for c in FailureClass if c not in PLANNED)


@dataclass(frozen=True)
class Classification:
    failure_class: FailureClass
    retryable: bool
    confidence: float
    """0..1: how sure the classifier is; below ~0.5 treat the class as a guess."""
    evidence: tuple[str, ...]
    """The input lines (or synthetic facts such as ``exit code 76``) the class rests on."""
    decided_by: str | None = None
    """The one line (or fact) that decided the class: the line the strongest rule of
    the winning class matched, the exit code, the notice, the agent's event. Always
    set above :data:`NAMES_ITS_LINE_ABOVE` confidence, so a confident verdict that an
    operator acts on (a host drained, a job failed fast) shows what it rests on."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"confidence must be within 0..1, got {self.confidence}")
        if self.confidence > NAMES_ITS_LINE_ABOVE and not self.decided_by:
            raise ValueError(
                f"a {self.failure_class} at {self.confidence} must name its deciding line"
            )

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "class": str(self.failure_class),
            "retryable": self.retryable,
            "confidence": round(self.confidence, 3),
            "evidence": list(self.evidence),
            "decided_by": self.decided_by,
        }


#: Above this confidence a classification names its deciding line.
NAMES_ITS_LINE_ABOVE = 0.9


@dataclass(frozen=True)
class _Rule:
    failure_class: FailureClass
    pattern: re.Pattern[str]
    confidence: float
    text: str
    """The pattern as written, before :func:`bounded` wraps it."""
    quick: re.Pattern[str]
    """``text`` compiled as it is: it matches wherever ``pattern`` does, and is tried
    first (a pattern that starts with a lookaround is searched ~10x slower)."""

    def matches(self, line: str) -> bool:
        return self.quick.search(line) is not None and self.pattern.search(line) is not None


#: Not inside a word: no letter or digit on both sides of this position. Every rule is
#: wrapped in it at both ends, so a pattern matches whole words only where its own edge
#: is a letter or digit ("AER" is not found inside "cudaError", "Xid" not inside
#: "Xidle"), and a pattern whose edge is punctuation ("[rank0]", "/dev/shm") is not
#: constrained at all. The underscore separates words here: the parts of a snake_case
#: or SCREAMING_CASE name are words of their own ("ECC_UNCORRECTABLE" inside
#: "CUDA_ERROR_ECC_UNCORRECTABLE", "loss" inside "val_loss"). A rule that means to
#: accept a longer word says so itself (``checkpoint\w*``). The claim is tested rule by
#: rule (tests/failures/test_rule_edges.py).
WORD_EDGE = r"(?:(?<![A-Za-z0-9])|(?![A-Za-z0-9]))"


#: A word at a rule's end may be plural ("NVLink ... errors", "timeouts").
_PLURAL = r"(?:(?<=[A-Za-z])e?s)?"


def bounded(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled case-insensitively, matching at word edges only (the word
    at its end may take a plural ``s``)."""
    return re.compile(f"{WORD_EDGE}(?:{pattern}){_PLURAL}{WORD_EDGE}", re.IGNORECASE)


def _r(cls: FailureClass, confidence: float, *patterns: str) -> list[_Rule]:
    return [_Rule(cls, bounded(p), confidence, p, re.compile(p, re.IGNORECASE)) for p in patterns]


# Scores: root causes > their symptoms. A CUDA OOM or Xid on one rank leaves every
# other rank in a hung collective, and torchrun then SIGTERMs the rank's peers, so
# OOM/hardware outrank the watchdog timeout, which outranks the teardown lines. A
# user's exception (scored in :func:`_exception_hit`) sits between the two: above the
# collateral timeouts and teardown, below the named resource and hardware causes.
_RULES: tuple[_Rule, ...] = tuple(
    _r(
        _F.GPU_HARDWARE,
        0.97,
        r"uncorrectable ECC error",
        # The Xid code right after "Xid" or "Xid (PCI:...):", never a pid further on.
        # These are the memory/bus/NVLink codes NVIDIA says need a reset or RMA.
        r"\bXid\b(?:\s*\([^)]*\))?:?\s*(48|61|62|63|64|74|79|92|94|95|119|120|140)\b",
        r"fallen off the bus",
        r"cudaErrorECCUncorrectable|ECC_UNCORRECTABLE|ecc errors? (detected|encountered)",
        r"GPU is lost",
        r"NVLink.*(fatal|error)",
        r"RmInitAdapter failed",
        r"Unable to determine the device handle for GPU\w*",
        r"GPU requires reset|GPU reset required",
        r"(pcieport|AER).*(error|Timeout)",
        r"PCIe Bus Error",
        r"Row ?remap(ping)? (failure|pending)",
        r"(double|single)[- ]bit ECC",
        r"cudaErrorHardwareStackError|hardware stack error",
    )
    + _r(
        _F.GPU_HARDWARE,
        0.75,
        r"an illegal memory access was encountered|CUDA_ERROR_ILLEGAL_ADDRESS",
        r"unspecified launch failure|cudaErrorLaunchFailure",
        r"\bXid\b",
        r"NVRM: .*(error|failed)",
        r"an illegal instruction was encountered",
        r"\bERR!",
    )
    + _r(_F.GPU_HARDWARE, 0.6, r"unhandled cuda error", r"ncclUnhandledCudaError")
    # An index out of range inside a kernel: the user's bug, not the GPU's.
    + _r(
        _F.USER_CODE_ERROR,
        0.86,
        r"device-side assert(ion)? triggered",
        # CUDA kernels' asserts (an index out of range); a library's own C/C++ assert
        # names no cause of the user's and stays unknown.
        r"(\.cu:\d+|block: \[).*Assertion `.*` failed",
        r"index out of (range|bounds)|out of bounds for (dimension|axis)",
        r"mat1 and mat2 shapes cannot be multiplied",
        r"Expected all tensors to be on the same device",
        r"(Missing|Unexpected) key\(s\) in state_dict",
        r"size mismatch for \S+: copying a param",
        r"The size of tensor a \(\d+\) must match",
        r"Sizes of tensors must match",
        r"shape '\[.*\]' is invalid for input of size",
        r"Given groups=\d+, weight of size",
        r"Expected (input|target) batch_size",
        r"expected scalar type \w+ but found",
        r"(Input|input) type \(.*\) and weight type \(.*\) should be the same",
        r"does not require grad and does not have a grad_fn",
        r"Trying to backward through the graph a second time",
        r"modified by an inplace operation",
        r"Can't call numpy\(\) on Tensor that requires grad",
        r"Expected .* to have \d+ channels, but got \d+ channels",
        r"got an unexpected keyword argument",
        r"object has no attribute",
        r"No module named",
        r"is not defined\b",
        r"Expected object of scalar type",
        r"Boolean value of Tensor with more than one value is ambiguous",
        r"only one element tensors can be converted",
        r"grad can be implicitly created only for scalar outputs",
        r"stack expects each tensor to be equal size",
        r"can't be cast to the desired output type",
        r"Found dtype \w+ but expected \w+",
        r"received an invalid combination of arguments",
        r"Default process group has not been initialized",
        r"Expected to have finished reduction in the prior iteration",
        r"Expected to mark a variable ready only once",
        r"Attempting to deserialize object on a CUDA device",
        r"Calculated output size: .* Output size is too small",
        r"Expected \d+-dimensional input for \d+-dimensional weight",
        r"must have \d+ dimensions?, (but )?got \d+",
        r"The expanded size of the tensor",
        r"view size is not compatible with input tensor's size and stride",
        r"CUDA error: invalid device ordinal",
        r"(are|is) not (at|on) the (same|expected) device",
        r"to have (one of the following )?scalar types?",
        r"Tensors must have same number of dimensions",
        r"number of dims don't match",
        r"target tensor expected|multi-target not supported",
        r"returned an invalid gradient",
        r"Trying to resize storage that is not resizable",
        r"each element in list of batch should be of equal size",
        r"a leaf Variable that requires grad is being used in an in-place operation",
        # DDP's error names the keyword; its warning ("find_unused_parameters=True was
        # specified in DDP constructor, but did not find any unused parameters") is
        # printed by every healthy run that sets it, and is no error at all.
        r"parameters that were not used in producing the loss",
        r"keyword argument `?find_unused_parameters=True",
        r"must have the same dtype",
        r"not implemented for '\w+'",
        r"Placeholder storage has not been allocated on MPS device",
        # argparse's own exit (status 2), as when a launcher passes --local_rank to a
        # script that does not declare it (DeepSpeed, torch.distributed.launch).
        r"error: (unrecognized arguments|the following arguments are required|"
        r"argument -{1,2}[\w-]+: (invalid|expected|ambiguous))",
    )
    # Lines every run prints, failing or not: they speak for no class, and are not
    # left to weaker rules (torchrun SIGTERMs a failed rank's peers itself). Among
    # them the start-up and shutdown warnings of healthy ranks, the ones the agent's
    # own SIGTERM stopped included: read as a cause, c10d's reverse-lookup warning
    # called every such rank a rendezvous failure (issue 27). The list, with where
    # each line was seen, is tests/failures/test_classifier.py's BENIGN_LINES.
    + _r(
        _F.UNKNOWN,
        0.99,
        r"closing signal SIGTERM",
        # c10d's reverse lookup of its own socket's peer (no DNS, a netns host, a
        # container): a warning; the connection itself worked.
        r"\[c10d\] The hostname of the client socket cannot be retrieved",
        # c10d tries IPv6 first and falls back to IPv4: warnings, not the failure
        # ("failed to connect to any network address" is, and stays a rule).
        r"\[c10d\] The (client|server) socket cannot be initiali[sz]ed .*errno: 97\b",
        r"\[c10d\] The IPv6 network addresses of .* cannot be retrieved",
        # torchrun's start-up banner.
        r"Setting OMP_NUM_THREADS environment variable for each process",
        r"^\W*(W\d{4} [\d:.]+ \d+ \S+\] )?\*{10,}\s*$",
        # ProcessGroupNCCL's exit warnings (PyTorch 2.4+): every rank stopped before
        # destroy_process_group prints them, a SIGTERMed one too.
        r"process group has NOT been destroyed before",
        r"destroy_process_group\(\) was not called before program exit",
        r"No stragglers? detected",
        r"Straggler Report at|straggler detect(ion|or) (is )?(enabled|initiali[sz]ed|started)",
        r"number of nan iterations:\s*0\b",
        r"find_unused_parameters=True was specified in DDP constructor",
    )
    + _r(
        _F.PREEMPTION_NOTICE,
        0.9,
        r"spot[ _-]?(instance[ _-]?)?(interruption|termination|interrupted)",
        r"instance-terminated-(no-capacity|capacity-oversubscribed|by-price|by-service)",
        r"Host EC2 Terminated",
        r"INTERRUPTED_BY_NO_CAPACITY",
        r"instance-action.*(terminate|stop|hibernate)",
        r'"EventType"\s*:\s*"Preempt"',
        r"\bPreempt (Scheduled|event)",
        r"compute\.instances\.preempted",
        r"\b(was|were|been|got|is|being) pre-?empted\b",
        r"\bpre-?emption (notice|warning|signal|event|detected)",
        r"PreemptionError|PREEMPTED\b",
        r"termination is imminent",
        r"\b(termination|interruption|reclaim) (notice|warning|event)",
        r"\breclaim(ed|ing)?\b.{0,40}\b(instance|node|vm|spot|capacity)|"
        r"\b(instance|node|vm|spot)\b.{0,40}\breclaim(ed|ing)?\b",
        r"(is going to|will) be (interrupted|preempted|reclaimed)",
        r"\bpreempted\b.*(instance|node|vm|cluster|tpu|spot)",
        r"(instance|node|vm|cluster|tpu|spot)\b.*\bpreempted\b",
        r"Terminating unhealthy (spot )?cluster",
        r"=== Recovering\.\.\. ===",
        # Google Pipelines API (Cromwell on GCP): 10 and 14 are the preempted-VM codes.
        r"PAPI error code (10|14)\b",
        # "jobs that fail due to Spot VM preemption": the cloud's reclaim of a spot VM,
        # named as a noun. Never the bare "preemption" (a Slurm job's "DUE TO
        # PREEMPTION" is the scheduler's stop, external_termination).
        r"(spot|preemptible) (vm|instance|node|tpu)s? pre-?emption",
        r"\bVM \S+ stopped unexpectedly",
    )
    # GCE stops a preempted VM with an ACPI power-button press.
    + _r(
        _F.PREEMPTION_NOTICE,
        0.7,
        r"Power key pressed",
        r"host ?maintenance|maintenance event|TERMINATE_ON_HOST_MAINTENANCE",
    )
    + _r(
        _F.HOST_OOM_KILLED,
        0.96,
        r"Out of memory: Kill(ed)? process",
        r"oom-kill(ed|er)?|oom_kill_process|invoked oom-killer",
        r"OOMKilled",
        r"Memory cgroup out of memory",
        r"(killed|kill) .*due to (memory pressure|the node running low on memory)",
        r"running low on memory",
        r"node was low on resource: memory",
        r"insufficient shared memory|out of shared memory|shared memory limit",
        r"Unexpected bus error encountered in worker",
        r"DataLoader worker \(pid \d+\) is killed by signal: (Killed|Bus error)",
        r"failed to extend /dev/shm|creating shared memory segment",
        r"DefaultCPUAllocator: (can't allocate memory|not enough memory)",
        r"OOM when allocating tensor .*device:CPU",
        r"unable to write to file </torch_",
        r"exceed(ed|ing)? (the )?memory limit|memory limit exceeded",
        r"Cannot allocate memory|\bENOMEM\b",
        r"Killed process \d+ \(.*\) total-vm",
        r"oom_reaper: reaped process",
        r"exceeded (job |step )?memory limit",
        r"running beyond (physical|virtual) memory limits",
        r"unable to (open|allocate) shared memory|shared memory \(shm\)",
        r"std::bad_alloc",
        r"^(?:\[rank\d+\]:\s*)?MemoryError\b",
        r"Unable to allocate [\d.]+ [KMGT]i?B for an array",
    )
    + _r(
        _F.HOST_OOM_KILLED,
        0.6,
        r"exitcode\s*:\s*-9\b",
        # Launchers' own words for a rank that died by SIGKILL (issue 23): mpirun,
        # MPICH's hydra, DeepSpeed's launcher, torch.multiprocessing.spawn (Lightning's
        # ddp_spawn and TPU launchers), horovodrun. A bare SIGKILL is most often the
        # kernel's OOM killer; weak, like the signal itself.
        r"exited on signal 9 \(Killed\)",
        r"^\W*EXIT CODE: 9\s*$|KILLED BY SIGNAL: 9\b",
        r"exits with return code = -(9|7)\b",
        r"process \d+ terminated with signal SIGKILL",
        r"exit with status code 137\b",
        r"Signal 9 \(SIGKILL\)",
        r"killed by signal: Killed",
        r"(?:^|[\s\]>|])\**Killed\**\s*$",
        r"exit(ed)? (with )?(exit )?(code|status)[:=]?\s*137\b",
        r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) exited unexpectedly",
        r"\bBus error\b",
    )
    + _r(
        _F.CUDA_OOM,
        0.95,
        r"CUDA out of memory",
        r"\btorch\.(cuda\.)?OutOfMemoryError",
        r"CUDA error: out of memory",
        r"CUBLAS_STATUS_ALLOC_FAILED",
        r"cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY",
        r"Cuda failure (2 )?'out of memory'",
        r"(HIP|XPU|MPS|NPU) (backend )?out of memory|hipErrorOutOfMemory",
        r"cuda failed with error 2 out of memory",
        r"Out of memory while trying to allocate",
        r"CUDNN_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
        r"cuMemAlloc\w*.*(failed|out of memory)|cudaMalloc.*(failed|out of memory)",
        r"No available memory for the cache blocks",
        r"failed to allocate .* from device|HIP_ERROR_OutOfMemory",
        r"OOM when allocating tensor .*device:GPU",
        r"RESOURCE_EXHAUSTED: Out of memory",
        r"out of memory.*(GPU|device|cuda)|(GPU|device|cuda).*out of memory",
    )
    + _r(_F.CUDA_OOM, 0.8, r"^(?:\[rank\d+\]:\s*)?OutOfMemoryError\b")
    + _r(
        _F.NAN_DIVERGENCE,
        0.92,
        r"loss is nan",
        r"loss is inf(inity)?",
        r"Loss became infinite or NaN",
        r"\bnan (loss|detected)",
        r"returned nan values",
        r"Minimum loss scale reached",
        r"loss scale already at minimum",
        r"found NaN in",
        r"NaN or Inf found in",
        # "Skipping backward and optimizer step for nan or inf in forwarding metrics/loss!"
        r"(skip\w*|found|detected|encountered|because of)\b.{0,40}\b(nan|inf)( or |/)(inf|nan)\b",
        r"(inf|nan) (values )?(in|or (inf|nan) (values )?in) (the )?grad",
        r"grad(ient)?[ _]norm\W{0,4}(is )?([\d.]+ \()?(nan|inf)\b",
        r"non-finite (loss|gradient)",
        r"(?:\b|_)loss\w*['\"\]]?\s*[:=]?\s*['\"]?(tensor\()?[-+]?(nan|inf)\b",
        r"FloatingPointError",
        r"is non-finite|non-finite values",
        r"number of nan iterations:\s*[1-9]",
        r"loss scale reached (the )?minimum",
        r"encountered (a )?nan",
        r"\b(NaN|Inf) (loss|gradient)s?\b",
        r"(loss|gradient)s? (is|are|was|were|became|becomes|become) (nan|inf(inite)?)",
        r"Detected (NaN|inf)",
        r"contains? (a |some )?(nan|inf)s?\b|\bhas (nan|inf)s?\b",
        r"(nan|inf) (values? )?(found|detected|encountered|appeared)",
        r"\bnan in (the )?(loss|gradients?|outputs?|weights|parameters|activations|logits)",
        r"\b(ppl|perplexity)\W{0,3}(nan|inf)\b",
        r"loss (value )?(is|was|became|becomes|=) (nan|inf(inity)?)\b",
    )
    + _r(
        _F.NAN_DIVERGENCE,
        0.5,
        # fp16 overflow: the gradients were Inf; scores low, these repeat in healthy runs.
        r"overflow detected, setting loss scale to: 0\.0\d*",
        r"OVERFLOW! Rank \d+ Skipping step",
        r"\b(isnan|isfinite)\(",
        r"Gradient overflow\.\s+Skipping step",
    )
    + _r(
        _F.LOSS_SPIKE,
        0.85,
        r"loss spikes?\b",
        r"spikes? in (the )?(training )?loss",
        r"loss (suddenly )?(jump|spike|explode)s?",
        r"loss (suddenly )?(jumped|spiked|exploded|shot up|blew up|increased sharply)",
        r"sudden (increase|jump|rise) (of|in) (the )?loss",
        # Reports in prose (issue 23, round 7): the loss and its verb a few words apart
        # ("the loss ... suddenly spiked to over 20", "Loss was decreasing but after 42k
        # iteration it got spiked", "loss starts exploding", "sudden jumps every few
        # epochs in the training loss"). A NaN or Inf named anywhere in the tail is
        # nan_divergence, scored above these.
        r"loss\b.{0,60}\b(suddenly |abruptly )?(spiked|shot up|blew up|explod(es|ed|ing))\b",
        r"(sudden|abrupt)\w* (jump|spike|rise|increase)s?\b.{0,40}\bloss",
    )
    # "The loss diverges", "it suddenly starts to diverge": the same rise, but runs that
    # end in NaN say it too, so it scores below every NaN rule and every named error.
    + _r(
        _F.LOSS_SPIKE,
        0.6,
        r"loss\b.{0,40}\bdiverg(e|es|ed|ing)\b",
        r"(suddenly|starts? to|started to|begins? to|began to) diverge\b",
    )
    + _r(
        _F.SILENT_CORRUPTION,
        0.9,
        r"silent (data )?corruption",
        r"\bSDC\b.*detected",
        r"reference forward (pass )?drift",
        r"checksum mismatch across",
        r"(parameters|weights) (differ|diverged) across",
        # nccl-tests' correctness check and torch.testing's report of wrong values.
        r"Out of bounds values\s*:\s*[1-9]\d*",
        # CLBlast's tester: the share of a case's elements that differ from the reference.
        r"Error rate (?!0+(?:\.0+)?%)[\d.]+%: m=\d+",
        r"Mismatched elements: [1-9]\d* /",
        r"Tensor-likes are not (close|equal)",
        r"(results?|outputs?|values?) (are |is )?(wrong|incorrect|corrupted)",
        r"(?-i:\bWRONG\b)",
        r"Results (do not match|mismatch)",
        r"Difference at \d+: .*, expected",
        r"CPU value .* GPU value",
        r"(GPU|CPU|device) (computes|gives|returns|produces) (a )?different",
        # Results that differ say so only where the copies that should agree are named
        # ("the result of the reduction on one of the nodes ... differs from the results
        # on all the other nodes", "outputs differ between CPU and GPU"): results that
        # differ from a paper or a previous release are no corruption of this run.
        r"(results?|outputs?|values?|reductions?)\b.{0,60}\b(differs?|different) "
        r"(from|between|across)\b.{0,40}\b(nodes?|ranks?|gpus?|cpus?|devices?|replicas?"
        r"|workers?|cuda|runs)",
        # An element-by-element check ("353th item is incorrect! (352.000000 !=
        # 704.000000)"), and nccl-tests' #wrong count told in words ("a lot of wrongs").
        r"(items?|elements?|entry|entries) (is|are) (incorrect|wrong)",
        # A kernel's output checked against the host or a reference ("the cuda kernel
        # results don't match cpu", "failing in CPU/GPU validation"). The check is
        # named, so a certificate's "verification failed" is no result of ours.
        r"(results?|outputs?)\b.{0,30}\b(do not|don't|doesn't|does not|did not|didn't) match\b"
        r".{0,30}\b(cpu|gpu|cuda|reference|expected|host|golden)",
        r"((cpu|gpu)(/(cpu|gpu))?|results?|outputs?|correctness) (validation|verification) "
        r"(error|fail\w*)",
        r"fail\w* (in |the )*((cpu|gpu)(/(cpu|gpu))?|results?|outputs?|correctness) "
        r"(validation|verification)",
        r"(a lot of|lots of|many|occasional) [`'\"]?#?wrongs?",
        r"parity.{0,20}fail\w*",
        r"\bSDC\b|data corruption|bit ?flips?\b",
        r"(wrong|incorrect|corrupt(ed)?|garbage|bogus) (outputs?|results?|values?|gradients?"
        r"|weights?|data|answers?|numbers?)",
        r"(outputs?|results?|values?|gradients?|weights?|parameters?|losses) (are|is|were|was) "
        r"(wrong|incorrect|corrupt(ed)?|inconsistent|mismatched)",
        r"(differ\w*|mismatch\w*|inconsisten\w*|diverge\w*) (between|across|among) (the )?"
        r"(ranks|gpus|devices|replicas|workers|nodes|runs)",
        r"not (bitwise )?(identical|equal|the same) (across|between|on) (ranks|gpus|devices)",
        r"Not equal to tolerance",
        r"checksum (mismatch|failed|error)",
        r"\bmiscompar\w*",
        r"non-?deterministic (results?|outputs?)",
        r"Arrays are not (almost )?equal",
        r"not allclose|allclose\(.*\)\s*(is |returns? |-> |= )?False",
        r"(greatest|max(imum)?)[ _](abs(olute)?|rel(ative)?)[ _]diff(erence)?",
    )
    + _r(
        _F.CHECKPOINT_IO,
        0.88,
        r"PytorchStreamReader failed",
        r"PytorchStreamWriter failed",
        r"CheckpointException",
        r"No space left on device",
        r"unexpected EOF, expected \d+ more bytes",
        r"failed finding central directory",
        r"checkpoint (is )?(partial|corrupt|invalid|incomplete)",
        r"resume mismatch",
        r"\(SlowDown\)",
        r"Disk quota exceeded",
        r"invalid load key",
        r"UnpicklingError",
        r"file might be corrupted",
        r"SafetensorError|HeaderTooLarge|MetadataIncompleteBuffer",
        r"Error while deserializing header",
        r"EOFError: Ran out of input",
        r"storage has wrong size",
        r"enforce fail at .*inline_container\.cc",
        r"Invalid magic number; corrupt file",
        r"truncated file|unexpected end of (file|data)",
        r"Stale file handle",
        r"CheckpointingException",
        r"(failed|error|unable) (to |while |when )?(sav|load|writ|read)(e|ing)? (the )?"
        r"checkpoint\w*",
        r"File .* cannot be opened",
        r"Unable to load weights from",
    )
    + _r(
        _F.CHECKPOINT_IO,
        0.7,
        r"Error\(s\) in loading state_dict",
    )
    + _r(_F.CHECKPOINT_IO, 0.8, r"\[Errno 5\] Input/output error")
    # torch's zip writer lost bytes on the way to the file (disk, RAM or a network FS).
    + _r(_F.CHECKPOINT_IO, 0.97, r"unexpected pos \d+ vs \d+")
    + _r(
        _F.NCCL_TIMEOUT,
        0.9,
        r"Watchdog caught collective operation timeout",
        r"ran for \d+ milliseconds before timing out",
        r"Timed out waiting \d+ms for (recv|send) operation",
        r"collective operation timeout",
        r"NCCL timeout",
        r"Heartbeat monitor timed out",
        r"failed to pass monitoredBarrier",
        r"Timeout at NCCL work",
        r"Application timeout caused pair closure",
        r"DistBackendError.*\btime(d)? ?out|\btime(d)? ?out.*DistBackendError",
        r"\bwatchdog\b.*\b(timeout|timed out|hang|stuck)",
        r"collective .*timed out",
    )
    + _r(
        _F.NCCL_TIMEOUT,
        0.6,
        r"NCCL communicator was aborted",
        r"ProcessGroup\w*\b.*\btimed out",
        # The work descriptor in any NCCL error line, a timeout or not.
        r"Timeout\(ms\)=\d+",
        r"barrier.*timed? ?out|timed out.*barrier",
        r"\b(hang|hung|hangs|hanging|stuck|deadlock(ed)?)\b.{0,60}\b(all_?reduce|all-reduce|"
        r"all_?gather|broadcast|barrier|collective|nccl|reduce_scatter)",
        r"\b(all_?reduce|all-reduce|all_?gather|broadcast|barrier|collective|nccl|"
        r"reduce_scatter)\b.{0,60}\b(hang|hung|hangs|hanging|stuck|deadlock(ed)?|timed out)",
        r"\bNCCL\b.*\btime(d)? ?out",
    )
    + _r(_F.NCCL_TIMEOUT, 0.8, r"ncclCommWatchdog")
    + _r(_F.NCCL_TIMEOUT, 0.5, r"Some NCCL operations have failed or timed out")
    + _r(
        _F.NCCL_TRANSPORT,
        0.9,
        r"NCCL WARN NET/IB",
        r"NET/IB\w* ?: Got completion from peer",
        r"ncclRemoteError",
        r"remote process exited or there was a network error",
        r"ncclSystemError",
        r"NCCL WARN (Net|socket\w*|NET/Socket) ?:",
        r"ibv_\w+ failed",
        r"NCCL WARN Call to (connect|recv|send)",
        r"\bNet : Call to (connect|recv|send)",
        r"NCCL error in: .*(internal|system|remote) error",
        r"unhandled system error",
        r"NCCL error.*(network|socket|Connection)",
        r"transport retry counter exceeded|RETRY_EXC_ERR",
        r"ncclInternalError",
        r"IBV_WC_\w+",
        r"misc/socket\.cc|transport/net_ib|net_socket\.cc|net_ib\.cc",
        # NCCL's own socket calls, named in its INFO/WARN lines ("socketPollConnect:
        # connect to 10.0.0.2<47479> returned Connection refused"): the bootstrap or the
        # socket transport, not the c10d store. Outranks the bare socket words below.
        r"\bsocket(Poll|Start|Finalize)Connect\b",
        r"NET/OFI|fi_\w+ failed|libfabric",
        r"Connection closed by remote peer",
        r"connectFullMesh failed",
        r"pair\.cc:\d+\] Connect timeout",
    )
    + _r(
        _F.RENDEZVOUS_FAILURE,
        0.88,
        r"Rendezvous(Timeout|Closed|Connection|State)Error",
        r"The connection to the C10d store has failed",
        r"client socket has timed out after \d+\w* while trying to connect",
        r"client socket has failed to connect",
        r"server socket has failed to (listen|bind)",
        r"Socket Timeout.*(store|rendezvous)",
        r"rendezvous.*(timed out|failed)",
        r"DistStoreError",
        r"DistNetworkError",
        r"EADDRINUSE|address already in use|failed to bind|bind\(\) failed|Errno 98\b",
        r"Timed out initializing process group",
        r"Rende?z?vous version \d+ is incomplete",
        r"init_process_group.*(timed out|timeout)",
        r"Address family not supported by protocol",
        # Open MPI could not start its daemons on the other nodes: the job never formed.
        r"ORTE was unable to (reliably )?start one or more daemons",
        # Older c10d's TCPStore could not resolve MASTER_ADDR. Named so that the
        # ValueError it is raised as is not read as the user's bug.
        r"host not found: Name or service not known",
    )
    + _r(
        _F.RENDEZVOUS_FAILURE,
        0.55,
        r"Connection refused",
        r"c10d.*(getaddrinfo|failed to resolve|Name or service not known)",
    )
    + _r(
        _F.SLOW_PEER,
        0.8,
        # Straggler reports also print "No stragglers detected." every interval.
        r"(?<!no )\bstragglers? (detected|found|identified)",
        r"\bstraggl(er|ers|ing)\b",
        r"\bslow(est|er)? (rank|gpu|node|worker|peer|host|device)s?\b",
        r"\b(rank|gpu|node|worker|host|device)s?\b.{0,40}\b(is|are|was|were|runs?|running) "
        r"(much |significantly |noticeably |\d+x )?(slower|lagging|behind)",
        r"\blagg(ing|ard) (rank|node|worker|gpu|host)s?",
        r"(?<!not )\bthrottl(ed|ing)\b",
        r"straggler_gpus_(relative|individual).*rank=\d+",
        r"rank \d+ is (a )?(slow|straggler)",
        r"slow (rank|peer|node)s? (detected|found)",
        r"(HW|SW)[ _]?(Thermal[ _]?|Power[ _]?)?Slowdown\s*:\s*Active",
        # Horovod's stall inspector: the collective waits on ranks that are late.
        r"waiting for remainder of ranks",
        r"\[missing ranks: \d+",
        # Older Horovod names the ranks that are ready; the ones missing are the late.
        r"\[ready ranks: \d+",
        r"Stalled ranks:",
        # NCCL's RAS report: some ranks are behind the others in the same collective.
        r"ranks have different \w+ operation counts",
        r"ranks have launched up to operation",
        r"for GPU \d+ which is below the threshold",
        # "One gpu can slow down the whole training" (mlfoundations/open_clip#136).
        r"(gpu|node|rank|worker|host|device)\b.{0,20}\bslows? down (the )?(whole|entire|rest|all)",
    )
    + _r(
        _F.HEALTH_CHECK_FAILED,
        0.85,
        r"health ?check failed",
        r"NVIDIA-SMI has failed",
        r"No CUDA GPUs are available",
        r"no CUDA-capable device is detected|cudaErrorNoDevice",
        r"CUDA driver version is insufficient",
        r"CUDA-capable device\(?s?\)? (is/are|are|is) busy or unavailable",
        r"cudaErrorDevicesUnavailable",
        r"dcgmi diag.*fail\w*",
        r"CUDA driver initialization failed",
        r"Found no NVIDIA driver",
        r"GPU count mismatch",
        r"Failed to initialize NVML",
        r"Driver/library version mismatch",
        r"forward compatibility was attempted on non supported HW",
        r"nvidia-container-cli: initialization error",
        r"could not select device driver .* with capabilities: \[\[gpu\]\]",
        r"CUDA unknown error - this may be due to an incorrectly set up environment",
        r"NVIDIA probe routine was not called",
        r"Unexpected error from cudaGetDeviceCount",
        r"NVIDIA driver on your system is too old|cudaErrorInsufficientDriver",
        r"CUDA_ERROR_NO_DEVICE|CUDA error: system not yet initialized",
        r"No devices were found",
        r"(kernel module|driver) (is )?not loaded",
        r"clock skew",
        r"Read-only file system",
        # A TPU host whose accelerator cannot be opened (a VM reused dirty after a
        # preemption): the TPU's "device busy", as CUDA's above.
        r"TPU initialization failed",
    )
    + _r(
        _F.CAPACITY_UNAVAILABLE,
        0.9,
        r"InsufficientInstanceCapacity",
        r"ZONE_RESOURCE_POOL_EXHAUSTED\w*",
        r"do(es)? not have (sufficient|enough) .*capacity",
        r"do(es)? not have enough resources available",
        r"SkuNotAvailable|AllocationFailed",
        r"Failed to provision all possible launchable resources",
        r"ResourcesUnavailableError",
        r"SpotMaxPriceTooLow|InsufficientCapacity",
        r"QUOTA_EXCEEDED|exceeds? (your )?quota|Quota '\w+' exceeded",
        r"Insufficient nvidia\.com/gpu",
        r"0/\d+ nodes are available",
        r"out of (host )?capacity|insufficient capacity",
        r"(MaxSpotInstanceCount|VcpuLimit|InstanceLimit)Exceeded",
        r"Quota ?Exceeded|exceeded (your |the )?quota|insufficient \w+ quota",
        r"exceeding (the )?approved .*quota",
        r"resource pool exhausted|stockouts?|UnfulfillableCapacity",
        r"OverconstrainedAllocationRequest|OverconstrainedZonalAllocationRequest",
        r"currently unavailable in (the )?(zone|region|availability zone)",
        # A cloud quota refusal names the metric, what was asked and what the quota
        # allows ("MemAllocPerProjectRegion requested: 85899345920 allowed: 42949672960").
        r"\brequested:?\s*[\d.]+\s*\w*,?\s+allowed:?\s*[\d.]+",
    )
    + _r(
        _F.EXTERNAL_TERMINATION,
        0.8,
        # torchrun itself got SIGTERM/SIGINT from outside (scheduler, user, node shutdown).
        r"Received (\d+|Signals\.SIG\w+) death signal",
        r"SignalException: Process \d+ got signal",
        r"\*\*\* (JOB|STEP) \S+ (ON \S+ )?CANCELLED\b",
        r"DUE TO TIME LIMIT",
        r"srun: (Force Terminated|error: .*: tasks? [\d,-]+: Terminated)",
        r"(received|caught|got) (signal:? )?(SIGTERM|SIGINT|SIGHUP|15)\b",
        r"signal handler called with signal (15|2)\b",
        r"(killed|terminated|stopped|exited|interrupted) (by|with|due to|on) (a )?(signal:? )?"
        r"(SIGTERM|SIGINT|SIGHUP|15)\b",
        r"signal: (terminated|interrupt|hangup)\b",
        r"\bcancel+ed by (user|\d+|the user|admin)",
        r"\bjob (was )?(cancel+ed|killed|terminated|stopped) by",
        r"received (a )?(termination|shutdown|stop|kill) (signal|request)",
        r"keyboard interrupt received",
        r"\bscancel\b",
        r"DUE TO PREEMPTION",
        # AWS's spot status for an instance its own account (or tool) terminated: a
        # stop from outside, not a reclaim (npk: the tool shuts its fleet down itself).
        r"instance-terminated-by-user|user-initiated termination",
        # Azure's scheduled events other than Preempt: a planned stop, not a reclaim.
        r'"EventType"\s*:\s*"(Terminate|Reboot|Redeploy)"',
        r"terminated in response to imminent node shutdown|graceful node shutdown",
        r"(SIGTERM|SIGINT) received",
        r"^\W*Terminated\W*$",
        r"\bKeyboardInterrupt\b",
    )
    + _r(
        _F.EXTERNAL_TERMINATION,
        0.55,
        r"Signal (15|2|1) \(SIG(TERM|INT|HUP)\) received by PID",
        r"exit(ed)? (with )?(exit )?(code|status)[:=]?\s*143\b",
        r"Stopping container",
        r"\bSIG(TERM|INT|HUP)\b",
        r"\bsignal 15\b",
        r"srun: Job step aborted",
        # Kubernetes evicts pods under disk pressure or for a drain (memory: host OOM).
        r"\bEvicted\b|low on resource: (ephemeral-storage|disk|pids)",
    )
    + _r(
        _F.NODE_LOST,
        0.8,
        r"heartbeats? (missed|lost|timed out)",
        r"\bnodes?\b.{0,40}\b(unreachable|is lost|was lost)\b",
        # gloo sees a peer's socket close when that peer's process or host dies.
        r"Connection closed by peer",
        r"failed to recv, got 0 bytes",
        r"Connection was likely closed",
        r"remote server shutdown or crash",
        r"possible application crash on rank",
        r"No route to host",
        r"Host is down",
        r"closed by remote host",
        r"node .* (is )?(unreachable|lost|terminated)",
        r"lost connection to (the )?(worker|node|raylet|host|head)",
        r"still waiting for response from worker",
        r"ActorDiedError|NodeDiedError|\bNotReady\b",
        r"lame workers found",
        r"preemption in a connected worker",
        r"ClusterNotUpError",
        r"instance (was )?(terminated|stopped) (by|unexpectedly)",
        r"(node|actor|worker) (died|has died) unexpectedly|marked (as )?dead",
        # Ray's NODE_DIED task error ("the node it was running on is dead or unavailable").
        r"\bnode\b.{0,40}\bis dead\b",
        r"TCP (send|recv) error",
        r"store->get\(.*\) got error",
        # Open MPI's own texts for a peer or a node daemon that went away (issue 23).
        r"MPI communication peer process has unexpectedly disconnected",
        r"ORTE has lost communication with (a remote daemon|its daemon)",
    )
    # The rendezvous and the health detectors saw the node go quiet; outranks the
    # rendezvous error type and the causes such detectors list as possible.
    + _r(
        _F.NODE_LOST,
        0.92,
        r"failed to send a keep-alive heartbeat",
        r"missed too many heartbeats",
        r"DUE TO NODE FAILURE|Node failure on",
    )
    + _r(_F.NODE_LOST, 0.5, r"connect to host .* Connection timed out")
    + _r(_F.NODE_LOST, 0.6, r"Connection reset by peer", r"Broken pipe")
)

#: Deliberate exit codes from the training library. They outrank log text: the rank
#: itself decided why it stopped.
_EXIT_CODES: dict[int, FailureClass] = {
    ExitCode.PREEMPTED_SAVED: _F.PREEMPTION_NOTICE,
    ExitCode.NAN_DETECTED: _F.NAN_DIVERGENCE,
    ExitCode.RESUME_MISMATCH: _F.CHECKPOINT_IO,
    ExitCode.CHECKPOINT_INVALID: _F.CHECKPOINT_IO,
    ExitCode.SILENT_CORRUPTION: _F.SILENT_CORRUPTION,
}

#: Events the node agent reports (``agent_report["event"]``).
_AGENT_EVENTS: dict[str, FailureClass] = {
    "heartbeat_missed": _F.NODE_LOST,
    "node_lost": _F.NODE_LOST,
    "health_check_failed": _F.HEALTH_CHECK_FAILED,
    "straggler": _F.SLOW_PEER,
    "slow_peer": _F.SLOW_PEER,
    "no_capacity": _F.CAPACITY_UNAVAILABLE,
    "launch_failed_capacity": _F.CAPACITY_UNAVAILABLE,
    "anomaly_nan": _F.NAN_DIVERGENCE,
    "anomaly_sdc": _F.SILENT_CORRUPTION,
}

# Names from the platform's table (SIGKILL, SIGABRT...); numbers are Linux's, which is
# where ranks run.
_SIGNALS: dict[str, int] = {s.name: int(s) for s in _signal.Signals}

#: Python's ordinary error types (and the parsers' and config libraries' ones): raised
#: from a training script they mean a bug in the script, its data paths or its config.
#: Anything else (RuntimeError with an unknown message, a library's own exception) says
#: nothing by its type alone, and stays ``unknown`` unless a rule names its cause.
_USER_EXCEPTIONS = frozenset(
    {
        "KeyError", "TypeError", "ValueError", "AttributeError", "NameError",
        "UnboundLocalError", "IndexError", "LookupError", "ImportError",
        "ModuleNotFoundError", "FileNotFoundError", "IsADirectoryError",
        "NotADirectoryError", "AssertionError", "SyntaxError", "IndentationError",
        "TabError", "ZeroDivisionError", "NotImplementedError", "RecursionError",
        "JSONDecodeError", "UnicodeDecodeError", "UnicodeEncodeError", "ScannerError",
        "ParserError", "ConfigAttributeError", "ConfigKeyError", "MissingMandatoryValue",
        "InterpolationResolutionError", "ConfigCompositionException", "ArgumentError",
        # Lightning raises it for a wrong Trainer/strategy/hook setup only.
        "MisconfigurationException",
    }
)  # fmt: skip
#: Above the collateral symptoms (the peers' watchdog timeouts, torchrun's teardown,
#: a rendezvous or store error after a rank died), below the named root causes (OOM,
#: hardware, NaN) that the user's code may have raised through an ordinary type.
_USER_EXCEPTION_CONFIDENCE = 0.91
#: A rule at least this sure that matches the exception line itself names the cause.
_NAMES_A_CAUSE = 0.75
#: What the numbers alone say (a loss spike, a slow peer, a zeroed copy): below every
#: named error, so a crash in the same tail is still the cause.
_NUMERIC_CONFIDENCE = 0.7

_MAX_EVIDENCE = 3


def _parse_signal(signal: int | str | None) -> int | None:
    if signal is None:
        return None
    if isinstance(signal, int):
        return abs(signal)
    s = signal.strip().upper()
    if s.lstrip("-").isdigit():
        return abs(int(s))
    if s in _SIGNALS:
        return _SIGNALS[s]
    raise ValueError(f"unknown signal {signal!r}: use a number or SIGKILL/SIGTERM")


#: Evidence lines are cut to this length; a log line can be megabytes of tensor repr.
MAX_EVIDENCE_CHARS = 400


def _clip(line: str) -> str:
    return line if len(line) <= MAX_EVIDENCE_CHARS else line[: MAX_EVIDENCE_CHARS - 3] + "..."


# --- what the numbers in a log say ------------------------------------------------------
# Some failures print no error at all: a loss that jumps and stays up, one rank or GPU
# far slower than its peers, a tensor that arrives as zeros on another GPU. These read
# the numbers themselves; each scores below every named error, so a crash in the same
# tail is still the cause.

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
# "loss: 1.23", "Total loss: 0.5", "lm loss: 2.3E+00", "'loss': 0.4", "loss_-4.06",
# "loss_rpn_cls: 0.3" (its own series), "Loss is 1.26" (BigDL). A line that is only a
# number is series "".
# A digit glued to the name is part of it, never a value: Caffe's GoogLeNet prints
# "loss1/loss1 = 0.29" then "loss2/loss2 = 0.25", and read as values 1, 2, 3 those
# names made a healthy log a rising loss (BVLC/caffe#6373). So the name may end in
# digits, and a separator must stand between it and its value.
_LOSS_VALUE = re.compile(
    r"(?<![\w])((?:[A-Za-z]+[ _/])?(?:[A-Za-z]*loss(?:es)?\d*|ppl|perplexity)"
    r"(?:[_/][A-Za-z]+\d*)*)"
    rf"['\"]?[\s:=_'\"]+(?:(?:is|was)\s+)?(?:tensor\()?({_NUM})(?!\w|\.\d)",
    re.IGNORECASE,
)
_BARE_NUMBER = re.compile(rf"^\s*({_NUM})\s*$")
#: A spike: this many times the prior values' spread (MAD) above their median, and at
#: least this share of the median's size. Both, so neither a flat nor a noisy run trips it.
_SPIKE_MADS = 6.0
_SPIKE_RELATIVE = 0.3
#: One point counts only when it is this many times the size of the prior trend;
#: otherwise a spike must persist (two points above the line).
_SPIKE_SINGLE_RELATIVE = 10.0
_MIN_PRIOR = 2
#: The trend is the median of at most this many points before the jump (bounded work
#: on long tails).
_SPIKE_WINDOW = 20


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _jump(
    points: list[tuple[float, str]], relative: float, persist: int, single: float | None
) -> str | None:
    """The line where a series rises above its own trend: by more than ``_SPIKE_MADS``
    spreads and ``relative`` x the trend, on ``persist`` points measured against the
    trend before the first rise (so a rise that stays counts), or once by ``single`` x.
    """
    base = mad = 0.0
    above: list[str] = []
    # One prior point has no spread to measure: there the rise must at least double
    # it (or be 10x); from two prior points on, the spread and ``relative`` decide.
    least = relative
    for i in range(1, len(points)):
        if not above:
            least = max(relative, 1.0) if i < _MIN_PRIOR else relative
            prior = [v for v, _ in points[max(0, i - _SPIKE_WINDOW) : i]]
            base = _median(prior)
            mad = _median([abs(v - base) for v in prior])
        value, line = points[i]
        rise = value - base
        if rise > max(_SPIKE_MADS * mad, least * abs(base), 1e-9):
            if single is not None and rise > single * max(abs(base), mad, 1e-9):
                return line
            above.append(line)
            if len(above) >= persist:
                return above[0]
    return None


def _loss_series(lines: list[str]) -> dict[str, list[tuple[float, str]]]:
    """Each logged loss series (by key) as (value, line) points, in order."""
    series: dict[str, list[tuple[float, str]]] = {}
    for line in lines:
        found = False
        for m in _LOSS_VALUE.finditer(line):
            series.setdefault(m.group(1).lower(), []).append((float(m.group(2)), line))
            found = True
        b = None if found else _BARE_NUMBER.match(line)
        if b:
            series.setdefault("", []).append((float(b.group(1)), line))
    return series


def _loss_spike(lines: list[str]) -> str | None:
    """The line where a logged loss series jumps far above its own trend, or None."""
    for points in _loss_series(lines).values():
        jump = _jump(points, _SPIKE_RELATIVE, 2, _SPIKE_SINGLE_RELATIVE)
        if jump is not None:
            return jump
    return None


# "Iteration took 32.9 s", "step time: 1.2", "(1.003 sec/step)": a job whose step time
# rises to a multiple of its own trend and stays there waits on a slow peer.
_STEP_TIME = re.compile(
    rf"(?:iteration took|step[ _]time\W*|iter(?:ation)?[ _]time\W*)\s*({_NUM})"
    rf"|({_NUM})\s*(?:sec/step|s/it|s/step)\b",
    re.IGNORECASE,
)
#: A slowdown: step time at least this multiple of the trend above it, on 3 points.
_SLOWDOWN_RELATIVE = 1.0
_SLOWDOWN_PERSIST = 3


def _step_times(lines: list[str]) -> list[tuple[float, str]]:
    points = []
    for line in lines:
        m = _STEP_TIME.search(line)
        if m:
            points.append((float(m.group(1) or m.group(2)), line))
    return points


def _step_time_slowdown(lines: list[str]) -> str | None:
    return _jump(_step_times(lines), _SLOWDOWN_RELATIVE, _SLOWDOWN_PERSIST, None)


# "Rank 3 ... time cost 23.3", "GPU 0 ... 6698 GFlops", "(ADAPTER#0) Ending with 6698
# GFlops": one value per entity; times are slow when high, throughputs when low.
_ENTITY = re.compile(r"\b(rank|gpu|adapter|node|device|cuda)\s*[#:]?\s*(\d+)\b", re.IGNORECASE)
_THROUGHPUT = re.compile(
    rf"({_NUM})\s*(?:T|G)?(?:FLOPS|flop/s|samples/s|tokens/s|it/s|GB/s)\b", re.IGNORECASE
)
_DURATION = re.compile(
    rf"\b(?:step[ _]time|iteration time|elapsed|time cost|time)\b\W*({_NUM})"
    rf"|({_NUM})\s*(?:sec/step|s/step|ms/step|s/it)\b",
    re.IGNORECASE,
)
#: The slowest entity must be this many times off the median of the others.
_SLOW_FACTOR = 2.0
_MIN_ENTITIES = 3


def _per_entity(lines: list[str], pattern: re.Pattern[str]) -> dict[str, list[tuple[float, str]]]:
    """Every value ``pattern`` reads for each rank/GPU/node named in the lines, in order."""
    by_entity: dict[str, list[tuple[float, str]]] = {}
    for line in lines:
        e, v = _ENTITY.search(line), pattern.search(line)
        if e and v:
            value = float(next(g for g in v.groups() if g is not None))
            by_entity.setdefault(f"{e.group(1).lower()}{e.group(2)}", []).append((value, line))
    return by_entity


def _slowest_per_round(
    by_entity: dict[str, list[tuple[float, str]]], slow_is_high: bool
) -> list[tuple[str, float, str]]:
    """For each report round (the k-th value of every entity), the slowest entity, how
    many times off the median of the others it is, and its line. Rounds, not the last
    values alone: each rank prints its own step time every step, and the straggler is
    the one slow in the same step as its peers (rwth-i6/returnn#1485: 2.8 s against
    0.9-1.4 s in step 0, 3.2 s against 2.1-2.2 s in step 1)."""
    rounds = max((len(v) for v in by_entity.values()), default=0)
    out: list[tuple[str, float, str]] = []
    for k in range(rounds):
        row = {key: vals[k] for key, vals in by_entity.items() if len(vals) > k}
        if len(row) < _MIN_ENTITIES:
            continue
        worst: tuple[str, float, str] | None = None
        for key, (value, line) in row.items():
            med = _median([v for other, (v, _) in row.items() if other != key])
            if med <= 0 or value <= 0:
                continue
            ratio = value / med if slow_is_high else med / value
            if worst is None or ratio > worst[1]:
                worst = (key, ratio, line)
        if worst is not None:
            out.append(worst)
    return out


def _slow_peer(lines: list[str]) -> str | None:
    """The line of an entity far slower than its peers (>= 3 of them report) in one
    report round, or of a step time that rose to a multiple of its trend and stayed, or
    None."""
    for pattern, slow_is_high in ((_DURATION, True), (_THROUGHPUT, False)):
        for _, ratio, line in _slowest_per_round(_per_entity(lines, pattern), slow_is_high):
            if ratio >= _SLOW_FACTOR:
                return line
    return _slow_row(lines) or _slow_host_in_pairs(lines) or _step_time_slowdown(lines)


# "se02gn644,se02gn699     49.36": a sweep of two-node tests (nccl-tests' all_reduce
# between each pair of hosts), one figure per pair.
_HOST_PAIR = re.compile(rf"^\s*([A-Za-z][\w.-]*),\s*([A-Za-z][\w.-]*)\s+({_NUM})(?![\w.])")
#: A host is the slow one when every pair it is in is this many times off the median
#: of the pairs it is not in (either way: the figure may be a bandwidth or a time).
_SLOW_PAIR_FACTOR = 1.5


def _slow_host_in_pairs(lines: list[str]) -> str | None:
    """The line of a pair with the one host whose every pair is far off the others
    (NVIDIA/nccl-tests#106: ~49 GB/s whenever se02gn644 is in the pair, ~88 without),
    or None. At least two pairs with the host and two without it."""
    pairs = [
        (m.group(1), m.group(2), float(m.group(3)), line)
        for line in lines
        if (m := _HOST_PAIR.match(line))
    ]
    for host in dict.fromkeys(h for a, b, _, _ in pairs for h in (a, b)):
        mine = [(v, line) for a, b, v, line in pairs if host in (a, b)]
        others = [v for a, b, v, _ in pairs if host not in (a, b)]
        if len(mine) < 2 or len(others) < 2:
            continue
        med = _median(others)
        if med <= 0 or any(v <= 0 for v, _ in mine):
            continue
        ratios = [v / med for v, _ in mine]
        if all(r <= 1 / _SLOW_PAIR_FACTOR for r in ratios) or all(
            r >= _SLOW_PAIR_FACTOR for r in ratios
        ):
            return mine[0][1]
    return None


_TABLE_HEADER = re.compile(r"^\W*(rank|gpu|node|host|worker)\b(.*time.*)$", re.IGNORECASE)
_ROW_NUMBERS = re.compile(rf"(?<![\w.]){_NUM}(?![\w.])")


def _slow_row(lines: list[str]) -> str | None:
    """A per-rank table ("rank  data_time  step_time" then one row per rank) whose
    time column has one row far above the column's median, or None."""
    for i, header in enumerate(lines):
        m = _TABLE_HEADER.match(header)
        if not m:
            continue
        columns = [c.lower() for c in re.split(r"[\s|]+", m.group(0).strip()) if c]
        rows: list[tuple[list[float], str]] = []
        for line in lines[i + 1 :]:
            nums = [float(n) for n in _ROW_NUMBERS.findall(line)]
            if len(nums) != len(columns):
                break
            rows.append((nums, line))
        if len(rows) < _MIN_ENTITIES:
            continue
        for col, name in enumerate(columns):
            if "time" not in name:
                continue
            values = [r[col] for r, _ in rows]
            med = _median(values)
            for value, (_, line) in zip(values, rows, strict=True):
                if med > 0 and value / med >= _SLOW_FACTOR:
                    return line
    return None


_CUDA_TENSOR = re.compile(r"tensor\((\[[^()]*?\])[^()]*?device='cuda:\d+'", re.DOTALL)
_ANY_TENSOR = re.compile(r"tensor\((\[[^()]*?\])", re.DOTALL)
_TENSOR_NUMBERS = re.compile(_NUM)


def _zeroed_copy(text: str) -> str | None:
    """The line of a GPU tensor printed as all zeros beside the same-shaped non-zero
    tensor (a copy between GPUs that arrived empty, with no error), or None."""

    def layout_and_zero(body: str) -> tuple[str, bool]:
        nums = _TENSOR_NUMBERS.findall(body)
        # The printed layout (brackets, elisions) stands in for the shape.
        layout = re.sub(_NUM, "x", re.sub(r"\s+", "", body))
        return layout, bool(nums) and all(float(n) == 0.0 for n in nums)

    zeros = [m for m in _CUDA_TENSOR.finditer(text) if layout_and_zero(m.group(1))[1]]
    if not zeros:
        return None
    nonzero = {
        layout for layout, zero in map(layout_and_zero, _ANY_TENSOR.findall(text)) if not zero
    }
    for m in zeros:
        if layout_and_zero(m.group(1))[0] in nonzero:
            # The whole line where the zero tensor's device is printed.
            start = text.rfind("\n", 0, m.end()) + 1
            end = text.find("\n", m.end())
            return text[start : end if end >= 0 else len(text)]
    return None


#: A truncated copy: at least this many trailing zeros (and a quarter of the tensor).
_MIN_TRUNCATED_ZEROS = 4


def _truncated_copy(text: str) -> str | None:
    """The line of a tensor printed beside a same-layout copy that agrees with it on a
    prefix and is all zeros after it, where the copy holds non-zero numbers: a
    transfer or reduction that stopped part way, with no error (NVIDIA/nccl#1950: the
    last 8 of 10 elements of an avg reduction left as zeros), or None."""
    found = []
    for m in _ANY_TENSOR.finditer(text):
        body = m.group(1)
        nums = [float(n) for n in _TENSOR_NUMBERS.findall(body)]
        layout = re.sub(_NUM, "x", re.sub(r"\s+", "", body))
        found.append((m.start(), layout, nums))
    for start, layout, nums in found:
        n = len(nums)
        k = n
        while k > 0 and nums[k - 1] == 0.0:
            k -= 1
        zeros = n - k
        if k == 0 or zeros < max(_MIN_TRUNCATED_ZEROS, n // 4):
            continue
        for other_start, other_layout, other in found:
            if other_start == start or other_layout != layout or len(other) != n:
                continue
            scale = max(max(map(abs, nums[:k] + other[:k])), 1e-12)
            same_prefix = all(
                abs(x - y) <= _COPY_TOLERANCE * scale
                for x, y in zip(nums[:k], other[:k], strict=True)
            )
            if same_prefix and all(v != 0.0 for v in other[k:]):
                line_start = text.rfind("\n", 0, start) + 1
                line_end = text.find("\n", start)
                return text[line_start : line_end if line_end >= 0 else len(text)]
    return None


# "TP rank 1:", "[rank3]", "replica 0": whose copy a printed tensor is.
_REPLICA = re.compile(r"\b(?:rank|replica)[\s_:=#]*(\d+)\b", re.IGNORECASE)
# Copies that every replica must hold identically: parameters, their gradients after
# the all-reduce, optimizer state, checksums of them.
_REPLICATED = re.compile(r"weight|param|grad|checksum|hash|optim|state", re.IGNORECASE)
# A tensor's own repr says "grad_fn=<AddBackward0>" or "requires_grad=True": not a name.
_NOT_A_NAME = re.compile(r"tensor\([^()]*\)?|(?:grad_fn|requires_grad)=\S+")
_NAME_LOOKBACK = 8
_ASSIGNED = re.compile(r"([\w.()\[\]']+)\s*[=:]\s*$")
_DEVICE = re.compile(r"^[^()]*?device='(\w+)")
#: Copies count as disagreeing above this relative difference (fp noise is below it).
_COPY_TOLERANCE = 1e-3
_MIN_COPY_NUMBERS = 4


_Replicas = dict[str, list[tuple[str, list[float], str]]]
_Devices = dict[tuple[str, str], list[tuple[bool, list[float], str]]]


def _copies(lines: list[str]) -> tuple[_Replicas, _Devices]:
    """Printed tensors that are copies of each other: (by layout, the per-rank copies
    of replicated state; by (expression, layout), the GPU and CPU copies)."""
    replicas: _Replicas = {}
    devices: _Devices = {}
    for i, line in enumerate(lines):
        for m in _ANY_TENSOR.finditer(line):
            body = m.group(1)
            nums = [float(n) for n in _TENSOR_NUMBERS.findall(body)]
            layout = re.sub(_NUM, "x", re.sub(r"\s+", "", body))
            prefix = line[: m.start()]
            context = prefix if re.search(r"\w", prefix) else (lines[i - 1] if i else "")
            rank = _REPLICA.search(context)
            # What is printed is said once above the per-rank block ("the values of
            # final_layernorm.weight.main_grad below:"), so look a few lines up.
            said = _NOT_A_NAME.sub("", "\n".join(lines[max(0, i - _NAME_LOOKBACK) : i]) + prefix)
            if rank and len(nums) >= _MIN_COPY_NUMBERS and _REPLICATED.search(said):
                replicas.setdefault(layout, []).append((rank.group(1), nums, line))
            label = _ASSIGNED.search(prefix.rsplit(", ", 1)[-1])
            if label:
                dev = _DEVICE.match(line[m.end() :])
                on_gpu = dev is not None and dev.group(1) != "cpu"
                devices.setdefault((label.group(1), layout), []).append((on_gpu, nums, line))
    return replicas, devices


def _copies_disagree(lines: list[str]) -> str | None:
    """The line of a tensor whose other copy, printed beside it, holds different
    numbers, or None. Two shapes of report, both with no error raised:

    - replicas: the same parameter or gradient printed per rank ("TP rank 1:
      tensor([...])"), which data/tensor parallelism keeps identical on every rank;
    - devices: the same expression printed from the GPU and from the CPU
      ("n(x) = tensor([[1.]], device='cuda:0')" then "n(x) = tensor([[0.2164]])").
    """
    replicas, devices = _copies(lines)

    def differ(a: list[float], b: list[float]) -> bool:
        scale = max(max(map(abs, a + b), default=0.0), 1e-12)
        return any(abs(x - y) > _COPY_TOLERANCE * scale for x, y in zip(a, b, strict=False))

    for copies in replicas.values():
        ranks = {r for r, _, _ in copies}
        if len(ranks) >= 2:
            first = copies[0][1]
            for _, nums, line in copies[1:]:
                if differ(first, nums):
                    return line
    for printed in devices.values():
        gpu = [(n, ln) for g, n, ln in printed if g]
        cpu = [n for g, n, _ in printed if not g]
        for nums, line in gpu:
            if any(differ(nums, other) for other in cpu):
                return line
    return None


_FRAME = re.compile(r'^\s*File "[^"]+", line \d+, in \S+')
# Saving or loading a checkpoint: torch's serializer, DCP, or the trainer's own call.
_CHECKPOINT_FRAME = re.compile(
    r"serialization\.py|torch/distributed/checkpoint/|checkpoint(?:er)?\.(?:save|load)\b"
    r"|\b(?:save|load)_checkpoint\b|\btorch\.(?:save|load)\(",
    re.IGNORECASE,
)
# Forming the process group: c10d's init_process_group, the rendezvous handlers and
# the store they meet in. A traceback that ends there failed before training started.
_RENDEZVOUS_FRAME = re.compile(
    r"\bin (?:init_process_group|_new_process_group_helper|_store_based_barrier|"
    r"_create_c10d_store|_env_rendezvous_handler|_tcp_rendezvous_handler|"
    r"_file_rendezvous_handler|_init_dist_connection|next_rendezvous)\b"
    r"|torch/distributed/elastic/rendezvous/|\bdist\.init_process_group\(|\bTCPStore\(",
)
# Python's multiprocessing moving data between a process and its own DataLoader
# workers: a tensor's file descriptor handed over a local socket (resource_sharer), a
# queue read at the workers' shutdown. A socket error raised there is between the
# processes of one host; read as a peer's or a store's, it called a DataLoader hiccup
# node_lost (pytorch/pytorch#9127) and a rendezvous failure (open-mmlab/mmdetection#234).
_LOCAL_IPC_FRAME = re.compile(
    r"multiprocessing[/\\](?:resource_sharer|connection|queues)\.py"
    r"|torch[/\\]multiprocessing[/\\]reductions\.py"
    r"|\bin (?:_shutdown_workers|_worker_loop|_pin_memory_loop)\b"
)
#: Rules of bare socket words, which name no peer by themselves: beside local IPC
#: frames they say nothing (``unknown``, retried) rather than a lost node or store.
_SOCKET_WORDS = frozenset({r"Connection refused", r"Connection reset by peer", r"Broken pipe"})
#: A line that names a cause only as one possibility ("This can happen if the node was
#: preempted, had a hardware failure, or its raylet crashed"; "(OOM, preempted node,
#: etc.)"). Ray prints such lists in its node-death errors; read as a notice, a list of
#: guesses became a confident preemption (ray-project/ray#58638), and a preemption's
#: recovery skips the checks a lost or broken node needs.
_HEDGED = re.compile(
    r"\b(?:can|could|may|might) (?:happen|occur|be (?:caused|due))\b"
    r"|\bpossible (?:reasons?|causes?)\b|\be\.g\.|\betc\.",
    re.IGNORECASE,
)
#: The innermost frame of a traceback in checkpoint or process-group code, with no
#: cause named: below every named error and the user's exception.
_FRAME_CONFIDENCE = 0.65


def _innermost_frame(lines: list[str]) -> str | None:
    """The last ``File "...", line N, in f`` line of the log and its source line."""
    for i in range(len(lines) - 1, -1, -1):
        line = _RANK_PREFIX.sub("", lines[i], count=1)
        if _FRAME.match(line):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}\n{nxt}".rstrip()
    return None


def _local_ipc(lines: list[str]) -> bool:
    """Whether the tail's traceback frames pass through local IPC (``_LOCAL_IPC_FRAME``)."""
    return any(
        _FRAME.match(stripped) is not None and _LOCAL_IPC_FRAME.search(stripped) is not None
        for stripped in (_RANK_PREFIX.sub("", line, count=1) for line in lines)
    )


def _scan(lines: list[str]) -> Classification | None:
    best: dict[FailureClass, tuple[float, list[str]]] = {}
    # The line of each class's strongest hit (the first one, at equal strength).
    deciding: dict[FailureClass, str] = {}

    def hit(cls: FailureClass, confidence: float, line: str) -> None:
        conf, ev = best.get(cls, (0.0, []))
        if line not in ev:
            ev.append(line)
        if confidence > conf:
            deciding[cls] = line
        best[cls] = (max(conf, confidence), ev)

    local_ipc = _local_ipc(lines)
    for line in lines:
        hedged = _HEDGED.search(line) is not None
        # The strongest rule that matches the line speaks for it.
        rule = max(
            (
                r
                for r in _RULES
                if r.matches(line)
                and not (local_ipc and r.text in _SOCKET_WORDS)
                and not (hedged and r.failure_class is _F.PREEMPTION_NOTICE)
            ),
            key=lambda r: r.confidence,
            default=None,
        )
        if rule is not None and rule.failure_class is not _F.UNKNOWN:
            hit(rule.failure_class, rule.confidence, line)
    text = "\n".join(lines)
    corruption = _zeroed_copy(text) or _truncated_copy(text) or _copies_disagree(lines)
    last = _last_exception(lines)
    if (
        last is not None
        and last[0].rsplit(".", 1)[-1] in _USER_EXCEPTIONS
        # An assertion whose own message shows a copy that arrived zeroed or cut short
        # failed on the data, not on the user's logic (NVIDIA/nccl#1950).
        and corruption != last[2]
        # "ValueError: TCP send error. Details: Broken pipe": the message names the
        # cause, the type only says which layer raised it.
        and not any(
            r.failure_class not in (_F.USER_CODE_ERROR, _F.UNKNOWN)
            and r.confidence >= _NAMES_A_CAUSE
            and r.matches(last[2])
            for r in _RULES
        )
    ):
        hit(_F.USER_CODE_ERROR, _USER_EXCEPTION_CONFIDENCE, last[2])
    frame = _innermost_frame(lines)
    if frame is not None and _CHECKPOINT_FRAME.search(frame):
        hit(_F.CHECKPOINT_IO, _FRAME_CONFIDENCE, frame)
    elif frame is not None and _RENDEZVOUS_FRAME.search(frame):
        hit(_F.RENDEZVOUS_FAILURE, _FRAME_CONFIDENCE, frame)
    for cls, found in (
        (_F.LOSS_SPIKE, _loss_spike(lines)),
        (_F.SLOW_PEER, _slow_peer(lines)),
        (_F.SILENT_CORRUPTION, corruption),
    ):
        if found is not None:
            hit(cls, _NUMERIC_CONFIDENCE, found)
    if not best:
        return None
    order = list(FailureClass)
    cls, (conf, ev) = max(best.items(), key=lambda kv: (kv[1][0], -order.index(kv[0])))
    # Several matching lines of the same class make it a little surer.
    conf = min(1.0, conf + 0.01 * (len(ev) - 1))
    decided = _clip(deciding[cls])
    shown = [_clip(e) for e in ev[-_MAX_EVIDENCE:]]
    if decided not in shown:
        shown = [decided, *shown[-(_MAX_EVIDENCE - 1) :]]
    return Classification(cls, RETRYABLE[cls], conf, tuple(shown), decided)


def effective_signal(exit_code: int | None, signal: int | str | None) -> int | None:
    """The signal that ended the rank: given, or read from a 128+N / -N exit code."""
    sig = _parse_signal(signal)
    if exit_code is not None and exit_code > 128 and sig is None and exit_code - 128 < 65:
        sig = exit_code - 128  # shells report death by signal N as 128+N
    if exit_code is not None and exit_code < 0 and sig is None:
        sig = -exit_code  # torchrun/multiprocessing report -N
    return sig


def classify_failure(
    exit_code: int | None,
    signal: int | str | None,
    log_tail: str,
    notice_kind: str | None = None,
    agent_report: dict[str, Any] | None = None,
    *,
    model_fallback: bool | None = None,
) -> Classification:
    """Classify one failure from everything known about it. Pure.

    ``log_tail`` is the concatenated tail of each rank's log (and the kernel log when
    the agent has it). ``notice_kind`` is the metadata notice (``terminate``, ``stop``,
    ``preempt``...) when one arrived. ``agent_report`` may carry ``event`` (one of
    ``heartbeat_missed``, ``health_check_failed``, ``straggler``, ``no_capacity``...)
    and ``message`` (free text scanned like the log).

    Where the rules find no strong evidence, the learned fallback
    (:mod:`orchestrator.domain.failure_model`) may name the class when it is sure
    enough. ``model_fallback``: ``True`` rules + fallback, ``False`` the rules alone,
    ``None`` (default) whichever grouped cross-validation on the corpus's development
    part found better (``failure_model.ON_BY_DEFAULT``); ``bench/classify.py`` prints
    both.
    """
    sig = effective_signal(exit_code, signal)
    if notice_kind:
        fact = f"preemption notice: {notice_kind}"
        return Classification(_F.PREEMPTION_NOTICE, True, 0.98, (fact,), fact)
    if exit_code is not None and exit_code in _EXIT_CODES:
        cls = _EXIT_CODES[exit_code]
        name = ExitCode(exit_code).name
        fact = f"exit code {exit_code} ({name})"
        return Classification(cls, RETRYABLE[cls], 0.95, (fact,), fact)

    report = agent_report or {}
    event = report.get("event")
    lines = log_lines(log_tail)
    message = report.get("message")
    if isinstance(message, str) and message.strip():
        lines.append(message.strip())

    scanned = _scan(lines)
    if isinstance(event, str) and event in _AGENT_EVENTS:
        cls = _AGENT_EVENTS[event]
        # A log line that names a stronger root cause wins over the agent's view
        # (e.g. heartbeats stop because the kernel OOM-killed the rank).
        if scanned is None or scanned.confidence < 0.9 or scanned.failure_class is cls:
            ev = (f"agent: {event}",) + (scanned.evidence if scanned else ())
            return Classification(cls, RETRYABLE[cls], 0.9, ev[:_MAX_EVIDENCE], ev[0])
    rules = _from_scan_or_signal(scanned, sig, lines)
    if model_fallback is None:
        model_fallback = _fm.ON_BY_DEFAULT
    if not model_fallback or rules.confidence >= _fm.RULES_BELOW or not lines:
        return rules
    guess = model_guess(failure_features(lines, exit_code, sig), rules)
    return guess if guess is not None else rules


def _from_scan_or_signal(
    scanned: Classification | None, sig: int | None, lines: list[str]
) -> Classification:
    if scanned is not None:
        return scanned
    if sig == 9:
        return Classification(_F.HOST_OOM_KILLED, True, 0.4, ("killed by SIGKILL (signal 9)",))
    if sig in (1, 2, 15):
        # SIGTERM/SIGINT/SIGHUP without a notice: stopped from outside, not known lost.
        name = _signal.Signals(sig).name
        return Classification(
            _F.EXTERNAL_TERMINATION, True, 0.4, (f"terminated by {name} (signal {sig})",)
        )
    ev = (_clip(lines[-1]),) if lines else ()
    return Classification(_F.UNKNOWN, RETRYABLE[_F.UNKNOWN], _UNKNOWN_CONFIDENCE, ev)


# --- the learned fallback ---------------------------------------------------------------
# Where no rule speaks (a verification printout, a metric table, a wording no rule was
# written for), a small logistic regression over the tail's normalised words may name
# the class. It is trained by scripts/train_classifier.py on the development part of
# the corpus only and written out as orchestrator/domain/failure_model.py (weights as
# literals: no I/O here). It is a fallback, never a rule: it runs only below
# ``RULES_BELOW`` (the rules said ``unknown``), speaks only at posterior
# >= ``MIN_POSTERIOR`` (both chosen by grouped cross-validation on the development
# part), and never gives a class in ``MODEL_NEVER`` (``user_code_error``, ``unknown``,
# and the classes whose cause is a fact about numbers).

_UNKNOWN_CONFIDENCE = 0.1
#: A model decision is never surer than this: below every named rule (>= 0.6) and the
#: numeric detectors (0.7), so an operator reads it as a guess with reasons.
MODEL_MAX_CONFIDENCE = 0.5
#: Classes the model never gives. ``user_code_error``: the one class that is not
#: retried must rest on a rule an operator can read. ``unknown``: that is the rules'
#: answer anyway. The numeric classes: their cause is a fact about numbers, which the
#: model's features normalise away; where numbers were printed the detectors judge
#: them, and where none were the model has only the words around them, which healthy
#: logs share ("step <n> loss <n>"): a model open to them called a healthy loss log a
#: spike at p=0.98 and this repo's own "rank 1: chaos: hang at step 40" a slow peer at
#: p=0.93.
MODEL_NEVER = frozenset(
    {_F.USER_CODE_ERROR, _F.UNKNOWN, _F.LOSS_SPIKE, _F.SLOW_PEER, _F.SILENT_CORRUPTION}
)
_MODEL_EVIDENCE_TOKENS = 5
#: A line is read this far: a tensor repr can be megabytes and says nothing more.
_FEATURE_LINE_CHARS = 1000
_FEATURE_WORD = re.compile(r"<(?:path|hex|n)>|[A-Za-z][A-Za-z0-9_]*")
_CAMEL_PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_DIGITS = re.compile(r"\d+")


def _words(line: str) -> tuple[list[str], list[str]]:
    """(the line's normalised words in order, extra sub-words of CamelCase/snake_case)."""
    text = line[:_FEATURE_LINE_CHARS]
    for pattern, repl in _NORMALISE[:-1]:  # paths, hex ids, sizes, numbers
        text = pattern.sub(repl, text)
    words: list[str] = []
    parts: list[str] = []
    for raw in _FEATURE_WORD.findall(text):
        words.append(_DIGITS.sub("#", raw.lower()))
        if raw[0] != "<":
            sub = [_DIGITS.sub("#", w.lower()) for w in _CAMEL_PART.findall(raw)]
            if len(sub) > 1:
                parts += sub
    return words, parts


def failure_features(lines: list[str], exit_code: int | None, sig: int | None) -> set[str]:
    """What the learned fallback reads: normalised words (``w:``), word pairs within a
    line (``b:``), CamelCase/snake_case parts (``p:``), and the exit code and signal.
    Numbers, paths, hex ids and sizes are normalised (``<n>``, ``<path>``, ``<hex>``),
    so a project's step counts and file names do not become its vocabulary."""
    out: set[str] = set()
    for line in lines:
        words, parts = _words(line)
        out.update("w:" + w for w in words)
        out.update("b:" + a + " " + b for a, b in itertools.pairwise(words))
        out.update("p:" + w for w in parts)
    if exit_code is not None:
        out.add(f"exit:{exit_code}")
    if sig is not None:
        out.add(f"sig:{sig}")
    return out


def model_posterior(
    features: set[str],
    classes: tuple[str, ...],
    bias: tuple[float, ...],
    weights: dict[str, tuple[tuple[int, float], ...]],
) -> tuple[list[float], list[str]]:
    """(posterior per class, the features the model knows) for one excerpt.

    Features are binary and the vector is scaled to unit length over the known
    features, as in training (scripts/train_classifier.py calls this on its folds,
    so cross-validation measures exactly this code)."""
    known = sorted(f for f in features if f in weights)
    scores = list(bias)
    if known:
        scale = 1.0 / math.sqrt(len(known))
        for f in known:
            for c, w in weights[f]:
                scores[c] += w * scale
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps], known


def model_guess(features: set[str], rules: Classification) -> Classification | None:
    """The learned fallback's class for one excerpt whose rules gave ``rules`` (weak
    evidence), or ``None`` when it is not sure enough (posterior below
    ``MIN_POSTERIOR``) or its best class is one it may not give (:data:`MODEL_NEVER`).
    The evidence names the model, its posterior and its words, then the rules' own."""
    probs, known = model_posterior(features, _fm.CLASSES, _fm.BIAS, _fm.WEIGHTS)
    best = max(range(len(probs)), key=lambda i: (probs[i], -i))
    cls = FailureClass(_fm.CLASSES[best])
    p = probs[best]
    if cls in MODEL_NEVER or p < _fm.MIN_POSTERIOR:
        return None
    # The words that pushed hardest towards this class, so an operator sees why.
    pull = sorted(
        (f for f in known if any(c == best and w > 0 for c, w in _fm.WEIGHTS[f])),
        key=lambda f: (-dict(_fm.WEIGHTS[f])[best], f),
    )[:_MODEL_EVIDENCE_TOKENS]
    words = ", ".join(repr(f.split(":", 1)[1]) for f in pull) or "none it knows"
    said = f"rules alone: {rules.failure_class} {rules.confidence:.2f}"
    ev = (f"model: p={p:.2f} {cls} from words {words} ({said})", *rules.evidence)
    conf = round(MODEL_MAX_CONFIDENCE * p, 3)
    return Classification(cls, RETRYABLE[cls], conf, ev[:_MAX_EVIDENCE])


# --- exception signatures --------------------------------------------------------------

# Prefixes launchers put before a rank's line: torchrun's "[rank3]: " (and
# "[rank3]:[W... ProcessGroupNCCL.cpp:...]"-free forms), accelerate/Megatron's
# "[default0]:", mpirun's "[1,0]<stderr>:". Python 3.11 exception groups indent with "| ".
_RANK_PREFIX = re.compile(
    r"^(?:\s*(?:\[[\w ,.-]*\d+\](?:<std\w+>)?:|\||\(\w+ pid=\d+(?:, ip=[\d.:a-f]+)?\)))*\s*"
)
# pdsh/DeepSpeed's "worker-3: " host prefix; tried only when the line does not parse as
# it is, since "KeyError: ..." has the same shape.
_HOST_PREFIX = re.compile(r"^[\w.-]+:\s+")
# A Python exception line: a (dotted) class name ending the way Python's and libraries'
# exception types do, then ": message" or the end of the line.
_EXC_SIG_LINE = re.compile(
    r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit))"
    # Ray's "RayTaskError(KeyError): ...": the type in brackets is what was raised.
    r"(?:\(((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\))?(?::\s?(.*))?$"
)
# Launchers' own wrappers name no cause; the user's exception is above them.
_SIG_WRAPPERS = frozenset(
    {
        "ChildFailedError",
        "ProcessExitedException",
        "ProcessRaisedException",
        "SignalException",
        "CalledProcessError",
    }
)
_NORMALISE: tuple[tuple[re.Pattern[str], Any], ...] = (
    # Paths before numbers: "/data/x_3.bin" is one path, not a path and a number.
    (
        re.compile(r"(?<![\w.])(?:[A-Za-z]:\\|\.{0,2}/|~/)[\w.\-+@=]+(?:[/\\][\w.\-+@=]*)*"),
        "<path>",
    ),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<hex>"),
    # Ids, hashes, uuids: 8+ hex digits with a digit and a letter (a plain number is <n>).
    (
        re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}(?:-[0-9a-f]{4,})*\b", re.I),
        "<hex>",
    ),
    # Tensor sizes and shapes: torch.Size([8, 512]) and (8x512) become <n> lists.
    (re.compile(r"\b\d+(?:x\d+)+\b"), lambda m: "x".join(["<n>"] * (m[0].count("x") + 1))),
    (re.compile(r"(?<![A-Za-z_])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"), "<n>"),
    (re.compile(r"\s+"), " "),
)
#: Signatures are cut here: two errors that agree this far are the same error.
MAX_SIGNATURE_CHARS = 300


# --- lines that several ranks wrote at once ----------------------------------------------
# Python prints an exception's type, ": " and its message as separate writes, so two
# ranks dying together on one terminal interleave them:
#   RuntimeErrorRuntimeError: : CUDA error: invalid device ordinal    CUDA error: inv...
# (tests/failures/test_interleaved.py quotes real ones). Such a line is split back
# into one exception line per rank before it is read.

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Lazy throughout: "torch.OutOfMemoryErrortorch.OutOfMemoryError" is two names, not a
# module "torch.OutOfMemoryErrortorch" and one.
_EXC_NAME = r"(?:[A-Za-z_]\w*?\.)*?[A-Za-z_]\w*?(?:Error|Exception|Interrupt|Exit)"
_GLUED_NAMES = re.compile(rf"(?:{_EXC_NAME})(?={_EXC_NAME}$|$)")
_COLON_RUN = re.compile(r"^(?:\s*:)+\s?")
#: Only lines this short are tried (the check is quadratic in the message's length).
_INTERLEAVED_MAX_CHARS = 2000


def _split_interleaved(line: str) -> list[str]:
    """The exception lines that several ranks' output glued into ``line``
    (``KeyErrorKeyError: : 'x''x'`` -> ``KeyError: 'x'`` twice), or ``[line]``."""
    if len(line) > _INTERLEAVED_MAX_CHARS or ":" not in line:
        return [line]
    prefix = _RANK_PREFIX.match(line)
    start = prefix.end() if prefix else 0
    head, _, tail = line[start:].partition(":")
    names: list[str] = []
    rest = head
    while rest:
        m = _GLUED_NAMES.match(rest)
        if m is None or not m.group(0):
            return [line]
        names.append(m.group(0))
        rest = rest[m.end() :]
    run = _COLON_RUN.match(":" + tail)
    colons = run.group(0).count(":") if run else 1
    if len(names) < 2 or colons < 2:
        return [line]
    message = tail[run.end() - 1 :] if run else tail
    copies = _repeated(message.strip(), len(names))
    pre = line[:start]
    if copies is not None:
        return [f"{pre}{name}: {copies}" for name in names]
    # Messages that differ (another device, another size) stay together, on the line
    # read last.
    return [f"{pre}{name}" for name in names[1:]] + [f"{pre}{names[0]}: {message.strip()}"]


def _repeated(text: str, k: int) -> str | None:
    """``m`` when ``text`` is ``k`` copies of ``m`` (whitespace between them), else None."""
    for i in range(1, len(text) // k + 1):
        m = text[:i].strip()
        if m and re.fullmatch(rf"(?:{re.escape(m)}\s*){{{k}}}", text):
            return m
    return None


def log_lines(text: str) -> list[str]:
    """The non-blank lines of a log tail as the classifier reads them: colour codes
    dropped, and a line where several ranks' exceptions interleaved split back into
    one exception line per rank."""
    out: list[str] = []
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        if line.strip():
            out.extend(_split_interleaved(line))
    return out


def _last_exception(lines: list[str]) -> tuple[str, str, str] | None:
    """(type name, message, raw line) of the last exception line, wrappers skipped."""
    for raw in reversed(lines):
        line = _RANK_PREFIX.sub("", raw, count=1).strip()
        m = _EXC_SIG_LINE.match(line) or _EXC_SIG_LINE.match(_HOST_PREFIX.sub("", line, count=1))
        if m is None:
            continue
        name = m.group(2) or m.group(1)
        if name.rsplit(".", 1)[-1] in _SIG_WRAPPERS:
            continue
        return name, (m.group(3) or "").strip(), raw
    return None


def exception_signature(text: str) -> str | None:
    """The last Python exception line of ``text``, normalised so repeats compare equal.

    ``KeyError: 'input_ids'`` stays as it is; numbers, hex ids, paths and tensor sizes
    become ``<n>``, ``<hex>``, ``<path>`` (``ValueError: got 17 items at /data/x_3.bin``
    -> ``ValueError: got <n> items at <path>``), so the same bug on another rank, step or
    shard has the same signature. Launcher prefixes (``[rank3]: ``) are dropped and
    torchrun's own ``ChildFailedError`` is skipped. ``None`` when no line is an
    exception. Pure.
    """
    last = _last_exception(log_lines(text))
    if last is None:
        return None
    name, message, _ = last
    for pattern, repl in _NORMALISE:
        message = pattern.sub(repl, message)
    message = message.strip()
    sig = f"{name}: {message}" if message else name
    return sig[:MAX_SIGNATURE_CHARS]
