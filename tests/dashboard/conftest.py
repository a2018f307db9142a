"""Dashboard fixtures: one seeded SQLite app per module (the pages only read), and
clients with their own cookie jars. The store's SQL is tested on both backends in
tests/goodput; the one query of the dashboard's own runs on PostgreSQL in
test_pages_render_on_postgres."""

from __future__ import annotations

from pathlib import Path

import pytest
from dashboard_seed import client, login, make_app, seed


@pytest.fixture(scope="module")
def seeded_app(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("dash")
    application = make_app(f"sqlite:///{tmp / 'test.db'}", tmp / "home")
    application.state.seeded = seed(application)
    yield application
    application.state.engine.dispose()


@pytest.fixture
def seeded(seeded_app) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return seeded_app.state.seeded


@pytest.fixture
def anonymous(seeded_app):  # type: ignore[no-untyped-def]
    with client(seeded_app) as c:
        yield c


@pytest.fixture
def browser_client(seeded_app):  # type: ignore[no-untyped-def]
    """No bearer token; logged in through the form, as a browser is."""
    with client(seeded_app) as c:
        login(c, seeded_app.state.token)
        yield c


@pytest.fixture
def postgres_app(postgres_server_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    from testkit import reset_postgres

    reset_postgres(postgres_server_url)
    application = make_app(postgres_server_url, tmp_path / "home")
    application.state.seeded = seed(application)
    yield application
    application.state.engine.dispose()
