"""Evidence before the kill (orchestrator/agent/evidence.py).

The stack texts under ``data/`` are real output captured on this machine (py-spy
0.4.3, torch 2.13 CPU, Python 3.11): a 2-rank gloo job where rank 1 sleeps and rank 0
waits in ``all_reduce`` (``pyspy_gloo_*``), a DDP job whose rank 0 waits in backward
(``pyspy_ddp_backward``), a SIGSTOPped rank read with and without ``--nonblocking``
(``pyspy_stopped_*``), a rank waiting on an async ``Work`` with a second thread, and
a faulthandler SIGUSR2 dump. ``fr_gloo_pending_rank_0`` is a real Flight Recorder
dump (``torch._C._distributed_c10d._dump_fr_trace()`` on gloo while rank 0's
all_reduce waited for a sleeping peer); NCCL writes the same format on a timeout,
which this machine cannot produce (no GPU), so that test covers the collection only.
The live tests capture from real processes.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

from orchestrator.agent import evidence as ev
from orchestrator.store import agents

DATA = Path(__file__).resolve().parent / "data"
PY_SPY = ev.find_py_spy()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed")


def text(name: str) -> str:
    return (DATA / name).read_text()


# --- parsing and the "stuck in" finder, on real output ---------------------------------


@pytest.mark.parametrize(
    ("fixture", "op", "where", "caller"),
    [
        pytest.param(
            "pyspy_gloo_all_reduce.txt",
            "all_reduce",
            "all_reduce (torch/distributed/distributed_c10d.py:3252)",
            "<module> (gloo_hang.py:11)",
            id="gloo-all-reduce",
        ),
        pytest.param(
            "pyspy_native_all_reduce.txt",
            "all_reduce",
            "all_reduce (torch/distributed/distributed_c10d.py:3252)",
            "<module> (gloo_hang.py:11)",
            id="native-frames-skipped",
        ),
        pytest.param(
            "pyspy_ddp_backward.txt",
            "backward",
            "_engine_run_backward (torch/autograd/graph.py:979)",
            "<module> (ddp_bw.py:10)",
            id="ddp-backward",
        ),
        pytest.param(
            "pyspy_gloo_peer_sleeping.txt", None, "<module> (gloo_hang.py:10)", None, id="peer"
        ),
        pytest.param(
            "pyspy_work_wait_two_threads.txt",
            None,
            "<module> (ddp_hang.py:22)",
            None,
            id="main-thread",
        ),
        pytest.param(
            "pyspy_stopped_nonblocking.txt",
            None,
            "<module> (ddp_bw.py:9)",
            None,
            id="stopped-rank",
        ),
    ],
)
def test_py_spy_stacks_name_the_collective_a_rank_waits_in(fixture, op, where, caller):
    threads = ev.parse_py_spy(text(fixture))
    assert threads and ev.main_thread(threads).name == "MainThread"
    stuck = ev.find_stuck(threads)
    assert stuck.op == op
    assert str(stuck.frame) == where
    assert (str(stuck.caller) if stuck.caller else None) == caller


def test_the_main_thread_is_read_not_a_helper_thread():
    threads = ev.parse_py_spy(text("pyspy_work_wait_two_threads.txt"))
    assert [t.name for t in threads] == ["MainThread", "prefetch"]
    assert threads[1].frames[0] == ev.Frame("loader_like", "ddp_hang.py", 10)


def test_a_failed_py_spy_dump_yields_no_threads():
    # py-spy's blocking dump of a SIGSTOPped rank: "Failed to suspend process".
    assert ev.parse_py_spy(text("pyspy_stopped_blocking.txt")) == []


def test_faulthandler_dumps_parse_and_the_rank_output_around_them_is_ignored():
    raw = text("faulthandler_sigusr2.txt")
    threads = ev.parse_faulthandler(raw)
    assert len(threads) == 2
    main = ev.main_thread(threads)
    assert main.name == "Current thread" and main.frames[-1].func == "<module>"
    assert ev.find_stuck(threads).frame == ev.Frame("inner", "/tmp/ev/fh.py", 6)
    # A later dump in the same log wins; the training output between them is not a frame.
    later = (
        raw
        + "step 12 loss 1.3\n"
        + raw.split("\n", 1)[1].replace("line 6 in inner", "line 7 in inner")
    )
    assert ev.find_stuck(ev.parse_faulthandler(later)).frame.line == 7


def test_summary_names_the_stopped_rank_and_the_one_outside_the_collective():
    stuck = ev.find_stuck(ev.parse_py_spy(text("pyspy_gloo_all_reduce.txt")))
    peer = ev.find_stuck(ev.parse_py_spy(text("pyspy_gloo_peer_sleeping.txt")))
    ranks = [
        {"rank": 0, "state": "S", "op": stuck.op, "where": str(stuck.frame),
         "called_from": str(stuck.caller)},
        {"rank": 1, "state": "S", "op": peer.op, "where": str(peer.frame)},
        {"rank": 2, "state": "T", "op": None, "where": "<module> (train.py:9)"},
        {"rank": 3, "state": None},
        {"rank": 4, "state": "T", "op": "barrier", "where": "barrier (x)",
         "called_from": "save (train.py:40)"},
    ]  # fmt: skip
    lines = ev.summarize(ranks)
    assert lines[:5] == [
        "rank 0 waits in all_reduce at all_reduce (torch/distributed/distributed_c10d.py:3252), "
        "called from <module> (gloo_hang.py:11)",
        "rank 1 is not in a collective: <module> (gloo_hang.py:10)",
        "rank 2 is stopped (state T) at <module> (train.py:9)",
        "rank 3 had exited before the capture",
        "rank 4 is stopped (state T) inside barrier, called from save (train.py:40)",
    ]
    assert "suspect: rank(s) 2, 4 stopped (SIGSTOP or a debugger)" in lines
    assert (
        "suspect: rank(s) 1 outside any collective while rank(s) 0, 4 wait in all_reduce, barrier"
        in lines
    )


def test_truncation_keeps_the_head_and_says_how_much_was_cut():
    cut, was = ev.truncate("x" * 100_000, 1000)
    assert was and len(cut) <= 1000 and cut.startswith("xxx")
    assert cut.endswith("more characters]")
    assert ev.truncate("short", 1000) == ("short", False)
    # The agent's caps are the ones the service enforces.
    assert ev.STACK_CAP_CHARS == agents.EVIDENCE_STACK_CAP
    assert ev.REPORT_STACK_CAP_CHARS == agents.EVIDENCE_REPORT_CAP


# --- Flight Recorder collection ---------------------------------------------------------


def test_flight_recorder_dump_on_the_node_is_summarized_with_its_pending_collective(tmp_path):
    prefix = str(tmp_path / "nccl_trace" / "rank_")
    (tmp_path / "nccl_trace").mkdir()
    Path(prefix + "0").write_bytes((DATA / "fr_gloo_pending_rank_0").read_bytes())
    Path(prefix + "1.pipe").write_text("")  # not a dump: skipped
    seen: set[str] = set()
    (dump,) = ev.collect_fr_dumps(prefix, seen=seen)
    assert dump["rank"] == 0 and dump["entries"] == 9 and "error" not in dump
    assert dump["groups"]["0"]["last_enqueued_collective"] == 9
    assert dump["groups"]["0"]["last_completed_collective"] == 8
    (pending,) = dump["pending"]
    assert pending["op"] == "gloo:all_reduce" and pending["seq"] == 9
    assert pending["where"] == "<module> (/tmp/ev/ddp_hang.py:18)"
    assert ev.fr_findings([dump]) == [
        "rank 0 (flight recorder): gloo:all_reduce seq 9 not completed (scheduled), "
        "from <module> (/tmp/ev/ddp_hang.py:18)"
    ]
    assert ev.collect_fr_dumps(prefix, seen=seen) == []  # each file is reported once


def test_a_dump_that_names_a_global_is_refused_not_loaded(tmp_path):
    prefix = str(tmp_path / "rank_")
    Path(prefix + "3").write_bytes(pickle.dumps({"entries": [], "x": os.system}))
    Path(prefix + "4").write_bytes(b"torn")
    got = {d["rank"]: d for d in ev.collect_fr_dumps(prefix)}
    assert "refusing global" in got[3]["error"]
    assert got[4]["error"]


# --- live processes ---------------------------------------------------------------------

SLEEPER = (
    "import faulthandler, os, signal, sys, time\n"
    "if os.environ.get('FH'): faulthandler.register(signal.SIGUSR2, all_threads=True)\n"
    "def wait_here():\n"
    "    time.sleep(600)\n"
    "print('up', flush=True)\n"
    "wait_here()\n"
)


def _sleeper(tmp_path: Path, *, faulthandler: bool) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "rank.log"
    env = {**os.environ, "FH": "1" if faulthandler else ""}
    with log.open("wb") as out:
        p = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=out, stderr=out, env=env)
    end = time.monotonic() + 20
    while "up" not in log.read_text() and time.monotonic() < end:
        time.sleep(0.05)
    return p, log


@needs_py_spy
def test_a_sigstopped_rank_is_read_without_ptrace_and_said_to_be_stopped(tmp_path):
    p, log = _sleeper(tmp_path, faulthandler=False)
    try:
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        got = ev.capture_rank(
            ev.RankTarget(1, 1, p.pid, log), py_spy=PY_SPY, deadline=time.monotonic() + 10
        )
        assert got["state"] == "T" and got["tool"] == "py-spy --nonblocking"
        assert got["where"] == "wait_here (<string>:4)"
        assert ev.describe_rank(got).startswith("rank 1 is stopped (state T)")
        assert ev.proc_state(p.pid)[0] == "T"  # reading it did not resume it
    finally:
        p.kill()
        p.wait()


def test_without_py_spy_faulthandler_is_used_only_where_a_handler_is_installed(tmp_path):
    with_fh, log = _sleeper(tmp_path, faulthandler=True)
    (tmp_path / "b").mkdir()
    bare, bare_log = _sleeper(tmp_path / "b", faulthandler=False)
    try:
        assert ev.catches_signal(with_fh.pid, signal.SIGUSR2)
        assert not ev.catches_signal(bare.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        got = ev.capture_rank(ev.RankTarget(0, 0, with_fh.pid, log), py_spy=None, deadline=deadline)
        assert got["tool"] == "faulthandler", got
        assert got["where"].startswith("wait_here (<string>:4")
        assert "most recent call first" in got["stack"]
        none = ev.capture_rank(
            ev.RankTarget(1, 1, bare.pid, bare_log), py_spy=None, deadline=deadline
        )
        assert none["tool"] is None and "no SIGUSR2 handler" in none["error"]
        assert bare.poll() is None  # SIGUSR2 was never sent: its default action kills
        assert with_fh.poll() is None
    finally:
        for p in (with_fh, bare):
            p.kill()
            p.wait()


GLOO_HANG = """
import os, time, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=300))
t = torch.ones(4)
dist.all_reduce(t)
print(f"ready {os.getpid()}", flush=True)
if dist.get_rank() == 1:
    time.sleep(300)
dist.all_reduce(t)
"""


@needs_py_spy
@pytest.mark.slow
def test_live_gloo_job_rank_waiting_in_all_reduce_and_its_sleeping_peer(tmp_path):
    """A real 2-rank gloo job: rank 1 sleeps, rank 0 waits in all_reduce."""
    script = tmp_path / "hang.py"
    script.write_text(GLOO_HANG)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    env["MASTER_PORT"] = str(free_port())
    procs, logs = [], []
    for r in range(2):
        logs.append(tmp_path / f"r{r}.log")
        with logs[-1].open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=out,
                    stderr=out,
                )
            )
    try:
        end = time.monotonic() + 90
        while not all("ready" in lg.read_text() for lg in logs):
            assert time.monotonic() < end, [lg.read_text() for lg in logs]
            assert all(p.poll() is None for p in procs), [lg.read_text() for lg in logs]
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 is now inside its second all_reduce
        t0 = time.monotonic()
        got = ev.capture_stacks([ev.RankTarget(r, r, p.pid, logs[r]) for r, p in enumerate(procs)])
        took = time.monotonic() - t0
        assert took < ev.CAPTURE_BUDGET_S
        by = {g["rank"]: g for g in got}
        assert by[0]["op"] == "all_reduce" and by[0]["tool"] == "py-spy"
        assert by[0]["where"].startswith("all_reduce (torch/distributed/distributed_c10d.py:")
        assert by[0]["called_from"] == "<module> (hang.py:10)"
        assert by[1]["op"] is None and by[1]["where"] == "<module> (hang.py:9)"
        assert "suspect: rank(s) 1 outside any collective while rank(s) 0 wait in all_reduce" in (
            ev.summarize(got)
        )
    finally:
        for p in procs:
            p.kill()
            p.wait()
