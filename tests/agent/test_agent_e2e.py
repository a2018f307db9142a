"""The real agent against a real ``skyresume serve`` and the metadata simulator.

Each test starts ``python -m orchestrator.agent`` (the ``skyresume-agent`` entry
point) with tiny stdlib ranks (``rank_script.py``) and checks what the service
recorded. Waits poll with generous ceilings; nothing asserts on speed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RANK_SCRIPT, Service, add_attempt

from orchestrator.api.auth import job_token
from orchestrator.cloud.simulator import MetadataSimulator
from orchestrator.store import agents
from orchestrator.store.models import Checkpoint


@pytest.fixture(scope="module")
def sim() -> Iterator[MetadataSimulator]:
    with MetadataSimulator() as s:
        yield s


def wait_for(what: str, pred: Callable[[], Any], timeout: float = 30.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"gave up after {timeout:.0f} s waiting for: {what}")


class AgentRun:
    def __init__(self, proc: subprocess.Popen[str], marks: Path, log: Path) -> None:
        self.proc, self.marks, self.log = proc, marks, log

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"agent still running; its log:\n{self.log.read_text()}") from None

    def sigtermed(self) -> list[str]:
        return sorted(p.name for p in self.marks.iterdir())


@pytest.fixture
def start_agent(tmp_path: Path, service: Service) -> Iterator[Callable[..., AgentRun]]:
    runs: list[AgentRun] = []

    def start(
        job_id: str,
        *,
        node: str = "n0",
        attempt: int = 1,
        nproc: int = 2,
        launcher: str = "direct",
        flags: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> AgentRun:
        marks = tmp_path / f"marks-{node}"
        marks.mkdir()
        log = tmp_path / f"agent-{node}.log"
        full_env = {
            **os.environ,
            "SKYRESUME_AGENT_TOKEN": job_token(service.token, job_id, attempt),
            "AGENT_TEST_MARKS": str(marks),
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            **(env or {}),
        }
        argv = [
            sys.executable, "-m", "orchestrator.agent",
            "--service-url", service.url, "--job-id", job_id, "--attempt", str(attempt),
            "--node-id", node, "--nproc-per-node", str(nproc), "--launcher", launcher,
            "--local-dir", str(tmp_path / node), "--heartbeat-s", "0.2", "--poll-s", "0.2",
            *flags, "--", "python", str(RANK_SCRIPT),
        ]  # fmt: skip
        with log.open("w") as out:
            # Its own session: the node is one process group (agent + direct ranks),
            # so a failed test can kill all of it.
            proc = subprocess.Popen(
                argv, env=full_env, stderr=out, stdout=out, text=True, start_new_session=True
            )
        run = AgentRun(proc, marks, log)
        runs.append(run)
        return run

    yield start
    for run in runs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait()


def node_row(service: Service, job_id: str, node: str = "n0") -> Any:
    with service.sessionmaker() as s:
        return next((n for n in agents.list_nodes(s, job_id) if n.node_id == node), None)


def training(service: Service, job_id: str, nproc: int = 2) -> Callable[[], bool]:
    """The node heartbeats with every rank alive and past step 1."""

    def check() -> bool:
        n = node_row(service, job_id)
        ranks = (n.progress or {}).get("ranks", []) if n else []
        return (
            n is not None
            and n.state == "running"
            and len(ranks) == nproc
            and all(r["alive"] and (r["step"] or 0) > 1 for r in ranks)
        )

    return check


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


def test_notice_sigterms_every_rank_and_the_service_records_it(service, sim, start_agent):
    job = service.new_job()
    run = start_agent(job, flags=("--provider", "aws", "--metadata-url", sim.node_url(f"{job}-n0")))
    wait_for("heartbeats with both ranks training", training(service, job))

    r = httpx.post(
        f"{sim.url}/admin/nodes/{job}-n0/notice",
        json={"provider": "aws", "kind": "terminate", "in_seconds": 120},
    )
    assert r.status_code == 200
    assert run.wait() == 75, run.log.read_text()
    assert run.sigtermed() == ["sigterm_0", "sigterm_1"]

    events = service.events(job)
    notice = next(e for e in events if e["kind"] == "preemption_notice")
    assert notice["failure_class"] == "preemption_notice"
    assert (
        notice["details"]["provider"] == "aws" and notice["details"]["notice_kind"] == "terminate"
    )
    exits = [e for e in events if e["kind"] == "rank_exit"]
    assert sorted((e["rank"], e["details"]["exit_code"], e["failure_class"]) for e in exits) == [
        (0, 75, None),
        (1, 75, None),
    ]
    assert "stop requested" in exits[0]["details"]["log_tail"][-1]
    (node_exit,) = [e for e in events if e["kind"] == "node_exit"]
    assert node_exit["details"]["exit_code"] == 75
    assert kinds(events).index("preemption_notice") < kinds(events).index("node_exit")
    assert node_row(service, job).state == "exited"
    with service.sessionmaker() as s:
        (ck,) = s.query(Checkpoint).filter_by(job_id=job).all()
        assert ck.status == "complete" and ck.world_size == 2


def test_checkpoint_and_stop_sigkills_a_rank_that_outlives_the_grace(service, start_agent):
    job = service.new_job()
    run = start_agent(job, env={"AGENT_TEST_IGNORE_TERM": "1"}, flags=("--grace-s", "90"))
    wait_for("both ranks training", training(service, job))
    with service.sessionmaker() as s, s.begin():
        agents.enqueue_command(s, job, 1, "checkpoint_and_stop", {"reason": "test", "grace_s": 1.5})
    # The command's 1.5 s grace, not the agent's 90 s, decides when SIGKILL comes.
    assert run.wait(timeout=30) == 1
    assert run.sigtermed() == ["sigterm_0"]  # rank 1 ignored it
    exits = {e["rank"]: e for e in service.events(job) if e["kind"] == "rank_exit"}
    assert exits[0]["details"]["exit_code"] == 75 and exits[0]["failure_class"] is None
    assert exits[1]["details"]["signal"] == "SIGKILL" and exits[1]["details"]["killed_by_agent"]
    assert exits[1]["failure_class"] == "checkpoint_io"
    node = node_row(service, job)
    assert node.progress["acked_command"] is not None


def test_a_crashing_rank_is_reported_classified_with_its_log_tail(service, start_agent):
    job = service.new_job()
    run = start_agent(job, env={"AGENT_TEST_CRASH": "1:30"})
    assert run.wait() == 1
    assert run.sigtermed() == ["sigterm_0"]  # the survivor was stopped, and saved
    exits = {e["rank"]: e for e in service.events(job) if e["kind"] == "rank_exit"}
    crash = exits[1]
    # An ordinary Python error raised from the script's own frame: the user's bug (a
    # bare RuntimeError is torch's word for everything, so it alone would be unknown).
    assert crash["details"]["exit_code"] == 1 and crash["failure_class"] == "user_code_error"
    assert crash["details"]["log_tail"][-1] == "ValueError: rank 1 hit a bug at step 30"
    assert exits[0]["details"]["exit_code"] == 75
    (node_exit,) = [e for e in service.events(job) if e["kind"] == "node_exit"]
    assert node_exit["details"]["reason"].startswith("rank 1 ended with exit code 1")


def test_a_409_stops_the_ranks_and_the_agent(service, start_agent):
    job = service.new_job()
    run = start_agent(job)
    wait_for("both ranks training", training(service, job))
    add_attempt(service.sessionmaker, job, 2)  # the service moved on
    assert run.wait() == 75
    assert run.sigtermed() == ["sigterm_0", "sigterm_1"]
    assert "409" in run.log.read_text()
    (node_exit,) = [e for e in service.events(job) if e["kind"] == "node_exit"]
    assert "superseded" in node_exit["details"]["reason"]


def test_training_goes_on_while_the_service_crashes_and_restarts(service, start_agent):
    job = service.new_job()
    run = start_agent(job)
    wait_for("both ranks training", training(service, job))
    service.stop(crash=True)
    try:
        time.sleep(1.0)  # several missed heartbeats and a broken long-poll
        assert run.proc.poll() is None and run.sigtermed() == []
    finally:
        service.start()
    before = node_row(service, job).last_heartbeat_at
    wait_for("heartbeats again", lambda: node_row(service, job).last_heartbeat_at != before)
    with service.sessionmaker() as s, s.begin():
        agents.enqueue_command(s, job, 1, "stop", {"reason": "done"})
    assert run.wait() == 75
    assert "service unreachable" in run.log.read_text()


@pytest.mark.slow
def test_torchrun_ranks_are_found_by_pid_and_get_the_sigterm(service, sim, start_agent):
    job = service.new_job()
    node = f"{job}-n0"
    run = start_agent(
        job,
        launcher="torchrun",
        flags=("--provider", "gcp", "--metadata-url", sim.node_url(node), "--grace-s", "20"),
    )
    wait_for("torchrun ranks training", training(service, job), timeout=90)
    ranks = node_row(service, job).progress["ranks"]
    for r in ranks:
        environ = Path(f"/proc/{r['pid']}/environ").read_bytes().split(b"\0")
        assert f"RANK={r['rank']}".encode() in environ
        stat = Path(f"/proc/{r['pid']}/stat").read_text()
        assert int(stat.rsplit(")", 1)[1].split()[1]) != run.proc.pid  # torchrun's child
    sim.schedule_notice(node, "gcp", "preempt", 30)
    assert run.wait(timeout=60) == 75, run.log.read_text()
    assert run.sigtermed() == ["sigterm_0", "sigterm_1"]
    exits = sorted(
        (e["rank"], e["details"]["exit_code"])
        for e in service.events(job)
        if e["kind"] == "rank_exit"
    )
    assert exits == [(0, 75), (1, 75)]
    logs = list((run.log.parent / "n0" / "logs" / "torchrun").glob("*/attempt_0/0/stderr.log"))
    assert logs and "stop requested" in logs[0].read_text()


def test_an_agent_enrols_with_the_tasks_token_and_carries_on_with_the_issued_one(
    service, start_agent
):
    """What a launched node holds is a single-use enrolment token: the agent spends it
    at its first register and every heartbeat after carries the attempt's token (an
    enrolment token on a heartbeat is 401), so it trains; the task's copy is then spent."""
    from datetime import timedelta

    from orchestrator import __version__
    from orchestrator.contract import AGENT_PROTOCOL
    from orchestrator.store.tokens import enrolment_token

    job = service.new_job()
    node = f"{job}-a1-n0"
    enrolment = enrolment_token(service.token, job, 1, ttl=timedelta(hours=1))
    run = start_agent(job, node=node, env={"SKYRESUME_AGENT_TOKEN": enrolment})

    def trains() -> bool:
        n = node_row(service, job, node)
        ranks = (n.progress or {}).get("ranks", []) if n else []
        return n is not None and len(ranks) == 2 and all((r["step"] or 0) > 1 for r in ranks)

    wait_for("the enrolled agent's heartbeats with both ranks training", trains)
    assert "enrolled: the service issued this attempt's agent token" in run.log.read_text()
    replay = httpx.post(
        f"{service.url}/v1/jobs/{job}/attempts/1/nodes/{node}/register",
        json={
            "node_rank": 0,
            "ranks": [],
            "agent_version": __version__,
            "protocol": AGENT_PROTOCOL,
        },
        headers={"Authorization": f"Bearer {enrolment}"},
    )
    assert replay.status_code == 401 and "replay" in replay.json()["detail"]
