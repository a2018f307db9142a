"""The truthful loop against a real database (SQLite and PostgreSQL): what the agents
report (a plain script's CPU use, the nodes' exit reports) reaches ``decide`` through
the store's snapshot, and the job's history says what happened (issue 27)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_protocol_store import World, start_running

from orchestrator.store import agents, repo
from orchestrator.store.incidents import incidents
from orchestrator.store.models import FailureEvent
from orchestrator.store.snapshot import gather_snapshot


@pytest.fixture
def world(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    w = World(db_url, tmp_path)
    yield w
    w.engine.dispose()


def plain_agents_up(w: World, attempt: int) -> None:
    """Both nodes register and heartbeat ranks that send no datagram and use CPU."""
    with w.sm.begin() as s:
        for k in range(2):
            nid = f"{w.job}-a{attempt}-n{k}"
            agents.register_node(s, w.job, attempt, nid, node_rank=k, now=w.now,
                                 client_ip=f"10.0.0.{k + 2}")  # fmt: skip
            ranks = [{"rank": 2 * k + i, "cpu_idle_s": 0.4} for i in range(2)]
            agents.record_heartbeat(s, w.job, attempt, nid, {"state": "running", "ranks": ranks},
                                    now=w.now)  # fmt: skip


def events(w: World, kind: str) -> list[FailureEvent]:
    with w.sm() as s:
        return list(s.query(FailureEvent).filter_by(job_id=w.job, kind=kind))


def test_a_plain_script_is_noticed_once_runs_and_its_finish_ends_the_job(world):
    w = world
    w.tick()
    w.tick()
    plain_agents_up(w, 1)
    for _ in range(70):  # 350 s: past the 300 s start-up default, every beat fresh
        plain_agents_up(w, 1)
        w.tick(5.0)
    (note,) = events(w, "plain_script")
    assert "send no progress reports" in note.message
    assert w.status() == "RUNNING"
    assert events(w, "stuck") == []
    for k in range(2):
        w.report(1, k, {"key": "x", "kind": "node_exit", "exit_code": 0,
                        "reason": "all ranks exited 0"})  # fmt: skip
    w.tick()
    assert w.status() == "SUCCEEDED"
    with w.sm() as s:
        reason = repo.get_job(s, w.job).status_reason
    assert "every rank of attempt 1 exited 0" in reason and "no step was reported" in reason


def test_a_stop_the_ranks_died_of_is_never_called_a_save(world):
    w = world
    w.tick()
    w.tick()
    w.agents_up(1, resumed=0, step=0)
    w.tick()
    w.tick()
    w.agents_up(1, resumed=0, step=40)
    w.report(1, 1, {"key": "n1", "kind": "preemption_notice", "provider": "aws"})
    w.tick()
    w.tick()  # SIGNAL sent
    for k in range(2):
        w.report(1, k, {"key": "x", "kind": "node_exit", "exit_code": 1, "saved_step": None,
                        "reason": f"rank {2 * k} ended with signal SIGTERM"})  # fmt: skip
    w.tick()
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
    signal = next(st for st in inc["steps"] if st["step"] == "signal")
    assert signal["detail"].startswith("every rank stopped; no save reported")
    assert "rank 2 ended with signal SIGTERM" in signal["detail"]


def test_the_first_attempt_s_start_up_is_measured_for_the_validate_timeout(world):
    """Nodes up, then every rank's resume report: that start-up is what the next
    attempts' validate timeout scales (3x, at least 120 s)."""
    w = world
    start_running(w)  # up at one tick, validated at the next (1 s apart)
    with w.sm() as s:
        snap, _ = gather_snapshot(s, w.job, w.now, w.launcher)
    assert snap.startup_s == (1.0,)
