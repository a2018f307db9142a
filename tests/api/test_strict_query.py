"""An operator route answers a query parameter it does not have with a 422 naming it,
instead of ignoring it (found by the long schemathesis run: ``GET /v1/jobs?=0``)."""

from __future__ import annotations

from testkit import job_spec


def test_an_unknown_query_parameter_is_a_422_naming_it_and_what_the_route_takes(client):
    r = client.get("/v1/jobs", params={"limt": "5"})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["query", "limt"]
    assert "limit" in error["msg"]
    assert client.get("/v1/events?=null").status_code == 422


def test_the_parameters_a_route_has_still_work(client):
    job = client.post("/v1/jobs", json=job_spec()).json()["id"]
    assert client.get("/v1/jobs", params={"limit": "1"}).status_code == 200
    assert client.get(f"/v1/jobs/{job}/events", params={"after": 0, "limit": 5}).status_code == 200
    assert client.get("/v1/events", params={"after": 0}).status_code == 200
