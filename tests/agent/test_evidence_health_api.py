"""``evidence`` and ``health_check`` reports through the real app (SQLite and
PostgreSQL): what they become as events, and the size limits on stacks."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import add_attempt
from testkit import job_spec

from orchestrator.store import agents


@pytest.fixture
def job(client) -> str:
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201
    add_attempt(client.app.state.sessionmaker, r.json()["id"], 1)
    return r.json()["id"]


def post(client, job_id: str, body: dict[str, Any], node: str = "n0"):
    return client.post(f"/v1/jobs/{job_id}/attempts/1/nodes/{node}/reports", json=body)


def events(client, job_id: str) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/events").json()["items"]


def rank_ev(rank: int, stack: str = "Thread 1 (idle)\n    <module> (t.py:1)\n", **kw: Any):
    return {"rank": rank, "local_rank": rank, "pid": 100 + rank, "state": "S",
            "tool": "py-spy", "stack": stack, **kw}  # fmt: skip


def evidence(ranks: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"key": "evidence:7", "kind": "evidence", "trigger": "stop: rank_hang",
            "ranks": ranks, "findings": ["rank 1 is stopped (state T)"], **kw}  # fmt: skip


def test_an_evidence_report_is_stored_with_every_rank_stack_and_no_failure_class(client, job):
    fr = [{"file": "rank_0", "rank": 0, "pending": [{"op": "nccl:all_reduce", "seq": 9}]}]
    body = evidence([rank_ev(0, op="all_reduce"), rank_ev(1, state="T")], flight_recorder=fr)
    r = post(client, job, body)
    assert r.status_code == 200, r.text
    assert post(client, job, body).json() == {**r.json(), "created": False}
    (e,) = events(client, job)
    assert e["kind"] == "evidence" and e["failure_class"] is None and e["node_id"] == "n0"
    assert e["message"] == "evidence from 2 rank(s) (py-spy): rank 1 is stopped (state T)"
    assert [x["rank"] for x in e["details"]["ranks"]] == [0, 1]
    assert e["details"]["ranks"][0]["op"] == "all_reduce"
    assert e["details"]["flight_recorder"][0]["pending"][0]["op"] == "nccl:all_reduce"
    assert e["details"]["attempt"] == 1


@pytest.mark.parametrize(
    ("ranks", "detail"),
    [
        pytest.param([rank_ev(0, "x" * (agents.EVIDENCE_STACK_CAP + 1))], "65536", id="one-rank"),
        pytest.param(
            [rank_ev(i, "x" * agents.EVIDENCE_STACK_CAP) for i in range(17)],
            "over the 1048576 limit",
            id="whole-report",
        ),
    ],
)
def test_stacks_over_the_limits_are_refused_not_stored_half(client, job, ranks, detail):
    r = post(client, job, evidence(ranks))
    assert r.status_code == 422
    assert detail in r.text
    assert events(client, job) == []


def test_a_failed_health_check_is_a_health_check_failed_event_for_the_node(client, job):
    checks = [
        {"name": "gpus", "status": "skip", "detail": "no GPUs on this node"},
        {"name": "disk", "status": "fail", "detail": "/d: 0.20 GiB free, the tier needs 5.00 GiB",
         "data": {"free_bytes": 214748364}},
        {"name": "clock", "status": "unknown", "detail": "no Date header"},
    ]  # fmt: skip
    r = post(client, job, {"key": "health_check", "kind": "health_check", "checks": checks}, "n3")
    assert r.status_code == 200, r.text
    (e,) = events(client, job)
    assert e["kind"] == "health_check" and e["failure_class"] == "health_check_failed"
    assert e["node_id"] == "n3"
    assert e["message"] == "health check failed: disk: /d: 0.20 GiB free, the tier needs 5.00 GiB"
    assert e["details"]["checks"][1]["data"] == {"free_bytes": 214748364}


def test_passing_health_checks_are_recorded_without_a_failure_class(client, job):
    checks = [{"name": "disk", "status": "pass"}, {"name": "gpus", "status": "skip"}]
    r = post(client, job, {"key": "health_check", "kind": "health_check", "checks": checks})
    assert r.status_code == 200, r.text
    (e,) = events(client, job)
    assert e["failure_class"] is None and e["message"] == "health checks passed (1 pass, 1 skip)"


def test_a_health_check_with_an_unknown_status_or_no_checks_is_refused(client, job):
    bad = [{"name": "disk", "status": "fine"}]
    assert post(client, job, {"key": "h", "kind": "health_check", "checks": bad}).status_code == 422
    assert post(client, job, {"key": "h", "kind": "health_check", "checks": []}).status_code == 422
