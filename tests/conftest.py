"""Shared fixtures: databases (SQLite always, PostgreSQL when reachable), apps, clients.

PostgreSQL: ``SKYRESUME_TEST_POSTGRES_URL`` (default postgresql://postgres@127.0.0.1:5432/test).
Each test session creates its own database there and drops it afterwards. When the
server is unreachable the postgres cases are skipped, unless
``SKYRESUME_REQUIRE_POSTGRES=1`` (CI sets it), where they fail instead.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import hypothesis  # noqa: F401 - see below
import pytest
from testkit import reset_postgres

# Imported up front: hypothesis's pytest plugin imports it at the end of a session that
# did not, and CPython 3.11.7's parser can then fail that late import with "SystemError:
# AST constructor recursion depth mismatch" (seen after tests/reconciler alone), turning
# a green partial run red after every test passed.

PG_BASE = os.environ.get("SKYRESUME_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(PG_BASE, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql)


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test session."""
    name = "skyresume_t_" + secrets.token_hex(4)
    try:
        _pg_admin(f'CREATE DATABASE "{name}"')
    except Exception as e:
        if os.environ.get("SKYRESUME_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL required but unreachable at {PG_BASE}: {e}")
        pytest.skip(f"PostgreSQL unreachable at {PG_BASE}: {e}")
    base = PG_BASE.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database on each backend (no schema)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'test.db'}"
    url = request.getfixturevalue("postgres_server_url")
    reset_postgres(url)
    return url


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """A database on each backend, upgraded to the head revision."""
    from orchestrator.store import db

    db.upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def settings(tmp_path: Path, db_url: str):  # type: ignore[no-untyped-def]
    from orchestrator.settings import Settings

    return Settings(home=tmp_path / "home", database_url=db_url)


@pytest.fixture
def app(settings):  # type: ignore[no-untyped-def]
    from orchestrator.app import create_app

    application = create_app(settings)
    yield application
    application.state.engine.dispose()


@pytest.fixture
def client(app):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {app.state.token}"
        yield c


#: The tests marked ``e2e`` (real multi-process training: a service, nodes, torchrun
#: ranks), with heartbeat, gloo and group timeouts sized for a machine where that job
#: is the only one (a warm regroup beside a tests/e2e job hit gloo's 60 s recv timeout).
#: Under ``pytest -n`` (scripts/test runs two workers) they share one xdist group, so
#: one of them runs at a time while the other workers take the rest of the suite; the
#: group goes first, as the longest unit of work (over half of the serial run's time).
ONE_AT_A_TIME = "multi-node-e2e"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    grouped = [i for i in items if i.get_closest_marker("e2e")]
    for item in grouped:
        item.add_marker(pytest.mark.xdist_group(ONE_AT_A_TIME))
    first = set(grouped)
    items[:] = grouped + [i for i in items if i not in first]
