"""The agent's parts that need no service: flags, outcomes, /proc reading, the
progress board, the control file. Processes and sockets here are real."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.agent import ranks as rk
from orchestrator.agent.client import backoff_delays
from orchestrator.agent.main import (
    Agent,
    UsageError,
    json_safe,
    node_outcome,
    parse_args,
    write_control_file,
)
from orchestrator.agent.progress import ProgressBoard, ProgressListener
from orchestrator.cloud import metadata as md
from orchestrator.cloud.simulator import MetadataSimulator
from orchestrator.contract import ANOMALY_FINDINGS, AnomalyKind, Env

BASE = ["--job-id", "j", "--attempt", "1", "--node-id", "n0", "--local-dir", "/tmp/x"]


def test_flags_and_command_after_the_double_dash():
    cfg = parse_args(
        [
            *BASE,
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "4",
            "--grace-s",
            "30",
            "--launcher",
            "direct",
            "--",
            "python",
            "-m",
            "train",
            "--steps",
            "5",
        ]
    )
    assert cfg.command == ("python", "-m", "train", "--steps", "5")
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node, cfg.world_size) == (2, 1, 4, 8)
    assert cfg.grace_s == 30 and cfg.launcher == "direct" and cfg.service_url is None
    assert cfg.log_dir == Path("/tmp/x/logs") and cfg.control_file == Path("/tmp/x/control.json")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2", "--", "x"], "--node-rank must be in 0..1"),
        (["--nproc-per-node", "0", "--", "x"], "--nproc-per-node must be >= 1"),
        (["--grace-s", "0", "--", "x"], "--grace-s must be a positive number"),
        (["--poll-s", "nan", "--", "x"], "--poll-s must be a positive number"),
        (["--master-port", "70000", "--", "x"], "--master-port must be in 1..65535"),
        (["--service-url", "localhost:8470", "--", "x"], "--service-url must start with http"),
        ([], "no command"),
    ],
    ids=["node-rank", "nproc", "grace", "poll-nan", "port", "url", "no-command"],
)
def test_bad_flags_name_the_flag(extra, message):
    with pytest.raises(UsageError, match=message):
        parse_args([*BASE, *extra])


def test_bad_flags_exit_2_with_one_clear_line():
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.agent", *BASE, "--nnodes", "0", "--", "x"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "skyresume-agent: error: --nnodes must be >= 1, got 0"
    env = {k: v for k, v in os.environ.items() if k != "SKYRESUME_AGENT_TOKEN"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.agent",
            *BASE,
            "--service-url",
            "http://127.0.0.1:1",
            "--",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert out.returncode == 2 and "SKYRESUME_AGENT_TOKEN is not set" in out.stderr


def test_the_agent_imports_nothing_heavy():
    code = (
        "import sys, orchestrator.agent.main, orchestrator.cloud.metadata;"
        "heavy = {'fastapi','sqlalchemy','pydantic','torch','httpx','psutil','yaml','starlette'};"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stderr


def _rank(rank: int, code: int | None, sig: str | None = None) -> rk.Rank:
    return rk.Rank(rank=rank, local_rank=rank, pid=1, exit_code=code, signal=sig, exited=True)


@pytest.mark.parametrize(
    ("ends", "stop", "want"),
    [
        ([(0, None), (0, None)], None, 0),
        ([(75, None), (75, None)], "notice", 75),
        ([(75, None), (0, None)], None, 75),  # a peer node's stop: they saved anyway
        ([(75, None), (None, "SIGKILL")], "notice", 1),
        ([(75, None), (None, "SIGTERM")], "notice", 75),  # torchrun's teardown after a save
        ([(None, "SIGTERM"), (None, "SIGTERM")], "notice", 1),  # nobody saved
        ([(1, None), (75, None)], None, 1),
        ([(None, None)], None, 1),
        ([], "launch failed", 1),
    ],
    ids=[
        "all-0",
        "saved",
        "peer-stop",
        "killed",
        "torn-down",
        "terminated",
        "crash",
        "unknown",
        "none",
    ],
)
def test_exit_code_mirrors_how_the_ranks_ended(ends, stop, want):
    code, reason = node_outcome([_rank(i, c, s) for i, (c, s) in enumerate(ends)], stop)
    assert code == want and reason


def test_a_crash_names_the_rank_in_the_reason():
    code, reason = node_outcome([_rank(0, 75), _rank(1, None, "SIGSEGV")], "rank 1 ended")
    assert code == 1 and reason.startswith("rank 1 ended with signal SIGSEGV")


def test_proc_stat_parsing_survives_odd_process_names():
    fields = ["Z", "77", "88"] + ["0"] * 46 + ["256"]
    st = rk.parse_proc_stat("123 (a) (b c) " + " ".join(fields))
    assert st is not None and (st.ppid, st.pgid, st.state) == (77, 88, "Z")
    assert rk.decode_wait_status(st.exit_status or 0) == (1, None)
    assert rk.parse_proc_stat("garbage") is None


def _zombie(proc: subprocess.Popen) -> rk.ProcStat:
    for _ in range(400):
        st = rk.read_proc_stat(proc.pid)
        if st is not None and st.state == "Z":
            return st
        time.sleep(0.01)
    raise AssertionError(f"pid {proc.pid} never became a zombie")


def test_exit_status_is_read_from_a_zombie_before_its_parent_reaps_it():
    exited = subprocess.Popen(["sh", "-c", "exit 3"])
    killed = subprocess.Popen(["sleep", "30"])
    killed.send_signal(signal.SIGKILL)
    try:
        assert rk.decode_wait_status(_zombie(exited).exit_status or 0) == (3, None)
        assert rk.decode_wait_status(_zombie(killed).exit_status or 0) == (None, "SIGKILL")
    finally:
        exited.wait()
        killed.wait()
    assert rk.read_proc_stat(exited.pid) is None  # reaped: gone


def test_ranks_are_found_among_a_launchers_children_by_their_environment(tmp_path):
    # A stand-in for torchrun: a parent that starts two "ranks" (own sessions, RANK
    # and LOCAL_RANK in their environment) and one helper without them.
    code = (
        "import os, subprocess, time\n"
        "ps = [subprocess.Popen(['sleep', '30'], start_new_session=True,"
        " env={**os.environ, 'RANK': str(4 + i), 'LOCAL_RANK': str(i)}) for i in range(2)]\n"
        "ps.append(subprocess.Popen(['sleep', '30']))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        found = rk.discover_ranks(parent.pid)
        assert [(r.rank, r.local_rank, r.own_group) for r in found] == [(4, 0, True), (5, 1, True)]
        for r in found:
            assert rk.read_proc_stat(r.pid).ppid == parent.pid  # type: ignore[union-attr]
            rk.signal_rank(r, signal.SIGTERM)
        for r in found:
            for _ in range(300):
                if rk.poll_rank(r):
                    break
                time.sleep(0.01)
            assert r.exited
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
rank_script.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_03:40:01
  host      : box
  rank      : 3 (local_rank: 1)
  exitcode  : -15 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4242
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_03:40:00
  host      : box
  rank      : 2 (local_rank: 0)
  exitcode  : 75 (pid: 4241)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_torchrun_failure_summary_gives_every_failed_ranks_status():
    got = rk.parse_torchrun_failures(TORCHRUN_SUMMARY)
    assert got == {1: (-15, 4242), 0: (75, 4241)}
    assert rk.from_returncode(-15) == (None, "SIGTERM")


def test_log_tail_is_the_last_lines(tmp_path):
    p = tmp_path / "rank_0.log"
    p.write_text("".join(f"line {i}\n" for i in range(500)))
    tail = rk.tail_lines(p, 50)
    assert len(tail) == 50 and tail[0] == "line 450" and tail[-1] == "line 499"
    assert rk.tail_lines(tmp_path / "missing.log") == []


def test_progress_board_aggregates_and_drops_garbage():
    events = []
    board = ProgressBoard(on_event=events.append)
    assert board.ingest(b"not json") is None
    assert board.ingest(json.dumps({"type": "gossip", "rank": 0}).encode()) is None
    assert board.ingest(json.dumps({"type": "progress", "rank": -1}).encode()) is None
    board.ingest(b'{"type": "progress", "rank": 1, "step": 9, "loss": NaN, "step_time": 0.1}')
    board.ingest(
        json.dumps({"type": "resumed", "rank": 1, "step": 5, "manifest_digest": "d"}).encode()
    )
    board.ingest(json.dumps({"type": "checkpoint", "rank": 0, "step": 10, "path": "/a"}).encode())
    board.ingest(json.dumps({"type": "checkpoint", "rank": 1, "step": 20, "path": "/b"}).encode())
    assert board.dropped == 3
    p = board.snapshot(1)
    assert (p.step, p.loss, p.step_time) == (9, None, 0.1)
    assert p.resumed == {"step": 5, "manifest_digest": "d"}
    assert board.last_checkpoint() == {"step": 20, "path": "/b", "uploaded_uri": None}
    # Checkpoints become reports and a resume a heartbeat at once; progress is neither.
    assert [(e["type"], e["step"]) for e in events] == [
        ("resumed", 5), ("checkpoint", 10), ("checkpoint", 20)
    ]


def test_a_resumed_ranks_first_step_past_the_resume_is_passed_on_once():
    events = []
    board = ProgressBoard(on_event=events.append)
    step = lambda n: board.ingest(json.dumps({"type": "progress", "rank": 0, "step": n}).encode())  # noqa: E731
    step(59)  # before any resume: progress is not an event
    board.ingest(json.dumps({"type": "resumed", "rank": 0, "step": 60}).encode())
    step(60)  # the resume step itself is no new step
    step(61)
    step(62)
    assert [(e["type"], e["step"]) for e in events] == [("resumed", 60), ("progress", 61)]
    board.ingest(json.dumps({"type": "regroup", "rank": 0, "generation": 2}).encode())
    board.ingest(json.dumps({"type": "resumed", "rank": 0, "step": 62}).encode())
    step(63)  # a later resume's first step is news again
    assert [(e["type"], e.get("step")) for e in events][-2:] == [
        ("resumed", 62), ("progress", 63)
    ]


def test_datagrams_from_the_training_librarys_reporter_reach_the_listener():
    from training.progress import ProgressReporter

    board = ProgressBoard()
    listener = ProgressListener(board).start()
    try:
        rep = ProgressReporter(listener.addr, rank=3)
        rep.progress(step=4, step_time=0.5, loss=2.0, grad_norm=1.0, samples_per_s=8.0,
                     max_steps=90)  # fmt: skip
        for _ in range(200):
            if board.snapshot(3).step == 4:
                break
            time.sleep(0.01)
        assert board.snapshot(3).loss == 2.0
        assert board.snapshot(3).max_steps == 90  # where the run ends: the work left
    finally:
        listener.stop()


def test_control_file_is_merged_and_replaced_atomically(tmp_path):
    path = tmp_path / "node" / "control.json"
    write_control_file(path, {"checkpoint_every": 50, "other": 1})
    write_control_file(path, {"checkpoint_every": 20})
    assert json.loads(path.read_text()) == {"checkpoint_every": 20, "other": 1}
    assert [p.name for p in path.parent.iterdir()] == ["control.json"]  # no temp left


def _agent(tmp_path: Path, *flags: str) -> Agent:
    cfg = parse_args(
        [
            "--job-id",
            "j",
            "--attempt",
            "3",
            "--node-id",
            "n1",
            "--local-dir",
            str(tmp_path),
            *flags,
            "--",
            "python",
            "x.py",
        ]
    )
    return Agent(cfg, token="tok", environ={"PATH": "/bin", "SKYRESUME_AGENT_TOKEN": "tok"})


def test_set_checkpoint_every_writes_the_control_file_and_refuses_nonsense(tmp_path):
    agent = _agent(tmp_path)
    try:
        agent.handle_command({"seq": 1, "type": "set_checkpoint_every", "args": {"every_steps": 0}})
        assert not agent.cfg.control_file.exists()
        agent.handle_command({"seq": 2, "type": "set_checkpoint_every", "args": {"every_steps": 7}})
        assert json.loads(agent.cfg.control_file.read_text()) == {"checkpoint_every": 7}
    finally:
        agent.listener.stop()


def test_rank_env_carries_the_run_context_but_not_the_agent_token(tmp_path):
    agent = _agent(tmp_path)
    try:
        env = agent.rank_env()
        addr = agent.listener.addr
    finally:
        agent.listener.stop()
    assert "SKYRESUME_AGENT_TOKEN" not in env
    assert env[Env.NODE_ID] == "n1" and env[Env.ATTEMPT] == "3"
    assert Env.JOB_TOKEN not in env and "tok" not in env.values()  # ranks never talk to the service
    assert env[Env.PROGRESS_ADDR] == addr and addr.startswith("127.0.0.1:")
    assert env[Env.CONTROL_FILE] == str(tmp_path / "control.json")
    assert env[Env.LOCAL_CHECKPOINT_DIR] == str(tmp_path / "checkpoints")
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "90"


def test_json_safe_and_backoff():
    assert json_safe({"a": float("nan"), "b": [1, float("inf")], "c": (2,)}) == {
        "a": None,
        "b": [1, None],
        "c": [2],
    }
    delays = backoff_delays(base=0.1, cap=1.0, jitter=0.0)
    assert [round(next(delays), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_torchrun_is_told_never_to_restart_and_to_log_per_rank():
    argv = rk.torchrun_argv(
        ["python", "t.py"],
        nnodes=2,
        node_rank=1,
        nproc=4,
        master_addr="10.0.0.1",
        master_port=29600,
        log_dir=Path("/l"),
    )
    assert "--max-restarts=0" in argv and "--redirects=3" in argv and "--log-dir=/l" in argv
    assert argv[-2:] == [sys.executable, "t.py"]  # python -> this interpreter


def test_agent_sigterm_without_a_service_stops_ranks_and_exits_75(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "AGENT_TEST_MARKS": str(marks)}
    script = Path(__file__).with_name("rank_script.py")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.agent",
            "--job-id",
            "j",
            "--attempt",
            "1",
            "--node-id",
            "n0",
            "--nproc-per-node",
            "3",
            "--launcher",
            "direct",
            "--local-dir",
            str(tmp_path / "node"),
            "--",
            "python",
            str(script),
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    logs = tmp_path / "node" / "logs"
    paths = [logs / f"rank_{i}.log" for i in range(3)]
    for _ in range(500):
        if all(p.exists() and "up" in p.read_text() for p in paths):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert sorted(p.name for p in marks.iterdir()) == ["sigterm_0", "sigterm_1", "sigterm_2"]
    assert "ranks saved and stopped (agent received SIGTERM)" in err


@pytest.mark.parametrize("kind", list(AnomalyKind), ids=str)
def test_each_anomaly_a_rank_sends_is_reported_as_a_finding_the_service_records(tmp_path, kind):
    # The rank's kind, the agent's finding, the API's accepted findings and the store's
    # failure classes are four readers of one list: a kind dropped by any of them is an
    # anomaly the reconciler never sees (the agent logs it; the API answers 422).
    from pydantic import TypeAdapter

    from orchestrator.api.routes_agents import Report
    from orchestrator.domain.failures import FailureClass
    from orchestrator.store.agents import _event_fields

    agent = _agent(tmp_path)
    sent: list[dict] = []
    agent.report = lambda k, key, **f: sent.append({"key": key, "kind": k, **f})  # type: ignore[method-assign]
    try:
        agent._on_datagram({"type": "anomaly", "rank": 1, "kind": kind.value, "step": 7})
    finally:
        agent.listener.stop()
    [doc] = sent
    assert doc["finding"] == ANOMALY_FINDINGS[kind]
    report = TypeAdapter(Report).validate_python(doc).model_dump()
    assert FailureClass(_event_fields("anomaly", report)["failure_class"]) == doc["finding"]


def test_a_datagram_of_an_unknown_anomaly_kind_is_not_reported(tmp_path):
    agent = _agent(tmp_path)
    sent: list[dict] = []
    agent.report = lambda k, key, **f: sent.append(f)  # type: ignore[method-assign]
    try:
        agent._on_datagram({"type": "anomaly", "rank": 1, "kind": "meh", "step": 7})
    finally:
        agent.listener.stop()
    assert sent == []


#: The notices the simulator serves that leave the VM running (its GCP maintenance is
#: TERMINATE_ON_HOST_MAINTENANCE, which ends spot and GPU VMs).
WARNINGS_ONLY = {("aws", "rebalance"), ("azure", "freeze")}


@pytest.mark.parametrize(
    "provider, kind",
    [(p.value, k.value) for p in md.Provider for k in sorted(md.NOTICE_KINDS[p])],
    ids=lambda v: str(v),
)
def test_the_agent_acts_on_a_notice_that_ends_the_vm_and_only_logs_a_warning(
    tmp_path, caplog, provider, kind
):
    class StopOnWarning(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("advisory notice"):
                warned.append(record.getMessage())
                agent._exit.set()  # the loop would poll on: the warning was logged

    warned: list[str] = []
    acted: list[md.Notice] = []
    handler = StopOnWarning()
    caplog.set_level(logging.INFO, logger="skyresume.agent")  # the warning is logged at INFO
    logging.getLogger("skyresume.agent").addHandler(handler)
    with MetadataSimulator(providers=(provider,)) as sim:
        sim.schedule_notice("n1", provider, kind, 120)
        agent = _agent(
            tmp_path,
            "--provider",
            provider,
            "--metadata-url",
            sim.node_url("n1"),
            "--poll-s",
            "0.05",
        )
        agent.on_notice = acted.append  # type: ignore[method-assign]
        try:
            loop = threading.Thread(target=agent._metadata_loop, daemon=True)
            loop.start()
            loop.join(30)
            assert not loop.is_alive(), "the metadata loop neither acted nor logged a warning"
        finally:
            agent._exit.set()
            agent.listener.stop()
            logging.getLogger("skyresume.agent").removeHandler(handler)
    if (provider, kind) in WARNINGS_ONLY:
        assert acted == [] and kind in warned[0]
    else:
        assert [(n.provider, n.kind) for n in acted] == [(provider, kind)] and warned == []


def test_a_reaped_ranks_exit_datagram_read_late_still_gives_its_code(tmp_path):
    """torchrun reaped the rank before the agent saw its status, and the rank's ``exit``
    datagram is still on its way through the listener (a loaded node, seen in CI: a
    rank that saved was reported with exit code None): the agent waits for it."""
    import threading

    from orchestrator.agent.main import Agent, parse_args

    cfg = parse_args([
        "--job-id", "j", "--attempt", "1", "--node-id", "j-a1-n0", "--node-rank", "0",
        "--nnodes", "1", "--nproc-per-node", "1", "--local-dir", str(tmp_path),
        "--service-url", "http://127.0.0.1:9", "--", "python", "x.py",
    ])  # fmt: skip
    a = Agent(cfg, token="t", environ={"PATH": "/bin"})
    try:
        a.ranks = [rk.Rank(rank=0, local_rank=0, pid=4242)]
        a.ranks[0].exited = True  # gone, status unknown: torchrun reaped it

        class Torchrun:
            def wait(self, timeout=None):  # type: ignore[no-untyped-def]
                return 1  # torchrun's own code, and its log lists no failed rank

        a.torchrun = Torchrun()  # type: ignore[assignment]
        late = threading.Timer(0.3, a.board.ingest, [b'{"type": "exit", "rank": 0, "code": 75}'])
        late.start()
        a._settle_torchrun()
        assert (a.ranks[0].exit_code, a.ranks[0].status_known) == (75, True)
    finally:
        a.listener.stop()
