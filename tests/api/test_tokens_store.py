"""The token and session store (orchestrator/store/tokens.py) on SQLite and PostgreSQL,
at a fixed clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from orchestrator.domain.roles import Role
from orchestrator.store import db, tokens
from orchestrator.store.models import ApiToken, DashboardSession
from orchestrator.store.repo import NotFound

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TTL = timedelta(hours=12)


@pytest.fixture
def sm(db_url):  # type: ignore[no-untyped-def]
    engine = db.make_engine(db_url)
    yield db.make_sessionmaker(engine)
    engine.dispose()


def test_a_token_is_stored_only_as_its_hash_and_found_by_it(sm):
    with sm.begin() as s:
        _, plain = tokens.create_token(s, "ci", Role.operator, now=NOW)
    assert plain.startswith(tokens.TOKEN_PREFIX) and len(plain) > 40
    with sm() as s:
        stored = s.scalars(select(ApiToken)).one()
        assert plain not in (stored.token_hash, stored.name)
        assert stored.token_hash == tokens.digest(plain)
        found = tokens.lookup_token(s, plain)
        assert found is not None and (found.name, found.role) == ("ci", "operator")
        assert tokens.lookup_token(s, plain + "x") is None
        assert tokens.lookup_token(s, "not-ours") is None


def test_two_live_tokens_never_share_a_name_but_a_revoked_name_is_free_again(sm):
    with sm.begin() as s:
        tokens.create_token(s, "ci", Role.viewer, now=NOW)
    with sm.begin() as s, pytest.raises(tokens.NameTaken):
        tokens.create_token(s, "ci", Role.admin, now=NOW)
    with sm.begin() as s:
        tokens.revoke_token(s, "ci", now=NOW)
        tokens.create_token(s, "ci", Role.admin, now=NOW)
    with sm() as s:
        assert [t.role for t in tokens.list_tokens(s)] == ["admin"]
        assert len(tokens.list_tokens(s, include_revoked=True)) == 2
        assert tokens.find_token(s, "ci").role == "admin"


@pytest.mark.parametrize("name", ["", "-x", "a b", "x" * 65, "123", "ü"])
def test_a_bad_name_is_refused(sm, name):
    with sm.begin() as s, pytest.raises(ValueError):
        tokens.create_token(s, name, Role.viewer, now=NOW)


def test_a_revoked_token_is_found_by_nobody_and_its_sessions_end(sm):
    with sm.begin() as s:
        row, plain = tokens.create_token(s, "alice", Role.viewer, now=NOW)
        mine = tokens.open_session(s, role=Role.viewer, token_id=row.id, ttl=TTL, now=NOW)
        other = tokens.open_session(s, role=Role.admin, token_id=None, ttl=TTL, now=NOW)
    with sm.begin() as s:
        revoked, ended = tokens.revoke_token(s, str(row.id), now=NOW)  # by id
    assert ended == 1 and revoked.revoked_at is not None
    with sm() as s:
        assert tokens.lookup_token(s, plain) is None
        assert tokens.lookup_session(s, mine, now=NOW) is None
        assert tokens.lookup_session(s, other, now=NOW) is not None
    with sm.begin() as s, pytest.raises(NotFound):
        tokens.revoke_token(s, "alice", now=NOW)  # a revoked name names nothing live


def test_a_session_is_stored_hashed_and_ends_at_its_expiry(sm):
    with sm.begin() as s:
        sid = tokens.open_session(s, role=Role.viewer, token_id=None, ttl=TTL, now=NOW)
    with sm() as s:
        row = s.scalars(select(DashboardSession)).one()
        assert row.session_hash == tokens.digest(sid) and sid not in row.session_hash
        assert tokens.lookup_session(s, sid, now=NOW + TTL - timedelta(seconds=1)) is not None
        assert tokens.lookup_session(s, sid, now=NOW + TTL) is None


def test_logout_and_revoke_all_end_sessions(sm):
    with sm.begin() as s:
        a, b, c = (
            tokens.open_session(s, role=Role.viewer, token_id=None, ttl=TTL, now=NOW)
            for _ in range(3)
        )
    with sm.begin() as s:
        assert tokens.close_session(s, a, now=NOW) is True
        assert tokens.close_session(s, a, now=NOW) is False  # once
    with sm.begin() as s:
        assert tokens.revoke_all_sessions(s, now=NOW) == 2
    with sm() as s:
        assert all(tokens.lookup_session(s, x, now=NOW) is None for x in (a, b, c))


def test_roles_are_ordered():
    assert Role.admin.allows(Role.operator) and Role.operator.allows(Role.viewer)
    assert not Role.viewer.allows(Role.operator) and not Role.operator.allows(Role.admin)


@pytest.mark.parametrize(
    "ref", ["9" * 30, "²", "0", "nobody"], ids=["huge", "unicode-digit", "0", "name"]
)
def test_a_ref_that_names_no_token_is_not_found_on_either_backend(sm, ref):
    with sm() as s, pytest.raises(NotFound):
        tokens.find_token(s, ref)
