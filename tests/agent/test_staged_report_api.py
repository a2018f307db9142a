"""A ``staged`` report through the real app (the ``client`` fixture's database) becomes
exactly one ``staged`` event whose details are the keys the reconciler's STAGE step reads."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import add_attempt
from testkit import job_spec

from orchestrator.contract import EventKind, ReportKind
from orchestrator.store import agents


@pytest.fixture
def job(client) -> str:  # type: ignore[no-untyped-def]
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201
    job_id = r.json()["id"]
    add_attempt(client.app.state.sessionmaker, job_id, 1)
    return job_id


def staged(ok: bool, **kw: Any) -> dict[str, Any]:
    return {
        "key": f"staged:40:{'ok' if ok else 'failed'}",
        "kind": ReportKind.STAGED.value,
        "node_id": "n0",
        "step": 40,
        "ok": ok,
        "detail": "" if ok else "s3://b/p/step_40: refused (step_40/__1_0.distcp: sha256 ...)",
        "bytes": 1234,
        "seconds": 0.5,
        "uri": "s3://b/p/step_40",
        **kw,
    }


def post(client, job: str, body: dict[str, Any]):  # type: ignore[no-untyped-def]
    return client.post(f"/v1/jobs/{job}/attempts/1/nodes/n0/reports", json=body)


def staged_events(client, job: str) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    items = client.get(f"/v1/jobs/{job}/events", params={"limit": 1000}).json()["items"]
    return [e for e in items if e["kind"] == EventKind.STAGED]


@pytest.mark.parametrize("ok", [True, False], ids=["staged", "refused"])
def test_a_staged_report_retried_is_one_event_with_exactly_the_stage_keys(client, job, ok):  # type: ignore[no-untyped-def]
    first = post(client, job, staged(ok))
    assert first.status_code == 200, first.text
    again = post(client, job, staged(ok))
    assert again.json() == {"event_id": first.json()["event_id"], "created": False}
    (event,) = staged_events(client, job)
    assert set(event["details"]) == set(agents.STAGED_DETAILS)
    assert event["details"] == {
        "node_id": "n0",
        "attempt": 1,
        "step": 40,
        "ok": ok,
        "detail": staged(ok)["detail"],
        "bytes": 1234,
        "seconds": 0.5,
        "uri": "s3://b/p/step_40",
    }
    assert event["node_id"] == "n0"
    assert event["failure_class"] == (None if ok else "checkpoint_io")


@pytest.mark.parametrize(
    "change",
    [{"node_id": "n1"}, {"ok": "maybe"}, {"bytes": -1}, {"extra": 1}],
    ids=["other-node", "ok-not-bool", "negative-bytes", "unknown-field"],
)
def test_a_malformed_staged_report_is_refused_and_stores_nothing(client, job, change):  # type: ignore[no-untyped-def]
    r = post(client, job, {**staged(False), **change})
    assert r.status_code == 422, r.text
    assert staged_events(client, job) == []
