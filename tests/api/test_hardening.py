"""Issue #24's defects, each a claim through the real app on SQLite and PostgreSQL:
what was a 500, a silent duplicate, an answer outside the schema or an open door is
now the documented 4xx (or simply not possible)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from testkit import job_spec, job_with_running_attempt, module_client

from orchestrator import __version__
from orchestrator.api.auth import job_token, node_token
from orchestrator.contract import AGENT_PROTOCOL

AGENT = {"node_rank": 0, "ranks": [], "agent_version": __version__, "protocol": AGENT_PROTOCOL}


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One app per database for the module (a migrated database per test cost more
    than the claims); each test makes its own jobs and counts relative to before."""
    yield from module_client(request, tmp_path_factory, "hardening")


def total_jobs(client: Any) -> int:
    return int(client.get("/v1/jobs").json()["total"])


# --- 1: deep JSON -----------------------------------------------------------------------


def test_a_job_spec_nested_past_json_loads_depth_is_400_as_on_every_route(client):
    before = total_jobs(client)
    deep = "[" * 5000 + "]" * 5000
    for path in ("/v1/jobs", "/v1/jobs/render"):
        r = client.post(path, content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert "nested too deeply" in r.json()["detail"]
    assert total_jobs(client) == before


# --- 13: idempotent submits -------------------------------------------------------------


def test_a_retried_submit_with_its_idempotency_key_makes_one_job(client):
    before = total_jobs(client)
    spec = job_spec()
    first = client.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "retry-1"})
    again = client.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "retry-1"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert total_jobs(client) == before + 1
    other = client.post("/v1/jobs", json=job_spec(name="other"),
                        headers={"Idempotency-Key": "retry-1"})  # fmt: skip
    assert other.status_code == 409 and first.json()["id"] in other.json()["detail"]
    assert client.post("/v1/jobs", json=spec).status_code == 201  # no key: a new job
    assert total_jobs(client) == before + 2


def test_an_unprintable_idempotency_key_is_refused(client):
    before = total_jobs(client)
    r = client.post("/v1/jobs", json=job_spec(), headers={"Idempotency-Key": "a b"})
    assert r.status_code == 422
    assert total_jobs(client) == before


def test_a_skypilot_yaml_outside_the_configured_directory_is_refused(client, tmp_path):
    before = total_jobs(client)
    tasks = client.app.state.settings.effective_skypilot_yaml_dir
    tasks.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "secret.yaml"
    outside.write_text("run: echo\n")
    link = tasks / f"link-{tmp_path.name}.yaml"
    link.symlink_to(outside)
    for path in (str(outside), "/etc/passwd", str(link)):
        r = client.post("/v1/jobs", json=job_spec(task={"skypilot_yaml": path}))
        assert r.status_code == 422, (path, r.text)
        assert r.json()["detail"][0]["loc"] == ["body", "task", "skypilot_yaml"]
        assert "SKYRESUME_SKYPILOT_YAML_DIR" in r.json()["detail"][0]["msg"]
    inside = tasks / "mine.yaml"
    inside.write_text("run: echo\n")
    assert client.post("/v1/jobs", json=job_spec(task={"skypilot_yaml": str(inside)})).is_success
    assert total_jobs(client) == before + 1


# --- 11: answers inside the documented schema -------------------------------------------


def test_every_422_is_a_list_of_loc_and_msg(client):
    nul = client.get("/v1/jobs", params={"status": "\x00"})
    token = client.post("/v1/tokens", json={"name": "bad name!", "role": "viewer"})
    for r in (nul, token):
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert isinstance(detail, list) and all({"loc", "msg"} <= d.keys() for d in detail)


def test_a_405_allows_every_method_its_path_has(client):
    r = client.delete("/v1/jobs")
    assert r.status_code == 405
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "POST"}


@pytest.mark.parametrize(
    "field", [{"rank": False}, {"rank": 1.0}, {"occurred_at": 0}, {"occurred_at": True}],
    ids=["rank-false", "rank-float", "occurred-at-0", "occurred-at-true"],
)  # fmt: skip
def test_loose_types_are_refused_not_coerced(client, field):
    job = client.post("/v1/jobs", json=job_spec()).json()["id"]
    r = client.post(f"/v1/jobs/{job}/events", json={"idempotency_key": "k", "kind": "x", **field})
    assert r.status_code == 422, r.text
    assert client.get(f"/v1/jobs/{job}/events").json()["items"] == []


def test_the_openapi_has_the_job_spec_body_the_4xx_answers_and_the_bearer_scheme(client):
    doc = client.get("/openapi.json").json()
    post = doc["paths"]["/v1/jobs"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/JobSpec"}
    assert "num_nodes" in doc["components"]["schemas"]["JobSpec"]["properties"]
    assert {"401", "403", "409", "413", "415", "422"} <= post["responses"].keys()
    assert post["security"] == [{"bearer": []}]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "security" not in doc["paths"]["/v1/agent/package"]["get"]  # anonymous, on purpose


# --- 12: login CSRF, docs, HSTS ----------------------------------------------------------


@pytest.mark.parametrize("header", ["origin", "referer"])
def test_a_login_posted_from_another_site_is_refused_and_sets_no_cookie(client, header):
    foreign = "https://evil.example" + ("/page" if header == "referer" else "")
    form = {"token": client.app.state.token, "next": "/dashboard/"}
    r = client.post("/dashboard/login", data=form, headers={header: foreign},
                    follow_redirects=False)  # fmt: skip
    assert r.status_code == 403 and "set-cookie" not in r.headers
    same = client.post("/dashboard/login", data=form, headers={header: "http://testserver/"},
                       follow_redirects=False)  # fmt: skip
    assert same.status_code == 303 and "set-cookie" in same.headers


def test_docs_are_off_by_default_and_hsts_is_sent_under_tls(client, tmp_path):
    from fastapi.testclient import TestClient

    from orchestrator.app import create_app
    from orchestrator.settings import Settings

    db_url = client.app.state.settings.database_url
    plain = create_app(Settings(home=tmp_path / "a", database_url=db_url))
    tls = create_app(Settings(home=tmp_path / "b", database_url=db_url, docs=True,
                              tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem"))  # fmt: skip
    try:
        with TestClient(plain) as a, TestClient(tls) as b:
            assert a.get("/docs").status_code == 404 and a.get("/redoc").status_code == 404
            assert "strict-transport-security" not in a.get("/healthz").headers
            assert b.get("/docs").status_code == 200
            assert b.get("/healthz").headers["strict-transport-security"].startswith("max-age=")
    finally:
        plain.state.engine.dispose()
        tls.state.engine.dispose()


# --- 9: node ids of the launch, a node as itself ----------------------------------------


def _launched(app: Any, job: str, node_ids: list[str]) -> None:
    from sqlalchemy import select

    from orchestrator.store.models import Attempt

    with app.state.sessionmaker.begin() as s:
        a = s.scalars(select(Attempt).where(Attempt.job_id == job)).one()
        a.handle = {"cluster_name": "c", "launcher": "local", "node_ids": node_ids,
                    "hosts": [], "request_id": ""}  # fmt: skip


def test_register_refuses_a_node_id_its_launch_never_had(client):
    job = job_with_running_attempt(client.app)
    _launched(client.app, job, [f"{job}-a1-n0"])
    r = client.post(f"/v1/jobs/{job}/attempts/1/nodes/{job}-a1-n7/register", json=AGENT)
    assert r.status_code == 403 and f"{job}-a1-n0" in r.json()["detail"]
    ok = client.post(f"/v1/jobs/{job}/attempts/1/nodes/{job}-a1-n0/register", json=AGENT)
    assert ok.status_code == 200, ok.text
    nodes = client.get(f"/v1/jobs/{job}/attempts").json()["items"][0]["nodes"]
    assert [n["node_id"] for n in nodes] == [f"{job}-a1-n0"]


def test_a_nodes_token_opens_its_own_routes_only(client):
    job = job_with_running_attempt(client.app)
    secret = client.app.state.token
    mine = {"Authorization": f"Bearer {node_token(secret, job, 1, 'n0')}"}
    base = f"/v1/jobs/{job}/attempts/1/nodes"
    assert client.post(f"{base}/n0/register", json=AGENT, headers=mine).status_code == 200
    peer = client.post(f"{base}/n1/register", json=AGENT, headers=mine)
    assert peer.status_code == 401 and "node n1" in peer.json()["detail"]
    # The attempt's own token (the service's, never handed to a node) still opens both.
    attempt = {"Authorization": f"Bearer {job_token(secret, job, 1)}"}
    assert client.post(f"{base}/n1/register", json=AGENT, headers=attempt).status_code == 200


# --- 8: the agent wheel's outcome is kept -----------------------------------------------


def test_a_failed_wheel_build_is_503_at_once_and_never_built_again(client, tmp_path: Path):
    from orchestrator import package

    site = tmp_path / "site" / "orchestrator"  # an installed package: no pyproject.toml
    site.mkdir(parents=True)
    cache = package.WheelCache(tmp_path / "h", package_dir=site)
    held = client.app.state.agent_wheels if hasattr(client.app.state, "agent_wheels") else None
    client.app.state.agent_wheels = cache
    calls = []
    real = package.source_root

    def counted(package_dir: Path | None = None) -> Path:
        calls.append(package_dir)
        return real(package_dir)

    package.source_root = counted  # type: ignore[assignment]
    try:
        answers = [client.get("/v1/agent/package") for _ in range(5)]
    finally:
        package.source_root = real  # type: ignore[assignment]
        client.app.state.agent_wheels = held
    assert {r.status_code for r in answers} == {503}
    assert all("no source tree" in r.json()["detail"] for r in answers)
    assert len(calls) == 1  # one build attempt, its failure served to every request
