"""Alembic owns the schema: upgrade from empty, parity with the models, downgrade."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from orchestrator.store import db
from orchestrator.store.models import Base

TABLES = {
    "jobs",
    "job_transitions",
    "failure_events",
    "attempts",
    "nodes",
    "checkpoints",
    "protocol_steps",
    "node_commands",
    "leases",
}


def test_upgrade_from_empty_creates_every_table(empty_db_url):
    db.upgrade(empty_db_url)
    engine = db.make_engine(empty_db_url)
    try:
        assert set(inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()
    assert db.current_revision(empty_db_url) == db.head_revision()


def test_migrated_schema_matches_the_models(db_url):
    engine = db.make_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_downgrade_to_base_removes_everything(db_url):
    db.downgrade(db_url, "base")
    engine = db.make_engine(db_url)
    try:
        left = set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()
    assert left == set()
    db.upgrade(db_url)  # and back up again
    assert db.current_revision(db_url) == db.head_revision()


def test_upgrade_keeps_rows_written_under_the_previous_revision(empty_db_url):
    """0001 -> head on a database that already holds an attempt: no row is lost."""
    from sqlalchemy import text

    db.upgrade(empty_db_url, "0001")
    engine = db.make_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, name, status, spec, restart_count, created_at, "
                    "updated_at) VALUES ('j1', 'n', 'running', '{}', 0, :t, :t)"
                ),
                {"t": "2026-12-01 00:00:00+00:00"},
            )
            conn.execute(
                text(
                    "INSERT INTO attempts (job_id, number, cloud, region, instance_type, "
                    "num_nodes, spot, knobs, started_at) VALUES ('j1', 1, 'aws', 'us-east-1', "
                    "'p4d.24xlarge', 2, true, '{}', :t)"
                ),
                {"t": "2026-12-01 00:00:00+00:00"},
            )
        db.upgrade(empty_db_url)
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT number, state FROM attempts")).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [(1, "ended")]
