"""Read sessions (``store.db.read_session``): on SQLite a read takes no write lock and
a read session cannot write; on PostgreSQL it is the sessionmaker's own session.

On a real SQLite file with a busy timeout of 0.2 s (``testkit.short_busy_timeout``),
so a read that waited for the write lock would fail at once with "database is
locked". Before read sessions, every transaction began ``BEGIN IMMEDIATE``, and the
API's reads of a 2,044-node job held the lock the heartbeat flush and the
reconciler's lease needed (``bench/overload.py`` at 0.3 cores).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from testkit import job_spec, reset_postgres, short_busy_timeout

from orchestrator.domain.spec import validate_job_spec
from orchestrator.store import db, repo
from orchestrator.store.models import Job


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'test.db'}"
    db.upgrade(url)
    return url


def a_job(maker, name: str = "j") -> str:  # type: ignore[no-untyped-def]
    with maker.begin() as s:
        return repo.create_job(s, validate_job_spec(job_spec(name=name))).id


class WriteLock:
    """Another process's write transaction on the file, held until ``release``."""

    def __init__(self, url: str) -> None:
        self.conn = sqlite3.connect(url.split("///", 1)[1], isolation_level=None)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self.conn.execute("ROLLBACK")
        self.conn.close()


def test_a_read_session_reads_while_another_connection_holds_the_write_lock(sqlite_url):
    engine = db.make_engine(sqlite_url)
    short_busy_timeout(engine)
    maker = db.make_sessionmaker(engine)
    job = a_job(maker)
    with maker.begin() as w:  # uncommitted: the reader must not see it
        w.execute(update(Job).where(Job.id == job).values(name="renamed"))
        with db.read_session(maker) as r:
            assert r.scalar(select(Job.name).where(Job.id == job)) == "j"
        # and the other way round: a read that stays open blocks no writer
        with db.read_session(maker) as r:
            assert r.scalar(select(Job.name).where(Job.id == job)) == "j"
    with maker.begin() as w2:
        w2.execute(update(Job).where(Job.id == job).values(name="again"))
    engine.dispose()


def test_a_writer_commits_while_a_read_session_holds_its_transaction(sqlite_url):
    engine = db.make_engine(sqlite_url)
    short_busy_timeout(engine)
    maker = db.make_sessionmaker(engine)
    job = a_job(maker)
    with db.read_session(maker) as r:
        assert r.scalar(select(Job.name).where(Job.id == job)) == "j"  # its snapshot
        with maker.begin() as w:
            w.execute(update(Job).where(Job.id == job).values(name="renamed"))
        assert r.scalar(select(Job.name).where(Job.id == job)) == "j"  # still its own
    with db.read_session(maker) as r:
        assert r.scalar(select(Job.name).where(Job.id == job)) == "renamed"
    engine.dispose()


def test_a_read_session_refuses_to_write_and_its_connection_writes_again_after(sqlite_url):
    engine = db.make_engine(sqlite_url)
    maker = db.make_sessionmaker(engine)
    job = a_job(maker)
    with db.read_session(maker) as r, pytest.raises(OperationalError, match="readonly"):
        r.execute(update(Job).where(Job.id == job).values(name="renamed"))
    with maker.begin() as w:  # the pooled connection the read session had
        w.execute(update(Job).where(Job.id == job).values(name="renamed"))
    with maker() as s:
        assert s.get(Job, job).name == "renamed"
    engine.dispose()


@pytest.fixture
def locked_client(tmp_path: Path, sqlite_url: str) -> Iterator[tuple[TestClient, str]]:
    from orchestrator.app import create_app
    from orchestrator.settings import Settings

    engine = db.make_engine(sqlite_url)
    short_busy_timeout(engine)
    app = create_app(Settings(home=tmp_path / "home", database_url=sqlite_url), engine=engine)
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {app.state.token}"
        yield c, sqlite_url
    engine.dispose()


def test_the_apis_reads_answer_while_the_write_lock_is_held(locked_client):
    client, url = locked_client
    job = client.post("/v1/jobs", json=job_spec(name="big")).json()["id"]
    lock = WriteLock(url)  # the heartbeat flush, say, starved in its transaction
    try:
        assert client.get(f"/v1/jobs/{job}").status_code == 200
        assert [j["id"] for j in client.get("/v1/jobs").json()["items"]] == [job]
        assert client.get(f"/v1/jobs/{job}/events").status_code == 200
    finally:
        lock.release()


@pytest.mark.postgres
def test_on_postgresql_a_read_session_is_the_sessionmakers_own(postgres_server_url):
    reset_postgres(postgres_server_url)
    db.upgrade(postgres_server_url)
    engine = db.make_engine(postgres_server_url)
    maker = db.make_sessionmaker(engine)
    job = a_job(maker)
    with db.read_session(maker) as s:
        assert s.get_bind() is engine
        s.execute(update(Job).where(Job.id == job).values(name="renamed"))
        s.commit()  # nothing refused or changed on PostgreSQL
    with maker() as s:
        assert s.get(Job, job).name == "renamed"
    engine.dispose()
