"""Fixtures of the alert tests: a webhook receiver and a session factory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from webhook_receiver import Receiver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "goodput"))


@pytest.fixture
def receiver():  # type: ignore[no-untyped-def]
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture
def sessions(db_url: str):  # type: ignore[no-untyped-def]
    from orchestrator.store.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def sqlite_sessions(tmp_path: Path):  # type: ignore[no-untyped-def]
    """SQLite alone, for tests whose SQL the two-backend tests already cover."""
    from orchestrator.store import db
    from orchestrator.store.db import make_engine, make_sessionmaker

    url = f"sqlite:///{tmp_path / 'alerts.db'}"
    db.upgrade(url)
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()
