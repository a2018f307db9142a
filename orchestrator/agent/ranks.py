"""Starting a node's ranks, finding their pids, and learning how each one ended.

Two launchers:

* ``torchrun``: ``python -m torch.distributed.run --max-restarts 0 ... --no-python
  <command>``. torchrun is the ranks' parent, so the agent cannot ``waitpid`` them;
  it finds them among torchrun's children in ``/proc`` (``RANK``/``LOCAL_RANK`` from
  ``/proc/<pid>/environ``) and learns each exit status in this order:
  1. the zombie's ``/proc/<pid>/stat`` (field 52 is the ``waitpid`` status, readable
     until torchrun reaps it; torchrun is run with ``--monitor-interval 0.5`` so the
     agent, polling every 50 ms, nearly always sees it first);
  2. torchrun's failure summary in its own log (``exitcode : N (pid: P)``) when it
     exits — it lists every rank that ended non-zero, so a rank it does not list
     exited 0;
  3. the rank's ``exit`` datagram (best effort, sent just before a deliberate exit).
* ``direct``: the agent spawns ``--nproc-per-node`` processes itself with the
  variables torchrun would set. No torch needed; used by the fan-out benchmark and
  the fast tests. Ranks stay in the agent's process group, so killing the node's
  group kills them.

Per-rank logs: torchrun writes ``<log-dir>/torchrun/<run>/attempt_0/<local_rank>/
{stdout,stderr}.log`` (``--redirects 3``); the direct launcher writes
``<log-dir>/rank_<local_rank>.log``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

#: Lines of a rank's log sent with its rank_exit report.
LOG_TAIL_LINES = 50
#: How often torchrun looks at its workers: slower than the agent's 50 ms rank
#: watcher so the agent reads each exit status from the zombie before torchrun reaps.
TORCHRUN_MONITOR_INTERVAL_S = 0.5


@dataclass
class Rank:
    rank: int
    local_rank: int
    pid: int
    proc: subprocess.Popen[bytes] | None = None
    """Set by the direct launcher (the agent is the parent)."""
    own_group: bool = False
    """The rank leads its own process group (torchrun starts each in a new session)."""
    start_time: int = 0
    """Start time from /proc (clock ticks): a pid with another start time was reused."""
    exit_code: int | None = None
    signal: str | None = None
    exited: bool = False
    status_known: bool = False
    reported: bool = False
    killed_by_agent: bool = False
    """SIGKILLed by the agent because it outlived the grace period after SIGTERM."""
    cpu_ticks: int | None = None
    """utime + stime at the last sample (``cpu_ticks``)."""
    cpu_moved_at: float | None = None
    """time.monotonic() of the sample at which ``cpu_ticks`` last grew."""
    log_paths: list[Path] = field(default_factory=list)


def python_command(command: list[str]) -> list[str]:
    """``python``/``python3`` at the front becomes this interpreter, so ranks run in the
    agent's environment whatever PATH says."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def decode_wait_status(status: int) -> tuple[int | None, str | None]:
    """(exit code, signal name) from a ``waitpid`` status word."""
    if os.WIFSIGNALED(status):
        return None, _signal_name(os.WTERMSIG(status))
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def from_returncode(code: int) -> tuple[int | None, str | None]:
    """(exit code, signal name) from a Popen/torchrun return code (-N = signal N)."""
    if code < 0:
        return None, _signal_name(-code)
    return code, None


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"SIG{num}"


@dataclass(frozen=True)
class ProcStat:
    ppid: int
    pgid: int
    state: str
    start_time: int
    exit_status: int | None
    """The waitpid status of a zombie (field 52), else None."""


def read_proc_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    """None when the process is gone (reaped) or unreadable."""
    try:
        raw = Path(f"{proc}/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    return parse_proc_stat(raw)


def parse_proc_stat(raw: str) -> ProcStat | None:
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    _, sep, rest = raw.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 3:
        return None
    state = fields[0]
    exit_status = None
    if state == "Z" and len(fields) >= 50:
        exit_status = int(fields[49])
    start = int(fields[19]) if len(fields) > 19 else 0
    return ProcStat(int(fields[1]), int(fields[2]), state, start, exit_status)


def cpu_ticks(pid: int, proc: str = "/proc") -> int | None:
    """The CPU time (user + system, clock ticks) a live process has used, from
    ``/proc/<pid>/stat`` fields 14 and 15; None when it is gone or unreadable. The
    work a rank that sends no progress reports shows."""
    try:
        raw = Path(f"{proc}/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rpartition(")")[2].split()
    try:
        return int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def read_environ(pid: int, proc: str = "/proc") -> dict[str, str]:
    try:
        raw = Path(f"{proc}/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def children_of(ppid: int, proc: str = "/proc") -> list[int]:
    """Pids whose parent is ``ppid`` (a scan of /proc; works without CONFIG_PROC_CHILDREN)."""
    out = []
    with contextlib.suppress(OSError):
        for name in os.listdir(proc):
            if not name.isdigit():
                continue
            st = read_proc_stat(int(name), proc)
            if st is not None and st.ppid == ppid:
                out.append(int(name))
    return out


def discover_ranks(parent_pid: int, proc: str = "/proc") -> list[Rank]:
    """The ranks among ``parent_pid``'s children: those whose environment has RANK and
    LOCAL_RANK (a child forked but not yet exec'd still has torchrun's env: skipped)."""
    found = []
    for pid in children_of(parent_pid, proc):
        env = read_environ(pid, proc)
        try:
            rank, local = int(env["RANK"]), int(env["LOCAL_RANK"])
        except (KeyError, ValueError):
            continue
        st = read_proc_stat(pid, proc)
        own = st is not None and st.pgid == pid
        found.append(
            Rank(
                rank=rank,
                local_rank=local,
                pid=pid,
                own_group=own,
                start_time=st.start_time if st else 0,
            )
        )
    return sorted(found, key=lambda r: r.local_rank)


_SUMMARY_RE = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)"
)


def parse_torchrun_failures(text: str) -> dict[int, tuple[int, int]]:
    """{local_rank: (exitcode, pid)} from torchrun's ChildFailedError summary.
    torchrun writes -N for a rank killed by signal N."""
    out = {}
    for m in _SUMMARY_RE.finditer(text):
        out[int(m.group(2))] = (int(m.group(3)), int(m.group(4)))
    return out


def tail_lines(path: Path, n: int = LOG_TAIL_LINES, max_bytes: int = 256 * 1024) -> list[str]:
    """The last ``n`` lines of a text file (reading at most its last ``max_bytes``)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines: deque[str] = deque(maxlen=n)
    for line in data.decode("utf-8", "replace").splitlines():
        lines.append(line[:4000])
    return list(lines)


def rank_log_tail(rank: Rank, n: int = LOG_TAIL_LINES) -> list[str]:
    """The tail of a rank's log: stderr last (tracebacks live there), topped up with
    stdout when stderr is short."""
    tails = [tail_lines(p, n) for p in rank.log_paths]
    merged: list[str] = []
    for t in tails:  # log_paths are ordered stdout first, stderr last
        merged.extend(t)
    return merged[-n:]


def torchrun_log_paths(log_root: Path, local_rank: int) -> list[Path]:
    """stdout.log, stderr.log of a local rank under torchrun's --log-dir (newest run)."""
    runs = sorted(log_root.glob(f"*/attempt_*/{local_rank}"), key=lambda p: p.stat().st_mtime)
    if not runs:
        return []
    d = runs[-1]
    return [d / "stdout.log", d / "stderr.log"]


def torchrun_argv(
    command: list[str],
    *,
    nnodes: int,
    node_rank: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    log_dir: Path,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        # skyresume owns restarts: torchrun must never restart workers by itself.
        "--max-restarts=0",
        f"--monitor-interval={TORCHRUN_MONITOR_INTERVAL_S}",
        f"--log-dir={log_dir}",
        "--redirects=3",
        "--no-python",
        *python_command(command),
    ]


def start_torchrun(argv: list[str], env: dict[str, str], log_file: Path) -> subprocess.Popen[bytes]:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def start_direct(
    command: list[str],
    env: dict[str, str],
    *,
    nnodes: int,
    node_rank: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    log_dir: Path,
) -> list[Rank]:
    """Spawn ``nproc`` ranks with the variables torchrun sets."""
    log_dir.mkdir(parents=True, exist_ok=True)
    argv = python_command(command)
    world = nnodes * nproc
    ranks = []
    for local in range(nproc):
        rank = node_rank * nproc + local
        renv = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "GROUP_RANK": str(node_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        path = log_dir / f"rank_{local}.log"
        with path.open("ab") as out:
            proc = subprocess.Popen(argv, env=renv, stdout=out, stderr=subprocess.STDOUT)
        ranks.append(Rank(rank=rank, local_rank=local, pid=proc.pid, proc=proc, log_paths=[path]))
    return ranks


def signal_rank(rank: Rank, sig: int) -> None:
    """Signal one rank; a rank that leads its own group is signalled with its group
    (its data-loader workers and checkpoint helpers), as torchrun does."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if rank.own_group:
            os.killpg(rank.pid, sig)
        else:
            os.kill(rank.pid, sig)


def poll_rank(rank: Rank) -> bool:
    """Update ``rank`` if it has exited; True when it exited just now."""
    if rank.exited:
        return False
    if rank.proc is not None:
        code = rank.proc.poll()
        if code is None:
            return False
        rank.exit_code, rank.signal = from_returncode(code)
        rank.exited = rank.status_known = True
        return True
    st = read_proc_stat(rank.pid)
    if st is not None and rank.start_time and st.start_time != rank.start_time:
        st = None  # reaped, and the pid reused by another process
    if st is not None and st.state not in ("Z", "X"):
        return False
    rank.exited = True
    if st is not None and st.exit_status is not None:
        rank.exit_code, rank.signal = decode_wait_status(st.exit_status)
        rank.status_known = True
    return True
