"""Engine, sessions and schema upgrades. No engine exists until ``make_engine`` is called.

SQLite has one write lock for the whole database. A transaction that may write takes
it at BEGIN (``BEGIN IMMEDIATE``), so it waits its turn instead of failing when it
first writes (see ``_begin``). Work that only reads takes a :func:`read_session`:
on SQLite its transactions begin DEFERRED, and in WAL mode such a reader reads a
snapshot, takes no lock, waits for no writer and blocks none. When every transaction
began IMMEDIATE, reads included, the reconciler's snapshot of a 2,044-node job and
the API's reads of it each held the write lock for seconds on a service starved of
CPU, and the reconciler's lease renewal waited out the busy timeout behind them
(``bench/overload.py`` at 0.3 cores: the killed node was never found). On PostgreSQL,
which has no such lock, a read session is the sessionmaker's own session.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

#: How long a SQLite connection waits for the write lock before "database is locked".
BUSY_TIMEOUT_S = 30.0

#: Execution option: this engine's transactions only read (:func:`read_session`).
_READS_ONLY = "skyresume_reads_only"


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
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_S}
        )

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
            # A transaction that may write: IMMEDIATE, not a plain (deferred) BEGIN.
            # Almost every write transaction reads first, and a deferred one that
            # reads, then writes, fails at once with "database is locked" when another
            # connection holds the lock or committed since its snapshot (SQLite calls
            # no busy handler for a reader's upgrade), where IMMEDIATE waits its turn
            # (the busy timeout). A read session's transaction is DEFERRED and runs
            # with query_only on: a write there would fail only under contention, so
            # it is refused every time, where a test sees it. The pragma is sent only
            # when the pooled connection's last transaction was of the other kind.
            # The driver still sends COMMIT and ROLLBACK itself.
            reads_only = bool(conn.get_execution_options().get(_READS_ONLY, False))
            if conn.info.get(_READS_ONLY, False) is not reads_only:
                conn.exec_driver_sql(f"PRAGMA query_only = {int(reads_only)}")
                conn.info[_READS_ONLY] = reads_only
            conn.exec_driver_sql("BEGIN DEFERRED" if reads_only else "BEGIN IMMEDIATE")

        return engine
    # A server that does not answer is an error in 10 s, not a hang (serve's check).
    connect = {"connect_timeout": 10} if url.startswith("postgresql+psycopg") else {}
    return create_engine(url, pool_pre_ping=True, connect_args=connect)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def read_session(maker: sessionmaker[Session]) -> Session:
    """A session of ``maker`` for work that only reads (its info and events are
    ``maker``'s: the live heartbeat view is found from it). On SQLite its transactions
    begin DEFERRED and refuse writes ("attempt to write a readonly database"); on
    PostgreSQL, or a maker not bound to one engine, it is ``maker()``."""
    if not serializes_writers(maker):
        return maker()
    engine: Engine = maker.kw["bind"]
    return maker(bind=engine.execution_options(**{_READS_ONLY: True}))


def serializes_writers(maker: sessionmaker[Session]) -> bool:
    """``maker``'s database takes one write lock for all of it at a write
    transaction's BEGIN (SQLite): there, work that may write after a long read does the
    read in a :func:`read_session` and takes the lock only when it has a write to make."""
    bind = maker.kw.get("bind")
    return isinstance(bind, Engine) and bind.dialect.name == "sqlite"


def database_locked(e: BaseException) -> bool:
    """``e`` is SQLite's "database is locked": the write lock was held by another
    connection for the whole busy timeout. It says nothing about the data."""
    return isinstance(e, OperationalError) and "database is locked" in str(e.orig)


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
