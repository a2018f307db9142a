"""Engine, sessions and schema upgrades. No engine exists until ``make_engine`` is called."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def _normalize(url: str) -> str:
    # "postgresql://" would pick psycopg2; we ship psycopg 3.
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str) -> Engine:
    url = _normalize(url)
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            # The driver's own transaction handling off (SQLAlchemy's pysqlite recipe,
            # "Serializable isolation / Savepoints / Transactional DDL"): left on, it
            # sends no BEGIN before a SAVEPOINT, so a row written inside
            # ``begin_nested()`` was committed on its own and a request that failed
            # after it left the row behind (a retried report then found its key and
            # never wrote the checkpoint row).
            dbapi_conn.isolation_level = None
            # WAL lets the dashboard read while the reconciler writes; foreign keys
            # are off by default in SQLite and the cascade rules rely on them. Both
            # run here, outside any transaction (inside one, SQLite ignores them).
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):  # type: ignore[no-untyped-def]
            # IMMEDIATE, not a plain (deferred) BEGIN: almost every write transaction
            # reads first, and a deferred one that reads, then writes after another
            # connection committed fails at once with "database is locked" (WAL
            # snapshot), where IMMEDIATE waits its turn (the 30 s busy timeout).
            # The driver still sends COMMIT and ROLLBACK itself.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # A server that does not answer is an error in 10 s, not a hang (serve's check).
    connect = {"connect_timeout": 10} if url.startswith("postgresql+psycopg") else {}
    return create_engine(url, pool_pre_ping=True, connect_args=connect)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def migrations_dir() -> Path:
    packaged = Path(__file__).resolve().parent.parent / "_migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "migrations"


def _alembic_config(url: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", _normalize(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(_alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(_alembic_config(url), revision)


def head_revision() -> str:
    """The newest revision in ``migrations/`` (what ``upgrade`` goes to)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config("sqlite://")).get_current_head()
    assert head is not None, "migrations/ has no revisions"
    return str(head)


def known_revisions() -> frozenset[str]:
    """Every revision in ``migrations/``: one not here is newer than this code."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_alembic_config("sqlite://"))
    return frozenset(r.revision for r in script.walk_revisions())


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
