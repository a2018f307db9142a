"""The agent's report outbox against a real app served over HTTP (uvicorn), with the
real agent client, on SQLite and PostgreSQL: a report the service refuses is logged
with the reason, kept in ``outbox.refused`` and dropped, never blocking the reports
behind it; one that meets a server error or a closed port is retried until taken."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from testkit import job_with_running_attempt

from orchestrator.agent.main import Agent, AgentConfig
from orchestrator.store import agents, repo
from orchestrator.store.models import Checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(app) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """The app on a free loopback port; its URL."""
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def job(app) -> str:  # type: ignore[no-untyped-def]
    return job_with_running_attempt(app)


def _agent(url: str, app: Any, job_id: str, tmp_path) -> Agent:  # type: ignore[no-untyped-def]
    cfg = AgentConfig(
        job_id=job_id, attempt=1, node_id="n0", node_rank=0, nnodes=1, nproc_per_node=1,
        command=("true",), service_url=url, local_dir=tmp_path, log_dir=tmp_path,
        heartbeat_s=0.1,
    )  # fmt: skip
    agent = Agent(cfg, token=app.state.token, environ={})
    threading.Thread(target=agent._report_loop, name="reports", daemon=True).start()
    return agent


def _events(app: Any, job_id: str) -> list[Any]:
    with app.state.sessionmaker() as s:
        return list(repo.list_events(s, job_id))


def test_a_refused_report_is_recorded_and_dropped_and_the_next_one_is_sent(
    app, served, job, tmp_path, caplog
):
    agent = _agent(served, app, job, tmp_path)
    caplog.set_level(logging.ERROR, logger="skyresume.agent")
    agent.report("checkpoint", "checkpoint:huge", step=10**30, path="/d/huge")  # type: ignore[arg-type]
    agent.report("checkpoint", "checkpoint:7", step=7, path="/d/step_7")  # type: ignore[arg-type]
    try:
        assert agent.outbox.wait_drained(20), "the outbox is stuck behind the refused report"
    finally:
        agent.outbox.q.put(None)
    (refused,) = agent.outbox.refused
    assert (refused.kind, refused.key, refused.status) == ("checkpoint", "checkpoint:huge", 422)
    assert "step" in refused.why and "64 bits" in refused.why
    assert any("checkpoint:huge" in r.getMessage() and "not retried" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    (event,) = _events(app, job)
    assert event.details["step"] == 7
    with app.state.sessionmaker() as s:
        assert [c.step for c in s.query(Checkpoint).filter_by(job_id=job)] == [7]


def test_a_server_error_is_retried_until_the_report_is_taken(
    app, served, job, tmp_path, monkeypatch
):
    real = agents.record_report
    calls = {"n": 0}

    def fail_twice(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("the database blinked")
        return real(*a, **kw)

    monkeypatch.setattr(agents, "record_report", fail_twice)
    agent = _agent(served, app, job, tmp_path)
    agent.report("checkpoint", "checkpoint:9", step=9, path="/d/step_9")  # type: ignore[arg-type]
    try:
        assert agent.outbox.wait_drained(20)
    finally:
        agent.outbox.q.put(None)
    assert calls["n"] == 3 and agent.outbox.refused == []
    (event,) = _events(app, job)
    assert event.details["step"] == 9


def test_nan_in_a_report_goes_out_as_null_not_as_a_refused_body(app, served, job, tmp_path):
    agent = _agent(served, app, job, tmp_path)
    agent.report(  # type: ignore[arg-type]
        "anomaly", "anomaly:1", rank=0, finding="loss_spike", step=3, detail={"loss": float("nan")}
    )
    try:
        assert agent.outbox.wait_drained(20)
    finally:
        agent.outbox.q.put(None)
    assert agent.outbox.refused == []
    (event,) = _events(app, job)
    assert event.details["detail"] == {"loss": None}
