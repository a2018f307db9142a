"""Evidence before the kill: every local rank's Python stack, its /proc state, and the
collective traces (NCCL Flight Recorder dumps) the node holds, taken *before* the
agent signals the ranks, so an incident can name the rank and the operation that
stopped.

Read-only by construction: nothing here signals a rank except ``SIGUSR2`` to a rank
that installed a handler for it (faulthandler); the agent stops the ranks afterwards,
as usual. Stdlib only (the agent's import rule).

How a rank's stack is taken, in order:

1. ``py-spy dump --pid P`` (PyPI ``py-spy``, a static binary; needs ptrace, which
   root has). It pauses the rank for the ~20-50 ms of the read. Measured here: on a
   rank in state ``T`` (SIGSTOPped, as ``skyresume chaos hang-rank`` does) that
   fails ("Failed to suspend process ... unexpected waitpid result PtraceEvent"), so
   a stopped rank is read with ``--nonblocking`` (memory reads, no ptrace stop),
   which works; a blocking dump that fails is retried once the same way.
2. faulthandler: when py-spy is missing or failed and the rank has a handler for
   SIGUSR2 (``SigCgt`` in ``/proc/<pid>/status``; ``faulthandler.register(SIGUSR2,
   all_threads=True)``), the agent sends SIGUSR2 and reads what the rank wrote to its
   log. Never without a handler: SIGUSR2's default action kills the process, and a
   stopped rank cannot run a handler at all.
3. Neither: the rank's state and kernel wait channel alone (``/proc``), which is
   still evidence ("rank 1 is stopped (state T)").

Every rank is read in parallel within one budget for the node (``CAPTURE_BUDGET_S``):
evidence must never hold up a stop for long.

Stacks are innermost frame first (both tools print them so). :func:`find_stuck` reads
the main thread: the innermost frame in ``torch/distributed/distributed_c10d.py``
names the collective (``all_reduce``, ``barrier``, ``recv``...); a rank inside the
autograd engine is in ``backward`` (DDP reduces gradients there, from C++); a rank
outside both is not in a collective, and when its peers wait in one it is the
suspect holding them back (:func:`summarize`).

Flight Recorder: NCCL writes ``<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>`` on a
timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``): a pickle of plain dicts (``version``,
``pg_config``, ``pg_status``, ``entries`` with ``profiling_name``,
``collective_seq_id``, ``state``, ``frames``...). It is read with an unpickler that
refuses every global, so a file on the node cannot run code in the agent; the summary
keeps each process group's last enqueued/completed collective and the entries not
completed (the one a rank waits in).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: One node's capture, all ranks in parallel, takes at most this long.
CAPTURE_BUDGET_S = 10.0
#: A rank's stack text is cut to this many characters (the service refuses more).
STACK_CAP_CHARS = 64 * 1024
#: All stack text of one report together (the service refuses more); each rank's cap
#: shrinks so that a node with many ranks still fits.
REPORT_STACK_CAP_CHARS = 1024 * 1024
#: Flight Recorder files read per capture, bytes read per file, pending entries kept.
FR_MAX_FILES = 64
FR_MAX_BYTES = 16 * 1024 * 1024
FR_MAX_PENDING = 8
#: How long to wait for a rank's faulthandler output after SIGUSR2.
FAULTHANDLER_WAIT_S = 2.0
#: Where NCCL writes its Flight Recorder dumps (the prefix; the rank is appended).
FR_PREFIX_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"

_TRUNCATED = "\n... [truncated: {n} more characters]"


@dataclass(frozen=True)
class Frame:
    func: str
    file: str
    line: int | None

    def __str__(self) -> str:
        return f"{self.func} ({self.file}:{self.line if self.line is not None else '?'})"


@dataclass(frozen=True)
class ThreadStack:
    ident: str
    name: str
    """py-spy's thread name ("MainThread"); faulthandler's "Current thread" or ""."""
    frames: tuple[Frame, ...]
    """Innermost first."""


# --- parsing ----------------------------------------------------------------------------

_PYSPY_THREAD = re.compile(r'^Thread (\S+) \(([^)]*)\)(?:: "(.*)")?\s*$')
_PYSPY_FRAME = re.compile(r"^\s{4}(\S.*?) \((.+?)(?::(\d+))?\)\s*$")
_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FH_STACK = re.compile(r"^Stack \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.+)", line (\d+|\?\?\?) in (.+?)\s*$')


def parse_py_spy(text: str) -> list[ThreadStack]:
    """Threads from ``py-spy dump`` output (native frames, ``(libc.so.6)``, kept as
    frames without a line)."""
    threads: list[ThreadStack] = []
    ident = name = None
    frames: list[Frame] = []
    for line in text.splitlines():
        m = _PYSPY_THREAD.match(line)
        if m:
            if ident is not None:
                threads.append(ThreadStack(ident, name or "", tuple(frames)))
            ident, name, frames = m.group(1), m.group(3) or "", []
            continue
        if ident is None:
            continue
        f = _PYSPY_FRAME.match(line)
        if f:
            frames.append(Frame(f.group(1), f.group(2), int(f.group(3)) if f.group(3) else None))
    if ident is not None:
        threads.append(ThreadStack(ident, name or "", tuple(frames)))
    return threads


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """Threads from faulthandler's dump (``dump_traceback``/``register``); the last
    dump in ``text`` wins when a log holds several."""
    blocks: list[list[ThreadStack]] = []
    in_dump = False
    ident: str | None = None
    name = ""
    frames: list[Frame] = []

    def close() -> None:
        nonlocal ident
        if ident is not None:
            blocks[-1].append(ThreadStack(ident, name, tuple(frames)))
        ident = None

    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        s = _FH_STACK.match(line)
        if m or s:
            close()
            if not in_dump:  # a thread header after other output starts a new dump
                blocks.append([])
                in_dump = True
            if m:
                ident = m.group(2)
                name = "Current thread" if m.group(1) == "Current thread" else ""
            else:
                ident, name = "current", "Current thread"
            frames = []
            continue
        f = _FH_FRAME.match(line)
        if f and ident is not None:
            lineno = f.group(2)
            frames.append(Frame(f.group(3), f.group(1), int(lineno) if lineno.isdigit() else None))
        elif not line.strip():
            close()  # a blank line separates the threads of one dump
        else:
            close()  # anything else is the rank's own output: the dump ended
            in_dump = False
    close()
    return blocks[-1] if blocks else []


def main_thread(threads: list[ThreadStack]) -> ThreadStack | None:
    """The thread that runs the training loop: py-spy's "MainThread"; for
    faulthandler the thread whose outermost frame is a module's top level."""
    for t in threads:
        if t.name == "MainThread":
            return t
    for t in threads:
        if t.frames and t.frames[-1].func == "<module>":
            return t
    return threads[0] if threads else None


# --- what a stack says ------------------------------------------------------------------

_C10D = "torch/distributed/distributed_c10d.py"
_DISTRIBUTED = "torch/distributed/"
_AUTOGRAD = "torch/autograd/"


@dataclass(frozen=True)
class StuckIn:
    op: str | None
    """The collective (``all_reduce``, ``barrier``...), ``backward``, or None."""
    frame: Frame | None
    """Where: the collective's frame, else the innermost Python frame."""
    in_collective: bool
    caller: Frame | None = None
    """For a collective: the first frame outside torch that led to it (the user's call)."""


def _python_frames(frames: tuple[Frame, ...]) -> list[Frame]:
    return [f for f in frames if f.line is not None]


def _path(f: Frame) -> str:
    return f.file.replace("\\", "/")


def _in_torch(f: Frame) -> bool:
    p = _path(f)
    return p.startswith("torch/") or "/torch/" in p


def find_stuck(threads: list[ThreadStack]) -> StuckIn:
    """What the rank's main thread is doing, from its stack alone."""
    t = main_thread(threads)
    frames = _python_frames(t.frames) if t else []
    if not frames:
        return StuckIn(None, None, False)

    def at(i: int, op: str) -> StuckIn:
        caller = next((f for f in frames[i + 1 :] if not _in_torch(f)), None)
        return StuckIn(op, frames[i], True, caller)

    for i, f in enumerate(frames):  # innermost first: the first c10d frame blocks
        if _path(f).endswith(_C10D) and not f.func.startswith("_"):
            return at(i, f.func.rsplit(".", 1)[-1])
    for i, f in enumerate(frames):
        if _DISTRIBUTED in _path(f):
            return at(i, f.func.rsplit(".", 1)[-1])
    for i, f in enumerate(frames):
        if _AUTOGRAD in _path(f):
            # DDP's gradient all-reduce runs inside the autograd engine (C++): a rank
            # that hangs here most likely waits for a peer, but it may be computing.
            return at(i, "backward")
    return StuckIn(None, frames[0], False)


def describe_rank(ev: dict[str, Any]) -> str:
    """One line for a rank's evidence dict (see :func:`capture_rank`)."""
    r = ev.get("rank")
    state = ev.get("state")
    if state is None:
        return f"rank {r} had exited before the capture"
    op, where, caller = ev.get("op"), ev.get("where"), ev.get("called_from")
    via = f", called from {caller}" if caller else ""
    if state in ("T", "t"):
        line = f"rank {r} is stopped (state {state})"
        if op:
            return f"{line} inside {op}{via}"
        return f"{line} at {where}" if where else line
    if op:
        return f"rank {r} waits in {op} at {where}{via}"
    if where:
        return f"rank {r} is not in a collective: {where}"
    return f"rank {r}: no stack ({ev.get('error') or 'no tool'}; state {state})"


def summarize(ranks: list[dict[str, Any]]) -> list[str]:
    """Findings over ranks' evidence (one node's, or every node's of an incident):
    one line per rank, then the suspects — stopped ranks, and ranks outside any
    collective while others wait in one."""
    lines = [describe_rank(ev) for ev in sorted(ranks, key=lambda e: e.get("rank") or 0)]
    waiting = [ev for ev in ranks if ev.get("op")]
    stopped = [ev["rank"] for ev in ranks if ev.get("state") in ("T", "t")]
    outside = [
        ev["rank"]
        for ev in ranks
        if ev.get("where") and not ev.get("op") and ev.get("state") not in (None, "T", "t")
    ]
    if stopped:
        lines.append(f"suspect: rank(s) {_ranks(stopped)} stopped (SIGSTOP or a debugger)")
    if waiting and outside:
        ops = sorted({str(ev["op"]) for ev in waiting})
        lines.append(
            f"suspect: rank(s) {_ranks(outside)} outside any collective while "
            f"rank(s) {_ranks([ev['rank'] for ev in waiting])} wait in {', '.join(ops)}"
        )
    return lines


def _ranks(rs: list[Any]) -> str:
    return ", ".join(str(r) for r in sorted(rs))


# --- /proc ------------------------------------------------------------------------------


def proc_state(pid: int, proc: str = "/proc") -> tuple[str | None, str | None]:
    """(state letter, kernel wait channel) of a live process; (None, None) when gone
    or a zombie. ``T`` = stopped by a signal, ``t`` = stopped by a tracer."""
    try:
        raw = Path(f"{proc}/{pid}/stat").read_text()
    except OSError:
        return None, None
    fields = raw.rpartition(")")[2].split()
    state = fields[0] if fields else None
    if state in (None, "Z", "X"):
        return None, None
    wchan = None
    with contextlib.suppress(OSError):
        wchan = Path(f"{proc}/{pid}/wchan").read_text().strip() or None
    return state, (None if wchan == "0" else wchan)


def catches_signal(pid: int, signum: int, proc: str = "/proc") -> bool:
    """Whether the process has a handler installed for ``signum`` (``SigCgt``)."""
    try:
        for line in Path(f"{proc}/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        # Unreadable: assume no handler, so the agent never sends a signal that would
        # kill the rank instead of making it dump its stack.
        return False
    return False


# --- capture ----------------------------------------------------------------------------


def find_py_spy() -> str | None:
    """``py-spy`` on PATH, else beside this interpreter (a venv's bin/, where pip puts
    it, is often not on the agent's PATH)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


@dataclass(frozen=True)
class RankTarget:
    rank: int
    local_rank: int
    pid: int
    log_path: Path | None = None
    """Where the rank's stderr goes (faulthandler writes there)."""


def _run_py_spy(py_spy: str, pid: int, nonblocking: bool, timeout: float) -> tuple[str, str]:
    """(stdout, error); error is "" on success."""
    argv = [py_spy, "dump", "--pid", str(pid)]
    if nonblocking:
        argv.append("--nonblocking")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=max(0.1, timeout))
    except subprocess.TimeoutExpired:
        return "", f"py-spy timed out after {timeout:.1f} s"
    except OSError as e:
        return "", f"py-spy could not run: {e}"
    if out.returncode != 0 or not parse_py_spy(out.stdout):
        err = (out.stderr or out.stdout).strip().splitlines()
        return "", "py-spy failed: " + " / ".join(err[:3])[:500]
    return out.stdout, ""


def _faulthandler_dump(target: RankTarget, deadline: float) -> tuple[str, str]:
    if target.log_path is None:
        return "", "no log to read faulthandler output from"
    try:
        start = target.log_path.stat().st_size
    except OSError:
        start = 0
    try:
        os.kill(target.pid, signal.SIGUSR2)
    except OSError as e:
        return "", f"SIGUSR2 failed: {e}"
    end = min(deadline, time.monotonic() + FAULTHANDLER_WAIT_S)
    text = ""
    while time.monotonic() < end:
        time.sleep(0.05)
        try:
            with target.log_path.open("rb") as f:
                f.seek(start)
                text = f.read(STACK_CAP_CHARS * 4).decode("utf-8", "replace")
        except OSError:
            continue
        threads = parse_faulthandler(text)
        # Done when the main thread's dump has reached its module's top level.
        if threads and any(t.frames and t.frames[-1].func == "<module>" for t in threads):
            break
    if not parse_faulthandler(text):
        return "", "no faulthandler output after SIGUSR2"
    return text, ""


def truncate(text: str, cap: int) -> tuple[str, bool]:
    """``text`` cut to at most ``cap`` characters, marker included; the head is kept
    (both tools print the main thread's innermost frames first)."""
    if len(text) <= cap:
        return text, False
    marker = _TRUNCATED.format(n=len(text))
    keep = max(0, cap - len(marker))
    return text[:keep] + _TRUNCATED.format(n=len(text) - keep), True


def capture_rank(
    target: RankTarget, *, py_spy: str | None, deadline: float, cap: int = STACK_CAP_CHARS
) -> dict[str, Any]:
    """One rank's evidence: state, wait channel, stack text, the tool, what it is in."""
    t0 = time.monotonic()
    state, wchan = proc_state(target.pid)
    ev: dict[str, Any] = {
        "rank": target.rank,
        "local_rank": target.local_rank,
        "pid": target.pid,
        "state": state,
        "wchan": wchan,
        "tool": None,
        "stack": "",
        "truncated": False,
        "error": None,
        "op": None,
        "where": None,
        "called_from": None,
    }
    if state is None:
        ev["error"] = "the rank had exited"
        return ev
    stopped = state in ("T", "t")
    # A stopped rank cannot be ptrace-stopped again, and one in uninterruptible sleep
    # (D: a hung filesystem) would hold a ptrace stop until it wakes: read either's
    # memory instead.
    nonblocking = stopped or state == "D"
    text, errors, threads = "", [], []
    if py_spy is not None:
        text, err = _run_py_spy(py_spy, target.pid, nonblocking, deadline - time.monotonic())
        ev["tool"] = "py-spy --nonblocking" if nonblocking else "py-spy"
        if err and not nonblocking and time.monotonic() < deadline:
            errors.append(err)
            text, err = _run_py_spy(py_spy, target.pid, True, deadline - time.monotonic())
            ev["tool"] = "py-spy --nonblocking"
        if err:
            errors.append(err)
        else:
            threads = parse_py_spy(text)
    else:
        errors.append("py-spy is not installed")
    if not threads and not stopped and catches_signal(target.pid, signal.SIGUSR2):
        text, err = _faulthandler_dump(target, deadline)
        if err:
            errors.append(err)
        else:
            ev["tool"] = "faulthandler"
            threads = parse_faulthandler(text)
    if not threads:
        ev["tool"] = None
        if not stopped and py_spy is None:
            errors.append("the rank has no SIGUSR2 handler (faulthandler.register)")
        ev["error"] = "; ".join(errors)[:1000]
    else:
        stuck = find_stuck(threads)
        ev["op"] = stuck.op
        ev["where"] = str(stuck.frame) if stuck.frame else None
        ev["called_from"] = str(stuck.caller) if stuck.caller else None
        ev["stack"], ev["truncated"] = truncate(text, cap)
    ev["took_s"] = round(time.monotonic() - t0, 3)
    return ev


def capture_stacks(
    targets: list[RankTarget],
    *,
    budget_s: float = CAPTURE_BUDGET_S,
    py_spy: str | None = None,
    use_py_spy: bool = True,
) -> list[dict[str, Any]]:
    """Every target's evidence, read in parallel, within ``budget_s`` for all of them.
    A rank whose read is still running at the deadline is reported as such."""
    if use_py_spy and py_spy is None:
        py_spy = find_py_spy()
    deadline = time.monotonic() + budget_s
    per_rank = (
        max(1024, REPORT_STACK_CAP_CHARS // len(targets)) if targets else REPORT_STACK_CAP_CHARS
    )
    cap = min(STACK_CAP_CHARS, per_rank)
    results: dict[int, dict[str, Any]] = {}

    def one(t: RankTarget) -> None:
        try:
            results[t.rank] = capture_rank(t, py_spy=py_spy, deadline=deadline, cap=cap)
        except Exception as e:  # one unreadable rank must not lose the others' stacks
            results[t.rank] = {
                "rank": t.rank,
                "local_rank": t.local_rank,
                "pid": t.pid,
                "state": proc_state(t.pid)[0],
                "error": f"{type(e).__name__}: {e}"[:1000],
            }

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()) + 0.5)
    out = []
    for t in targets:
        ev = results.get(t.rank)
        if ev is None:
            ev = {
                "rank": t.rank,
                "local_rank": t.local_rank,
                "pid": t.pid,
                "state": proc_state(t.pid)[0],
                "error": f"no stack within the {budget_s:g} s budget",
            }
        out.append(ev)
    return out


# --- Flight Recorder --------------------------------------------------------------------


class _PlainUnpickler(pickle.Unpickler):
    """Builtin containers and scalars only: a dump that names any global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")


def read_fr_dump(data: bytes) -> dict[str, Any]:
    doc = _PlainUnpickler(io.BytesIO(data)).load()
    if not isinstance(doc, dict) or not isinstance(doc.get("entries", []), list):
        raise ValueError("not a Flight Recorder dump (no entries list)")
    return doc


def _frame_str(entry: dict[str, Any]) -> str | None:
    frames = entry.get("frames") or []
    if not frames or not isinstance(frames[0], dict):
        return None
    # Innermost is first; the user's call site is the first frame outside torch.
    for f in frames:
        if "/torch/" not in str(f.get("filename")):
            return f"{f.get('name')} ({f.get('filename')}:{f.get('line')})"
    f = frames[0]
    return f"{f.get('name')} ({f.get('filename')}:{f.get('line')})"


def summarize_fr_dump(doc: dict[str, Any]) -> dict[str, Any]:
    """Per process group: the last enqueued / started / completed collective, and the
    entries not completed yet (what the rank waits in), newest last."""
    status = doc.get("pg_status") or {}
    groups = {}
    for pg, st in status.items():
        if isinstance(st, dict):
            groups[str(pg)] = {
                k: st.get(k)
                for k in (
                    "last_enqueued_collective",
                    "last_started_collective",
                    "last_completed_collective",
                )
            }
    pending = []
    for e in doc.get("entries") or []:
        if not isinstance(e, dict):
            continue
        done = groups.get(str(e.get("pg_id")), {}).get("last_completed_collective")
        seq = e.get("collective_seq_id")
        completed = e.get("state") == "completed" or (
            isinstance(done, int) and isinstance(seq, int) and seq <= done and not e.get("is_p2p")
        )
        if completed:
            continue
        pg = e.get("process_group")
        pending.append(
            {
                "op": e.get("profiling_name"),
                "seq": seq,
                "p2p_seq": e.get("p2p_seq_id") if e.get("is_p2p") else None,
                "pg": list(pg) if isinstance(pg, (list, tuple)) else pg,
                "state": e.get("state"),
                "timeout_ms": e.get("timeout_ms"),
                "input_sizes": e.get("input_sizes"),
                "where": _frame_str(e),
            }
        )
    return {
        "version": doc.get("version"),
        "entries": len(doc.get("entries") or []),
        "groups": groups,
        "pending": pending[-FR_MAX_PENDING:],
    }


def collect_fr_dumps(prefix: str | None, *, seen: set[str] | None = None) -> list[dict[str, Any]]:
    """Summaries of the Flight Recorder files ``<prefix><rank>`` on this node. Files
    in ``seen`` are skipped, and every file read is added to it."""
    if not prefix:
        return []
    out = []
    for path in sorted(glob.glob(glob.escape(prefix) + "*"))[:FR_MAX_FILES]:
        if seen is not None and path in seen:
            continue
        tail = path[len(prefix) :]
        if not tail.isdigit():
            continue  # the dump's temp files and pipes; only finished <prefix><rank> count
        if seen is not None:
            seen.add(path)
        item: dict[str, Any] = {"file": os.path.basename(path), "rank": int(tail)}
        try:
            size = os.path.getsize(path)
            item["bytes"] = size
            if size > FR_MAX_BYTES:
                raise ValueError(f"{size} bytes is over the {FR_MAX_BYTES} read limit")
            with open(path, "rb") as f:
                item.update(summarize_fr_dump(read_fr_dump(f.read())))
        except Exception as e:  # a torn or foreign file is reported, never fatal
            item["error"] = f"{type(e).__name__}: {e}"[:500]
        out.append(item)
    return out


def fr_findings(dumps: list[dict[str, Any]]) -> list[str]:
    lines = []
    for d in dumps:
        pend = d.get("pending") or []
        if pend:
            p = pend[0]
            lines.append(
                f"rank {d['rank']} (flight recorder): {p.get('op')} seq {p.get('seq')} "
                f"not completed ({p.get('state')}), from {p.get('where')}"
            )
    return lines
