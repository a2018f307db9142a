"""Tokens and roles through the real app on SQLite and PostgreSQL: each route's role,
the admin routes, revocation, and the per-attempt agent tokens."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from testkit import job_spec

from orchestrator import __version__
from orchestrator.api.auth import job_token
from orchestrator.contract import AGENT_PROTOCOL
from orchestrator.domain.roles import Role
from orchestrator.store.models import ApiToken, Attempt

#: The role each route needs, written down: a change here is a decision, not a side
#: effect. Routes not listed (added later) are held to the default rule below.
NEEDS: dict[tuple[str, str], Role] = {
    ("GET", "/v1/jobs"): Role.viewer,
    ("POST", "/v1/jobs"): Role.operator,
    ("GET", "/v1/jobs/{job_id}"): Role.viewer,
    ("POST", "/v1/jobs/{job_id}/cancel"): Role.operator,
    ("GET", "/v1/jobs/{job_id}/events"): Role.viewer,
    ("POST", "/v1/jobs/{job_id}/events"): Role.operator,
    ("GET", "/v1/events"): Role.viewer,
    ("GET", "/v1/jobs/{job_id}/attempts"): Role.viewer,
    ("GET", "/v1/jobs/{job_id}/incidents"): Role.viewer,
    ("POST", "/v1/jobs/{job_id}/chaos"): Role.operator,
    ("GET", "/v1/placement-history"): Role.viewer,
    ("POST", "/v1/chaos/stockout"): Role.operator,
    ("GET", "/v1/jobs/{job_id}/goodput"): Role.viewer,
    ("POST", "/v1/tokens"): Role.admin,
    ("GET", "/v1/tokens"): Role.admin,
    ("POST", "/v1/tokens/{ref}/revoke"): Role.admin,
    ("POST", "/v1/sessions/revoke-all"): Role.admin,
    ("GET", "/v1/whoami"): Role.viewer,
}
NODE = "/v1/jobs/{job_id}/attempts/{attempt}/nodes/{node_id}"
PUBLIC = "/v1/agent/"  # the package routes: pip on a fresh node has no token


def default_role(method: str, path: str) -> Role:
    if path.startswith(NODE):
        return Role.operator  # or the attempt's agent token
    if path.startswith(("/v1/tokens", "/v1/sessions")):
        return Role.admin
    return Role.viewer if method in ("GET", "HEAD") else Role.operator


def protected_routes(app) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """Every (method, path) of the API under /v1 but the public package routes (from
    the OpenAPI document: FastAPI nests included routers, the schema is flat)."""
    out = []
    for path, ops in app.openapi()["paths"].items():
        if path.startswith("/v1") and not path.startswith(PUBLIC):
            out += [(m.upper(), path) for m in sorted(ops)]
    return out


def concrete(path: str) -> str:
    values = {"job_id": "j-nobody", "attempt": "1", "node_id": "n0", "ref": "nobody"}
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)


def make_token(client: TestClient, role: Role, name: str | None = None) -> str:
    r = client.post("/v1/tokens", json={"name": name or f"t-{role}", "role": role})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


@pytest.fixture
def role_tokens(client) -> dict[Role, str]:
    return {role: make_token(client, role) for role in Role}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_role_table_names_only_routes_that_exist(app):
    assert set(NEEDS) <= set(protected_routes(app))


def test_every_route_refuses_a_role_below_its_own_with_403_naming_the_role(
    client, role_tokens, app
):
    checked = 0
    for method, path in protected_routes(app):
        needed = NEEDS.get((method, path), default_role(method, path))
        for role, token in role_tokens.items():
            kw = {} if method in ("GET", "HEAD", "DELETE") else {"json": {}}
            r = client.request(method, concrete(path), headers=bearer(token), **kw)
            if role.allows(needed):
                assert r.status_code not in (401, 403), (method, path, role, r.text)
            else:
                assert r.status_code == 403, (method, path, role, r.text)
                assert f"needs role {needed}" in r.json()["detail"]
                assert f"has role {role}" in r.json()["detail"]
            checked += 1
    assert checked >= 3 * len(NEEDS)


def test_a_viewer_reads_but_cannot_submit(client, role_tokens):
    viewer = bearer(role_tokens[Role.viewer])
    assert client.get("/v1/jobs", headers=viewer).status_code == 200
    r = client.post("/v1/jobs", json=job_spec(), headers=viewer)
    assert r.status_code == 403
    assert r.json()["detail"].startswith("POST /v1/jobs needs role operator")
    assert client.post("/v1/jobs", json=job_spec(), headers=bearer(role_tokens[Role.operator]))


def test_a_revoked_token_gets_401_everywhere_at_once(client):
    token = make_token(client, Role.operator, "leaky")
    assert client.get("/v1/jobs", headers=bearer(token)).status_code == 200
    r = client.post("/v1/tokens/leaky/revoke")
    assert r.status_code == 200 and r.json()["token"]["revoked_at"] is not None
    for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/whoami")]:
        assert client.request(method, path, headers=bearer(token)).status_code == 401
    node = concrete(NODE) + "/heartbeat"
    assert client.post(node, json={"state": "running"}, headers=bearer(token)).status_code == 401


def test_a_token_is_shown_once_and_never_listed(client, app):
    r = client.post("/v1/tokens", json={"name": "ci", "role": "operator"})
    assert r.status_code == 201
    created = r.json()
    assert created["token"].startswith("sro_") and created["role"] == "operator"
    listing = client.get("/v1/tokens")
    assert listing.status_code == 200
    assert created["token"] not in listing.text and "token_hash" not in listing.text
    assert [t["name"] for t in listing.json()["items"]] == ["ci"]
    with app.state.sessionmaker() as s:  # the database holds no token either
        assert all(created["token"] not in (t.token_hash, t.name) for t in s.query(ApiToken))
    assert client.get("/v1/whoami", headers=bearer(created["token"])).json() == {
        "name": "ci",
        "role": "operator",
    }
    assert client.get("/v1/whoami").json() == {"name": "bootstrap", "role": "admin"}


def test_token_management_answers_409_404_and_422(client):
    assert client.post("/v1/tokens", json={"name": "ci", "role": "viewer"}).status_code == 201
    dup = client.post("/v1/tokens", json={"name": "ci", "role": "viewer"})
    assert dup.status_code == 409 and "revoke it first" in dup.json()["detail"]
    assert client.post("/v1/tokens/nobody/revoke").status_code == 404
    bad_role = client.post("/v1/tokens", json={"name": "x", "role": "root"})
    assert bad_role.status_code == 422
    bad_name = client.post("/v1/tokens", json={"name": "a b", "role": "viewer"})
    assert bad_name.status_code == 422 and "token name" in bad_name.json()["detail"][0]["msg"]
    by_id = client.get("/v1/tokens").json()["items"][0]["id"]
    assert client.post(f"/v1/tokens/{by_id}/revoke").status_code == 200
    assert client.get("/v1/tokens").json()["items"] == []
    assert len(client.get("/v1/tokens?all=true").json()["items"]) == 1


# --- agent tokens: one job's one attempt ----------------------------------------------

AGENT = {"agent_version": __version__, "agent_build": "source", "protocol": AGENT_PROTOCOL}
REGISTER = {"node_rank": 0, "ranks": [], **AGENT}


def add_attempt(app, job_id: str, number: int, state: str = "running") -> None:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker.begin() as s:
        s.add(
            Attempt(job_id=job_id, number=number, cloud="local", region="local",
                    instance_type="cpu", num_nodes=1, spot=True, knobs={},
                    started_at=datetime.now(UTC), state=state, launcher="local")
        )  # fmt: skip


def node(job_id: str, attempt: int) -> str:
    return f"/v1/jobs/{job_id}/attempts/{attempt}/nodes/n0"


@pytest.fixture
def job(client, app) -> str:
    job_id = str(client.post("/v1/jobs", json=job_spec()).json()["id"])
    add_attempt(app, job_id, 1)
    return job_id


def test_an_agent_token_opens_its_own_attempt_only(client, app, job):
    first = bearer(job_token(app.state.token, job, 1))
    assert client.post(node(job, 1) + "/register", json=REGISTER, headers=first).status_code == 200
    other = str(client.post("/v1/jobs", json=job_spec(name="other")).json()["id"])
    add_attempt(app, other, 1)
    r = client.post(node(other, 1) + "/register", json=REGISTER, headers=first)
    assert r.status_code == 401  # another job
    add_attempt(app, job, 2)
    r = client.post(node(job, 2) + "/register", json=REGISTER, headers=first)
    assert r.status_code == 401 and "not for attempt 2" in r.json()["detail"]
    second = bearer(job_token(app.state.token, job, 2))
    assert client.post(node(job, 2) + "/register", json=REGISTER, headers=second).status_code == 200
    assert client.get("/v1/jobs", headers=first).status_code == 401  # no operator route


def test_an_old_attempts_node_is_refused_with_the_409_its_agent_stops_on(client, app, job):
    """Its own token still checks out for its own attempt; the attempt is over, and the
    409 is what the agent turns into stopping its ranks and exiting (agent/client.py)."""
    first = bearer(job_token(app.state.token, job, 1))
    assert client.post(node(job, 1) + "/register", json=REGISTER, headers=first).status_code == 200
    add_attempt(app, job, 2)
    for method, path, body in [
        ("POST", "/register", REGISTER),
        ("POST", "/heartbeat", {"state": "running"}),
        ("GET", "/commands?after=0&wait=0", None),
    ]:
        r = client.request(method, node(job, 1) + path, json=body, headers=first)
        assert r.status_code == 409, (path, r.text)


def test_agent_tokens_are_distinct_per_attempt_and_change_with_the_bootstrap_token():
    a1, a2 = job_token("k", "j-1", 1), job_token("k", "j-1", 2)
    assert a1.startswith("sra_") and a1 != a2 and a1 != job_token("k", "j-2", 1)
    assert a1 != job_token("k2", "j-1", 1)
    assert re.fullmatch(r"sra_[0-9a-f]{64}", a1)  # an HMAC-SHA256, nothing of the key


def test_a_viewer_token_cannot_speak_for_a_node(client, role_tokens, job):
    r = client.post(node(job, 1) + "/register", json=REGISTER,
                    headers=bearer(role_tokens[Role.viewer]))  # fmt: skip
    assert r.status_code == 403 and "needs role operator" in r.json()["detail"]
    r = client.post(node(job, 1) + "/register", json=REGISTER,
                    headers=bearer(role_tokens[Role.operator]))  # fmt: skip
    assert r.status_code == 200
