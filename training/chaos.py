"""Faults a rank injects into itself, for chaos runs (``skyresume chaos KIND``).

The agent writes ``{"inject_fault": {"kind": K, "token": T, "rank": R}}`` into the
control file (``orchestrator.contract.Env.CONTROL_FILE``); ``Run`` reads it at a
step boundary and acts once per token: ``rank`` null means every rank of the node,
else only that global rank. Each fault fails the way the real one does, with the
text the real one prints, because what the service does next depends on the
failure classifier reading the rank's log: a made-up message would test a path no
real failure takes.

=============  ===========================================================  ==================
kind           what the rank does at its next step                          the class it reads
=============  ===========================================================  ==================
``nan``        its reported loss is NaN once; every rank agrees and exits   nan_divergence
               76 before the update (``Run.report``)
``spike``      its loss is ``SPIKE_FACTOR`` x for ``SPIKE_STEPS`` steps,     loss_spike
               in the forward when the script routes its loss through
               ``Run.perturb_loss``; the spike detector reports the onset
               and the rank keeps training
``oom``        raises ``torch.OutOfMemoryError`` with CUDA's message,        cuda_oom
               uncaught
``xid``        writes an Xid 79 line to stderr, then raises the CUDA error  gpu_hardware
               a process gets once its GPU is gone, uncaught
``transport``  its step-boundary collective raises NCCL's remote error,     nccl_transport
               uncaught
``user_error`` raises ``KeyError('input_ids')``, uncaught                   user_code_error
=============  ===========================================================  ==================

Uncaught on purpose: the rank dies with a real traceback in its log, torchrun
reports the failed worker and tears the others down, and nothing in between
translates the failure into an exit code the classifier would read instead.

The error builders are also what ``training.examples.train_gpt`` raises for its
``--oom-above-micro-batch`` and ``--raise-keyerror-at-step`` options, so a fault
that must recur after a restart reads the same as the injected one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from orchestrator.contract import FaultKind

#: The injected spike: far above any trend (the detector's min_jump is 0.5) ...
SPIKE_FACTOR = 10.0
#: ... and for longer than the detector's ``persist`` (5 by default).
SPIKE_STEPS = 8


@dataclass(frozen=True)
class FaultRequest:
    kind: FaultKind
    token: str
    """Unique per command (the agent uses the command's seq): acted on once."""
    rank: int | None
    """The global rank that fails; None: every rank that reads this control file."""

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse_fault(doc: Any) -> FaultRequest:
    """The ``inject_fault`` value of a control file; ValueError names what is wrong."""
    if not isinstance(doc, dict):
        raise ValueError(f"inject_fault must be an object, got {doc!r}")
    kind, token, rank = doc.get("kind"), doc.get("token"), doc.get("rank")
    if kind not in set(FaultKind):
        raise ValueError(f"inject_fault.kind must be one of {sorted(FaultKind)}, got {kind!r}")
    if isinstance(token, bool) or not isinstance(token, (str, int)) or str(token) == "":
        raise ValueError(f"inject_fault.token must be a non-empty string, got {token!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"inject_fault.rank must be a global rank or null, got {rank!r}")
    return FaultRequest(FaultKind(kind), str(token), rank)


# --- the real failures' texts -------------------------------------------------------------


def cuda_oom_error(tried_gib: float = 2.0, device: int = 0) -> Exception:
    """``torch.OutOfMemoryError`` as the CUDA caching allocator raises it (torch >= 2.4
    wording, e.g. pytorch/pytorch#16417's 2024 comments), on an 80 GB card."""
    import torch

    total, in_use = 79.10, 77.92
    free = total - in_use
    allocated = in_use - 1.62 - 0.52  # reserved-but-unallocated and non-PyTorch memory
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {tried_gib:.2f} GiB. GPU {device} has a total "
        f"capacity of {total:.2f} GiB of which {free:.2f} GiB is free. Including non-PyTorch "
        f"memory, this process has {in_use:.2f} GiB memory in use. Of the allocated memory "
        f"{allocated:.2f} GiB is allocated by PyTorch, and 1.62 GiB is reserved by PyTorch "
        "but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def xid_line(pid: int) -> str:
    """The NVIDIA driver's kernel-log line for Xid 79 (the GPU fell off the PCIe bus),
    in the ``NVRM: Xid (PCI:...): 79, pid=..., name=...`` form drivers print (quoted
    in NVIDIA/NVSentinel#155)."""
    return f"NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=python, GPU has fallen off the bus."


def gpu_lost_error() -> Exception:
    """What the next CUDA call raises once the GPU is gone. torch >= 2.8 raises CUDA
    errors as ``torch.AcceleratorError`` (a RuntimeError), with this text
    (flashinfer-ai/flashinfer#4957 quotes it from torch 2.x)."""
    import torch

    return torch.AcceleratorError(
        "CUDA error: unspecified launch failure\n"
        "Search for `cudaErrorLaunchFailure' in "
        "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more "
        "information.\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.\n"
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
    )


def transport_error() -> Exception:
    """``torch.distributed.DistBackendError`` as ProcessGroupNCCL raises it when a peer's
    connection breaks mid-collective: NCCL's ``ncclRemoteError`` with its own
    description and the transport's last error (quoted in NVIDIA/nccl#934 and #2076,
    torch 2.5-2.7 and NCCL 2.18-2.21)."""
    import torch.distributed as dist

    return dist.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, remote "
        "process exited or there was a network error, NCCL version 2.21.5\n"
        "ncclRemoteError: A call failed possibly due to a network error or a remote process "
        "exiting prematurely.\n"
        "Last error:\n"
        "NET/IB : Got completion from peer 10.0.35.1<49189> with error 12, opcode 0, len 0, "
        "vendor err 129 (Recv)"
    )


def user_error() -> KeyError:
    """A batch without the key the model reads: the user's bug, raised again after
    every restart from the same code."""
    return KeyError("input_ids")


def raise_fault(kind: FaultKind) -> NoReturn:
    """Fail now the way ``kind`` says (the faults that kill the rank)."""
    if kind is FaultKind.OOM:
        raise cuda_oom_error()
    if kind is FaultKind.XID:
        print(xid_line(os.getpid()), file=sys.stderr, flush=True)
        raise gpu_lost_error()
    if kind is FaultKind.TRANSPORT:
        raise transport_error()
    if kind is FaultKind.USER_ERROR:
        raise user_error()
    raise ValueError(f"{kind} does not end the rank; Run handles it")
