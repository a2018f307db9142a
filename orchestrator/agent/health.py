"""Health checks before training: the agent checks its node before it starts torchrun,
so a broken node is replaced instead of trained on.

Each check is a function of its inputs that returns one :class:`CheckResult`; none
raises. The agent runs them all (``run_checks``), reports one ``health_check``
report with every result, and starts torchrun only when none failed.

Checks (each fails on what it names, and is skipped where it does not apply):

* ``gpus``: ``nvidia-smi`` missing, non-zero, printing an error (``Unknown Error``,
  ``ERR!``...), listing fewer GPUs than expected, or counting uncorrected ECC errors.
  Skipped when the placement declares no GPUs for the node (``--expect-gpus 0``).
* ``disk``: the checkpoint tier's filesystem has less free space than the estimate.
* ``checkpoint_store``: a list call on the store fails or does not answer in time.
  Skipped when the run has no ``CHECKPOINT_URI``.
* ``clock``: the node's clock and the service's ``Date`` header differ by more than
  the limit. Skipped without a service.
* ``allreduce_bandwidth`` (optional, after the others passed): a short all-reduce
  across the nodes (``allreduce_check.py``, one process per node) is slower than the
  job's threshold. Skipped without a threshold or with one node. The figure is the
  group's (a ring is as fast as its slowest link, and two nodes cannot say which end
  is slow), so every node of a slow group fails it; a peer that never joined makes
  it ``unknown`` here (that peer is the one to blame, and it says so itself).

A check that cannot be read is ``unknown``, never ``pass``: a node whose clock was not
compared (the service did not answer in time) must not look checked. ``unknown``
does not fail the node: only a check that saw something wrong does.

Stdlib only at import (the agent's rule): the object-store code is imported inside
``check_store``, which is the only check that needs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from orchestrator.contract import StrEnum

#: Environment defaults for the agent's health flags, so a launcher that builds the
#: agent's argv itself can still set them through the run environment.
HEALTH_CHECKS_ENV = "SKYRESUME_AGENT_HEALTH_CHECKS"  # "on" | "off"
EXPECT_GPUS_ENV = "SKYRESUME_AGENT_EXPECT_GPUS"
MIN_FREE_DISK_GB_ENV = "SKYRESUME_AGENT_MIN_FREE_DISK_GB"
MAX_CLOCK_SKEW_S_ENV = "SKYRESUME_AGENT_MAX_CLOCK_SKEW_S"
MIN_ALLREDUCE_GBPS_ENV = "SKYRESUME_AGENT_MIN_ALLREDUCE_GBPS"

#: Floor for the checkpoint tier when the service sends no estimate.
DEFAULT_MIN_FREE_DISK_GB = 1.0
DEFAULT_MAX_CLOCK_SKEW_S = 60.0
#: A store that has not answered a list call in this long is unreachable.
DEFAULT_STORE_TIMEOUT_S = 10.0
NVIDIA_SMI_TIMEOUT_S = 20.0

#: nvidia-smi output that means a GPU or the driver is broken, whatever the exit code
#: (``nvidia-smi`` prints "ERR!" in a field it could not read and exits 0).
_SMI_ERRORS = re.compile(
    r"Unknown Error|ERR!|has failed because|No devices were found|"
    r"GPU is lost|Unable to determine the device handle|fallen off the bus|"
    r"Driver/library version mismatch|Failed to initialize NVML|"
    r"requires a reboot|pending page retirement",
    re.IGNORECASE,
)
_SMI_GPU_LINE = re.compile(r"^GPU \d+: ", re.MULTILINE)


class CheckStatus(StrEnum):
    PASS = "pass"
    FAIL = "fail"  # the check saw something wrong: the node is not trained on
    SKIP = "skip"  # the check does not apply to this node
    UNKNOWN = "unknown"  # the check could not be read; not a failure, never a pass


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: CheckStatus
    detail: str
    took_s: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    """What was measured (free bytes, skew seconds, GPU count...)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail[:1000],
            "took_s": round(self.took_s, 3),
            "data": self.data,
        }


@dataclass(frozen=True)
class HealthSpec:
    """What the checks compare with; from the agent's flags (docs/agent.md)."""

    expect_gpus: int = 0
    """GPUs the placement declares for this node; 0 = ranks on CPU, no GPU check."""
    checkpoint_dir: Path = Path(".")
    """The node-local checkpoint tier (its filesystem's free space is checked)."""
    min_free_disk_bytes: int = int(DEFAULT_MIN_FREE_DISK_GB * 2**30)
    checkpoint_uri: str | None = None
    store_timeout_s: float = DEFAULT_STORE_TIMEOUT_S
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S


def _timed(fn: Callable[[], CheckResult]) -> CheckResult:
    t0 = time.monotonic()
    r = fn()
    return CheckResult(r.name, r.status, r.detail, time.monotonic() - t0, r.data)


# --- GPUs -------------------------------------------------------------------------------


def _smi(argv: list[str], timeout: float) -> tuple[int | None, str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:g} s"
    except OSError as e:
        return None, str(e)
    return out.returncode, (out.stdout + out.stderr).strip()


def check_gpus(expect: int, *, smi: str | None = None) -> CheckResult:
    """GPUs visible and nvidia-smi clean, where the placement declares GPUs."""
    smi = smi or shutil.which("nvidia-smi")
    if expect <= 0:
        present = "present" if smi else "not installed"
        return CheckResult(
            "gpus",
            CheckStatus.SKIP,
            f"no GPUs on this node: the placement declares none (nvidia-smi {present})",
        )
    if smi is None:
        return CheckResult(
            "gpus", CheckStatus.FAIL, f"{expect} GPU(s) expected but nvidia-smi is not installed"
        )
    code, text = _smi([smi, "-L"], NVIDIA_SMI_TIMEOUT_S)
    seen = len(_SMI_GPU_LINE.findall(text))
    data: dict[str, Any] = {"expected": expect, "visible": seen}
    bad = _SMI_ERRORS.search(text)
    if code != 0 or bad:
        why = f"exit code {code}" if code is not None else "did not run"
        return CheckResult(
            "gpus", CheckStatus.FAIL, f"nvidia-smi -L: {why}: {_first_lines(text)}", data=data
        )
    if seen < expect:
        return CheckResult(
            "gpus",
            CheckStatus.FAIL,
            f"{seen} GPU(s) visible, {expect} expected: {_first_lines(text)}",
            data=data,
        )
    code, text = _smi(
        [
            smi,
            "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
            "--format=csv,noheader,nounits",
        ],
        NVIDIA_SMI_TIMEOUT_S,
    )
    if code != 0 or _SMI_ERRORS.search(text):
        why = f"exit code {code}" if code is not None else "did not run"
        return CheckResult(
            "gpus",
            CheckStatus.FAIL,
            f"nvidia-smi --query-gpu: {why}: {_first_lines(text)}",
            data=data,
        )
    ecc = {}
    for line in text.splitlines():
        idx, _, count = (p.strip() for p in line.partition(","))
        if count.isdigit() and int(count) > 0:
            ecc[idx] = int(count)
    if ecc:
        data["uncorrected_ecc"] = ecc
        gpus = ", ".join(f"GPU {i}: {n}" for i, n in sorted(ecc.items()))
        return CheckResult(
            "gpus", CheckStatus.FAIL, f"uncorrected ECC errors since boot ({gpus})", data=data
        )
    return CheckResult(
        "gpus", CheckStatus.PASS, f"{seen} GPU(s) visible, nvidia-smi clean", data=data
    )


def _first_lines(text: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " / ".join(lines[:n])[:500] or "(no output)"


# --- disk -------------------------------------------------------------------------------


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_disk(path: Path, min_free_bytes: int) -> CheckResult:
    """Free space on the checkpoint tier's filesystem (the directory need not exist
    yet: its nearest existing parent is measured)."""
    where = _existing_ancestor(path)
    try:
        st = os.statvfs(where)
    except OSError as e:
        return CheckResult("disk", CheckStatus.FAIL, f"{where}: cannot statvfs: {e}")
    free = st.f_bavail * st.f_frsize
    data = {"path": str(where), "free_bytes": free, "min_free_bytes": min_free_bytes}
    if free < min_free_bytes:
        return CheckResult(
            "disk",
            CheckStatus.FAIL,
            f"{where}: {_gib(free)} free, the checkpoint tier needs {_gib(min_free_bytes)}",
            data=data,
        )
    if not os.access(where, os.W_OK):
        return CheckResult("disk", CheckStatus.FAIL, f"{where}: not writable", data=data)
    return CheckResult(
        "disk",
        CheckStatus.PASS,
        f"{where}: {_gib(free)} free (>= {_gib(min_free_bytes)})",
        data=data,
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# --- checkpoint store -------------------------------------------------------------------


def _list_store(uri: str) -> str:
    """One list call under the URI's prefix; returns what it saw."""
    from orchestrator.cloud.storage import LocalStore, store_for_uri

    store, prefix = store_for_uri(uri)
    if isinstance(store, LocalStore):
        # A missing root lists as empty: check that it can be created where it would be.
        root = store.root
        if not root.exists():
            parent = _existing_ancestor(root)
            if not parent.is_dir() or not os.access(parent, os.W_OK):
                raise OSError(f"{root} does not exist and {parent} is not a writable directory")
            return f"{root} does not exist yet; {parent} is writable"
        if not root.is_dir():
            raise OSError(f"{root} is not a directory")
    objs = store.list(prefix + "/" if prefix else "")
    return f"listed {len(objs)} object(s)"


def check_store(uri: str | None, *, timeout_s: float = DEFAULT_STORE_TIMEOUT_S) -> CheckResult:
    """The checkpoint store answers a list call within ``timeout_s``."""
    if not uri:
        return CheckResult("checkpoint_store", CheckStatus.SKIP, "the run has no checkpoint URI")
    result: dict[str, Any] = {}

    def go() -> None:
        try:
            result["ok"] = _list_store(uri)
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"

    # A daemon thread: an SDK stuck in its own retries must not hold the node up
    # past the timeout (the thread is abandoned; the agent exits or trains on).
    t = threading.Thread(target=go, name="health-store", daemon=True)
    t.start()
    t.join(timeout_s)
    data = {"uri": uri}
    if "ok" in result:
        return CheckResult(
            "checkpoint_store", CheckStatus.PASS, f"{uri}: {result['ok']}", data=data
        )
    if "error" in result:
        return CheckResult(
            "checkpoint_store", CheckStatus.FAIL, f"{uri}: {result['error']}"[:1000], data=data
        )
    return CheckResult(
        "checkpoint_store",
        CheckStatus.FAIL,
        f"{uri}: no answer to a list call in {timeout_s:g} s",
        data=data,
    )


# --- clock ------------------------------------------------------------------------------


def check_clock(
    service_date: str | None,
    *,
    local_sent: float | None,
    local_received: float | None,
    max_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
    have_service: bool = True,
) -> CheckResult:
    """The node's wall clock against the service's ``Date`` header.

    The header has a one-second resolution and was written somewhere between our
    request and its answer, so the skew is the distance from that window (plus one
    second) to the header's time: a slow answer never reads as a skewed clock.
    """
    if not have_service:
        return CheckResult("clock", CheckStatus.SKIP, "no service to compare with")
    if service_date is None or local_sent is None or local_received is None:
        return CheckResult(
            "clock", CheckStatus.UNKNOWN, "no Date header from the service (not reached yet)"
        )
    try:
        theirs = parsedate_to_datetime(service_date).timestamp()
    except (TypeError, ValueError):
        return CheckResult("clock", CheckStatus.UNKNOWN, f"unreadable Date header {service_date!r}")
    lo, hi = local_sent - 1.0, local_received + 1.0
    skew = 0.0 if lo <= theirs <= hi else (lo - theirs if theirs < lo else hi - theirs)
    # skew > 0: the node is ahead of the service.
    data = {"skew_s": round(skew, 3), "max_skew_s": max_skew_s, "service_date": service_date}
    if abs(skew) > max_skew_s:
        side = "ahead of" if skew > 0 else "behind"
        return CheckResult(
            "clock",
            CheckStatus.FAIL,
            f"the node's clock is {abs(skew):.0f} s {side} the service's (limit {max_skew_s:g} s)",
            data=data,
        )
    return CheckResult(
        "clock", CheckStatus.PASS, f"within {max(abs(skew), 1.0):.0f} s of the service", data=data
    )


# --- all together -----------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceDate:
    """The ``Date`` header of one answer and when (wall clock) the request went out
    and the answer came back."""

    date: str | None
    sent: float
    received: float


def run_checks(
    spec: HealthSpec, *, service: ServiceDate | None, have_service: bool
) -> list[CheckResult]:
    """Every check, in a fixed order; the slow ones (nvidia-smi, the store) in parallel."""
    slow: dict[str, CheckResult] = {}

    def run(name: str, fn: Callable[[], CheckResult]) -> threading.Thread:
        def go() -> None:
            try:
                slow[name] = _timed(fn)
            except Exception as e:  # a check that crashes is unknown, never a pass
                slow[name] = CheckResult(name, CheckStatus.UNKNOWN, f"{type(e).__name__}: {e}")

        t = threading.Thread(target=go, name=f"health-{name}", daemon=True)
        t.start()
        return t

    threads = [
        run("gpus", lambda: check_gpus(spec.expect_gpus)),
        run(
            "checkpoint_store",
            lambda: check_store(spec.checkpoint_uri, timeout_s=spec.store_timeout_s),
        ),
    ]
    disk = _timed(lambda: check_disk(spec.checkpoint_dir, spec.min_free_disk_bytes))
    clock = _timed(
        lambda: check_clock(
            service.date if service else None,
            local_sent=service.sent if service else None,
            local_received=service.received if service else None,
            max_skew_s=spec.max_clock_skew_s,
            have_service=have_service,
        )
    )
    for t in threads:
        t.join(NVIDIA_SMI_TIMEOUT_S * 2 + spec.store_timeout_s)
    out = []
    for name in ("gpus", "disk", "checkpoint_store", "clock"):
        if name == "disk":
            out.append(disk)
        elif name == "clock":
            out.append(clock)
        else:
            out.append(
                slow.get(name)
                or CheckResult(name, CheckStatus.UNKNOWN, "the check did not finish in time")
            )
    return out


# --- all-reduce bandwidth across the nodes ----------------------------------------------


@dataclass(frozen=True)
class AllreduceSpec:
    min_gbps: float
    """Bus bandwidth the job needs, GB/s; 0 = no check."""
    rank: int
    world: int
    addr: str
    port: int
    mib: float = 64.0
    iters: int = 3
    join_timeout_s: float = 60.0
    """How long to wait for every node to join (nodes start at different times)."""


def check_allreduce(
    spec: AllreduceSpec, *, python: str, env: dict[str, str] | None = None
) -> CheckResult:
    """The group's all-reduce bus bandwidth against the job's threshold."""
    name = "allreduce_bandwidth"
    if spec.min_gbps <= 0:
        return CheckResult(name, CheckStatus.SKIP, "the job sets no bandwidth threshold")
    if spec.world < 2:
        return CheckResult(name, CheckStatus.SKIP, "one node: no link to measure")
    argv = [
        python, "-m", "orchestrator.agent.allreduce_check",
        "--rank", str(spec.rank), "--world", str(spec.world),
        "--addr", spec.addr, "--port", str(spec.port),
        "--mib", f"{spec.mib:g}", "--iters", str(spec.iters),
        "--timeout-s", f"{spec.join_timeout_s:g}",
    ]  # fmt: skip
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=spec.join_timeout_s + 60
        )
    except subprocess.TimeoutExpired:
        return CheckResult(name, CheckStatus.UNKNOWN, "the all-reduce check did not finish")
    except OSError as e:
        return CheckResult(name, CheckStatus.UNKNOWN, f"could not run the check: {e}")
    doc: dict[str, Any] = {}
    for line in reversed(out.stdout.splitlines()):
        with contextlib.suppress(ValueError):
            got = json.loads(line)
            if isinstance(got, dict):
                doc = got
                break
    if "error" in doc or "busbw_gbps_slowest" not in doc:
        why = doc.get("error") or _first_lines(out.stderr or out.stdout)
        return CheckResult(name, CheckStatus.UNKNOWN, f"no measurement: {why}"[:1000])
    gbps = float(doc["busbw_gbps_slowest"])
    data = {**doc, "min_gbps": spec.min_gbps}
    what = (
        f"{gbps:.3f} GB/s bus bandwidth ({doc.get('backend')}, {spec.world} nodes, "
        f"{spec.mib:g} MiB)"
    )
    if gbps < spec.min_gbps:
        return CheckResult(
            name, CheckStatus.FAIL, f"{what}, under the job's {spec.min_gbps:g} GB/s", data=data
        )
    return CheckResult(name, CheckStatus.PASS, f"{what} >= {spec.min_gbps:g} GB/s", data=data)


def failed(results: list[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.status is CheckStatus.FAIL]


def summary(results: list[CheckResult]) -> str:
    """``disk: ... ; gpus: ...`` for the failed checks, or a count when none failed."""
    bad = failed(results)
    if bad:
        return "; ".join(f"{r.name}: {r.detail}" for r in bad)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status.value] = counts.get(r.status.value, 0) + 1
    return "all checks passed (" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ")"


def env_float(environ: dict[str, str], name: str, default: float) -> float:
    with contextlib.suppress(KeyError, ValueError):
        return float(environ[name])
    return default
