"""A request's writes are one transaction on both databases: a request that fails
half-way leaves nothing behind, savepoints included.

SQLite's Python driver, left to itself, sends no BEGIN before a SAVEPOINT, so a row
written inside ``begin_nested()`` was committed on its own; a checkpoint report that
failed after its event row was then retried, found its key, answered
``created: false`` and never wrote the checkpoint (store/db.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from testkit import job_with_running_attempt

from orchestrator import __version__
from orchestrator.contract import AGENT_PROTOCOL
from orchestrator.store import agents, repo
from orchestrator.store.models import Checkpoint, FailureEvent, Node


class Injected(RuntimeError):
    """The failure a test injects after the first write."""


def _count(sessionmaker, model, **where) -> int:  # type: ignore[no-untyped-def]
    with sessionmaker() as s:
        q = select(func.count()).select_from(model)
        for k, v in where.items():
            q = q.where(getattr(model, k) == v)
        return int(s.scalar(q) or 0)


def _job_with_attempt(app) -> str:  # type: ignore[no-untyped-def]
    return job_with_running_attempt(app)


def test_a_savepoint_write_is_rolled_back_with_its_transaction(app):
    job_id = _job_with_attempt(app)
    sm = app.state.sessionmaker
    with pytest.raises(Injected), sm.begin() as s:
        repo.record_event(s, job_id, idempotency_key="k1", kind="x")  # begin_nested inside
        raise Injected
    assert _count(sm, FailureEvent, job_id=job_id) == 0


def test_a_report_that_failed_half_way_stores_nothing_and_its_retry_stores_it_once(
    app, monkeypatch
):
    job_id = _job_with_attempt(app)
    sm = app.state.sessionmaker
    real = agents._upsert_checkpoint

    def fail_after_the_event_row(*a, **kw):  # type: ignore[no-untyped-def]
        raise Injected("after the event row was written")

    monkeypatch.setattr(agents, "_upsert_checkpoint", fail_after_the_event_row)
    url = f"/v1/jobs/{job_id}/attempts/1/nodes/n0/reports"
    body = {"key": "ckpt-7", "kind": "checkpoint", "step": 7, "path": "/d/step_7"}
    with TestClient(app, raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {app.state.token}"
        assert c.post(url, json=body).status_code == 500
        assert _count(sm, FailureEvent, job_id=job_id) == 0
        assert _count(sm, Checkpoint, job_id=job_id) == 0

        monkeypatch.setattr(agents, "_upsert_checkpoint", real)
        r = c.post(url, json=body)
        assert r.status_code == 200 and r.json()["created"] is True, r.text
        again = c.post(url, json=body)
        assert again.json() == {"event_id": r.json()["event_id"], "created": False}
    assert _count(sm, FailureEvent, job_id=job_id) == 1
    assert _count(sm, Checkpoint, job_id=job_id, step=7) == 1


def test_a_register_that_failed_after_its_node_row_stores_no_node(app, monkeypatch):
    job_id = _job_with_attempt(app)
    sm = app.state.sessionmaker

    real = agents.register_node

    def register_then_fail(session, *a, **kw):  # type: ignore[no-untyped-def]
        real(session, *a, **kw)
        raise Injected("after the node row was written")

    monkeypatch.setattr(agents, "register_node", register_then_fail)
    body = {"node_rank": 0, "ranks": [], "agent_version": __version__, "protocol": AGENT_PROTOCOL}
    with TestClient(app, raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {app.state.token}"
        r = c.post(f"/v1/jobs/{job_id}/attempts/1/nodes/n0/register", json=body)
        assert r.status_code == 500
    assert _count(sm, Node, job_id=job_id) == 0


def test_an_event_post_that_failed_after_its_row_stores_nothing(app, monkeypatch):
    """The operator routes' transaction (``SessionDep``), not the agents' one."""
    job_id = _job_with_attempt(app)
    sm = app.state.sessionmaker
    from orchestrator.api import routes_jobs

    real = repo.record_event

    def record_then_fail(*a, **kw):  # type: ignore[no-untyped-def]
        real(*a, **kw)
        raise Injected("after the event row was written")

    monkeypatch.setattr(routes_jobs.repo, "record_event", record_then_fail)
    with TestClient(app, raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {app.state.token}"
        r = c.post(f"/v1/jobs/{job_id}/events", json={"idempotency_key": "k", "kind": "x"})
        assert r.status_code == 500
        monkeypatch.setattr(routes_jobs.repo, "record_event", real)
        assert c.get(f"/v1/jobs/{job_id}/events").json()["items"] == []
        again = c.post(f"/v1/jobs/{job_id}/events", json={"idempotency_key": "k", "kind": "x"})
        assert again.status_code == 201, again.text
    assert _count(sm, FailureEvent, job_id=job_id) == 1
