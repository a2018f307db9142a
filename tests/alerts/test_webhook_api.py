"""``/v1/alerts/webhooks`` through the real app: a webhook for one job or all, its
secret shown once (made by the service when not given), listed without it, removed."""

from __future__ import annotations

from testkit import job_spec


def test_a_webhook_is_added_listed_without_its_secret_and_removed(client):
    job = client.post("/v1/jobs", json=job_spec()).json()["id"]
    made = client.post("/v1/alerts/webhooks", json={"url": "https://hooks.example/a"})
    assert made.status_code == 201 and len(made.json()["secret"]) >= 32
    mine = client.post(
        "/v1/alerts/webhooks",
        json={"url": "http://hooks.example/b", "job_id": job, "secret": "x" * 20},
    ).json()
    assert mine["secret"] == "x" * 20 and mine["job_id"] == job
    listed = client.get("/v1/alerts/webhooks").json()["items"]
    assert [(w["url"], w["job_id"]) for w in listed] == [
        ("https://hooks.example/a", None),
        ("http://hooks.example/b", job),
    ]
    assert all("secret" not in w for w in listed)
    assert client.delete(f"/v1/alerts/webhooks/{mine['id']}").status_code == 200
    assert len(client.get("/v1/alerts/webhooks").json()["items"]) == 1
    assert client.delete(f"/v1/alerts/webhooks/{mine['id']}").status_code == 404


def test_a_bad_webhook_is_refused(client):
    for body in (
        {"url": "ftp://hooks.example/a"},
        {"url": "https://hooks.example/a", "secret": "short"},
        {"url": "https://hooks.example/a", "job_id": "j-nope"},
    ):
        assert client.post("/v1/alerts/webhooks", json=body).status_code in (404, 422), body
    assert client.get("/v1/alerts/webhooks", headers={"Authorization": ""}).status_code == 401


def test_text_postgresql_cannot_store_is_a_422_naming_the_field(client):
    # Found by the long schemathesis run: a NUL reached PostgreSQL's text column (500).
    for field, body in (
        ("url", {"url": "https://hooks.example/\x00a"}),
        ("url", {"url": "https://hooks.example/a b"}),
        ("secret", {"url": "https://hooks.example/a", "secret": "s" * 20 + "\x00"}),
        ("job_id", {"url": "https://hooks.example/a", "job_id": "j-\x00"}),
    ):
        r = client.post("/v1/alerts/webhooks", json=body)
        assert r.status_code == 422, (body, r.text)
        assert field in str(r.json()["detail"][0]["loc"]), r.text
    assert client.get("/v1/alerts/webhooks").json()["items"] == []


def test_a_webhook_id_past_a_64_bit_integer_is_a_422_not_a_server_error(client):
    # Found by the long schemathesis run: SQLite's and PostgreSQL's integer overflowed (500).
    assert client.delete(f"/v1/alerts/webhooks/{2**63}").status_code == 422
    assert client.delete("/v1/alerts/webhooks/0").status_code == 422
    assert client.delete(f"/v1/alerts/webhooks/{2**63 - 1}").status_code == 404


def test_the_openapi_documents_the_200_of_a_replayed_event(client):
    # Found by the long schemathesis run: a re-posted idempotency key answers 200.
    post = client.get("/openapi.json").json()["paths"]["/v1/jobs/{job_id}/events"]["post"]
    assert {"200", "201"} <= set(post["responses"])
