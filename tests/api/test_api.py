"""API v1 through the real app on a real database (SQLite and PostgreSQL)."""

from __future__ import annotations

import yaml
from testkit import job_spec

from orchestrator.domain.status import JobStatus
from orchestrator.store import repo


def _submit(client, **overrides):
    r = client.post("/v1/jobs", json=job_spec(**overrides))
    assert r.status_code == 201, r.text
    return r.json()


def _job_count(app) -> int:
    with app.state.sessionmaker() as s:
        return repo.list_jobs(s).total


def test_submitted_job_is_pending_with_its_spec(client):
    job = _submit(client)
    assert job["status"] == "PENDING"
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert got["spec"]["num_nodes"] == 2
    assert [t["to_status"] for t in got["transitions"]] == ["PENDING"]
    assert got["created_at"].endswith("Z") or "+00:00" in got["created_at"]


def test_yaml_body_is_accepted(client):
    r = client.post(
        "/v1/jobs", content=yaml.safe_dump(job_spec()), headers={"content-type": "application/yaml"}
    )
    assert r.status_code == 201, r.text


def test_invalid_spec_is_422_naming_the_field_and_stores_nothing(client, app):
    r = client.post("/v1/jobs", json=job_spec(num_nodes=2, min_nodes=5, bogus=1))
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert {"loc": ["body", "bogus"], "msg": "unknown field"} in detail
    assert _job_count(app) == 0


def test_yaml_bomb_is_422_and_stores_nothing(client, app):
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n"
    r = client.post("/v1/jobs", content=bomb, headers={"content-type": "application/yaml"})
    assert r.status_code == 422 and "aliases" in r.text
    assert _job_count(app) == 0


def test_unreadable_json_is_422(client):
    r = client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "unreadable JSON" in r.text


def test_oversized_body_is_413(client):
    r = client.post(
        "/v1/jobs", content=b"x" * 300_000, headers={"content-type": "application/yaml"}
    )
    assert r.status_code == 413


def test_list_is_paginated_and_filters_by_status(client):
    ids = [_submit(client, name=f"job-{i}")["id"] for i in range(5)]
    client.post(f"/v1/jobs/{ids[0]}/cancel")
    page = client.get("/v1/jobs", params={"limit": 2, "offset": 0}).json()
    assert page["total"] == 5 and len(page["items"]) == 2
    rest = client.get("/v1/jobs", params={"limit": 10, "offset": 2}).json()["items"]
    assert len({j["id"] for j in page["items"] + rest}) == 5
    cancelled = client.get("/v1/jobs", params={"status": "CANCELLED"}).json()
    assert [j["id"] for j in cancelled["items"]] == [ids[0]]
    assert client.get("/v1/jobs", params={"status": "NOPE"}).status_code == 422


def test_cancel_is_recorded_and_cannot_happen_twice(client):
    job = _submit(client)
    assert client.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "CANCELLED"
    again = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and "illegal transition CANCELLED -> CANCELLED" in again.text
    transitions = client.get(f"/v1/jobs/{job['id']}").json()["transitions"]
    assert [t["to_status"] for t in transitions] == ["PENDING", "CANCELLED"]


def test_illegal_transition_is_refused_and_nothing_is_written(app, client):
    job = _submit(client)
    with app.state.sessionmaker() as s:
        try:
            repo.set_status(s, job["id"], JobStatus.SUCCEEDED, reason="test")
            raise AssertionError("PENDING -> SUCCEEDED must be refused")
        except ValueError:
            s.rollback()
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert got["status"] == "PENDING" and len(got["transitions"]) == 1


def test_unknown_job_is_404(client):
    assert client.get("/v1/jobs/j-nope").status_code == 404
    assert client.post("/v1/jobs/j-nope/cancel").status_code == 404
    assert client.get("/v1/jobs/j-nope/events").status_code == 404


def test_posting_an_event_twice_with_one_key_stores_it_once(client):
    job = _submit(client)
    body = {
        "idempotency_key": "node-0:notice-1",
        "kind": "preemption_notice",
        "node_id": "node-0",
        "details": {"provider": "aws"},
    }
    first = client.post(f"/v1/jobs/{job['id']}/events", json=body)
    second = client.post(f"/v1/jobs/{job['id']}/events", json={**body, "message": "changed"})
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"] and second.json()["message"] is None
    assert len(client.get(f"/v1/jobs/{job['id']}/events").json()["items"]) == 1


def test_events_cursor_returns_only_newer_events(client):
    job = _submit(client)
    for i in range(5):
        client.post(f"/v1/jobs/{job['id']}/events", json={"idempotency_key": f"k{i}", "kind": "x"})
    first = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 3}).json()
    assert len(first["items"]) == 3
    rest = client.get(f"/v1/jobs/{job['id']}/events", params={"after": first["next_cursor"]}).json()
    assert [e["idempotency_key"] for e in rest["items"]] == ["k3", "k4"]
    empty = client.get(f"/v1/jobs/{job['id']}/events", params={"after": rest["next_cursor"]}).json()
    assert empty["items"] == [] and empty["next_cursor"] == rest["next_cursor"]
    everyone = client.get("/v1/events").json()["items"]
    assert len(everyone) == 5


def test_malformed_event_is_422_naming_the_field(client):
    job = _submit(client)
    r = client.post(f"/v1/jobs/{job['id']}/events", json={"kind": "x", "rank": -1, "extra": 1})
    fields = {tuple(d["loc"]) for d in r.json()["detail"]}
    assert r.status_code == 422
    assert {("body", "idempotency_key"), ("body", "rank"), ("body", "extra")} <= fields


def test_operator_routes_need_the_token(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as anon:
        assert anon.get("/v1/jobs").status_code == 401
        r = anon.get("/v1/jobs", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["detail"] == "invalid token"
        assert anon.get("/healthz").status_code == 200


def test_local_mode_token_file_is_private(app, settings):
    path = settings.token_path
    assert path.read_text().strip() == app.state.token
    assert path.stat().st_mode & 0o777 == 0o600


def test_ops_endpoints(client):
    _submit(client)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    assert client.get("/v1/jobs/j-nope").status_code == 404
    metrics = client.get("/metrics").text
    assert 'skyresume_jobs{status="PENDING"} 1.0' in metrics
    # Counted by route template and the status the client got.
    assert (
        'skyresume_http_requests_total{code="404",method="GET",route="/v1/jobs/{job_id}"} 1.0'
        in metrics
    )
    assert 'skyresume_http_requests_total{code="201",method="POST",route="/v1/jobs"}' in metrics
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events"} <= set(paths)


def test_readyz_says_unavailable_without_schema(tmp_path):
    from fastapi.testclient import TestClient

    from orchestrator.app import create_app
    from orchestrator.settings import Settings

    app = create_app(Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path}/empty.db"))
    with TestClient(app) as c:
        assert c.get("/readyz").status_code == 503
