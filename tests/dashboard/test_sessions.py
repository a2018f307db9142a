"""Dashboard sessions are server-side rows that expire and can be revoked, on SQLite
and PostgreSQL (the ``app`` fixture of tests/conftest.py: each backend, empty)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from orchestrator.dashboard.auth import COOKIE
from orchestrator.store.models import DashboardSession


def browser(app) -> TestClient:  # type: ignore[no-untyped-def]
    return TestClient(app, follow_redirects=False)


def admin(app) -> TestClient:  # type: ignore[no-untyped-def]
    c = TestClient(app)
    c.headers["Authorization"] = f"Bearer {app.state.token}"
    return c


def new_token(app, name: str, role: str = "viewer") -> str:  # type: ignore[no-untyped-def]
    with admin(app) as c:
        r = c.post("/v1/tokens", json={"name": name, "role": role})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])


def log_in(c: TestClient, token: str) -> str:
    r = c.post("/dashboard/login", data={"token": token, "next": "/dashboard/"})
    assert r.status_code == 303, r.text
    return str(c.cookies[COOKIE])


def opens(app, cookie: str) -> bool:  # type: ignore[no-untyped-def]
    """Whether a fresh browser holding only ``cookie`` gets a page (a replayed cookie)."""
    with browser(app) as c:
        c.cookies.set(COOKIE, cookie, path="/dashboard")
        r = c.get("/dashboard/")
        assert r.status_code in (200, 303), r.text
        return r.status_code == 200


def test_a_viewer_token_logs_in_and_the_database_keeps_only_a_hash(app):
    token = new_token(app, "alice")
    with browser(app) as c:
        cookie = log_in(c, token)
        assert c.get("/dashboard/").status_code == 200
    assert cookie.startswith("srs_") and token not in cookie and app.state.token not in cookie
    with app.state.sessionmaker() as s:
        row = s.scalars(select(DashboardSession)).one()
        assert cookie not in row.session_hash and row.role == "viewer"
        assert row.token_id is not None


def test_logout_revokes_the_session_so_the_old_cookie_opens_nothing(app):
    with browser(app) as c:
        cookie = log_in(c, app.state.token)
        assert opens(app, cookie)
        assert c.post("/dashboard/logout").status_code == 303
    assert not opens(app, cookie)


def test_revoking_a_token_ends_its_sessions_and_no_one_elses(app):
    token = new_token(app, "bob")
    with browser(app) as c:
        bobs = log_in(c, token)
    with browser(app) as c:
        bootstrap = log_in(c, app.state.token)
    with admin(app) as c:
        r = c.post("/v1/tokens/bob/revoke")
        assert r.status_code == 200 and r.json()["sessions_revoked"] == 1
    assert not opens(app, bobs) and opens(app, bootstrap)
    with browser(app) as c:  # and the token cannot open a new one
        r = c.post("/dashboard/login", data={"token": token})
        assert r.status_code == 401 and "unknown or revoked" in r.text


def test_an_admin_revokes_every_session(app):
    cookies = []
    for _ in range(2):
        with browser(app) as c:
            cookies.append(log_in(c, app.state.token))
    viewer = new_token(app, "carol")
    with TestClient(app) as c:
        r = c.post("/v1/sessions/revoke-all", headers={"Authorization": f"Bearer {viewer}"})
        assert r.status_code == 403 and "needs role admin" in r.json()["detail"]
    with admin(app) as c:
        assert c.post("/v1/sessions/revoke-all").json() == {"revoked": 2}
    assert not any(opens(app, k) for k in cookies)


def test_a_session_ends_at_its_expiry(app):
    with browser(app) as c:
        cookie = log_in(c, app.state.token)
    past = datetime.now(UTC) - timedelta(seconds=1)
    with app.state.sessionmaker.begin() as s:
        s.execute(update(DashboardSession).values(expires_at=past))
    assert not opens(app, cookie)


@pytest.mark.parametrize("hours", [12.0, 0.5], ids=["default", "half-hour"])
def test_the_cookie_lives_as_long_as_the_setting_says(app, hours):
    app.state.settings = app.state.settings.model_copy(update={"dashboard_session_hours": hours})
    with browser(app) as c:
        r = c.post("/dashboard/login", data={"token": app.state.token})
    assert f"max-age={int(hours * 3600)}" in r.headers["set-cookie"].lower()
    with app.state.sessionmaker() as s:
        row = s.scalars(select(DashboardSession)).one()
        lifetime = row.expires_at - row.created_at
    assert lifetime == timedelta(hours=hours)
