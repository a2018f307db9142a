"""Operator tokens with roles, and dashboard sessions: the rows and their rules.

Neither a token nor a session id is ever stored: a row holds the sha256 of it. Both
are 32 random bytes (``secrets.token_urlsafe``), so a plain hash is enough: there is
nothing to brute-force, and a stolen table opens nothing. A lookup finds the row by
its hash (an index) and then compares the hashes in constant time.

The bootstrap token (``SKYRESUME_TOKEN`` or ``<home>/token``) has no row: the API
compares it itself, and it is admin. Sessions opened with it have ``token_id`` None.

Functions take a Session and commit nothing (the caller owns the transaction), and
take ``now`` so tests fix the clock.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrator.domain.roles import Role
from orchestrator.store.models import AgentEnrolment, ApiToken, Attempt, DashboardSession
from orchestrator.store.repo import NotFound

#: What operator tokens and session ids start with: a log scrubber (and a person
#: reading a leaked string) can tell them apart from anything else.
TOKEN_PREFIX = "sro_"
SESSION_PREFIX = "srs_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

__all__ = ["Role"]  # re-exported: the store's callers name roles from here or the domain


class NameTaken(ValueError):
    """A live token already has that name; the API answers 409."""


def utcnow() -> datetime:
    return datetime.now(UTC)


def _utc(d: datetime) -> datetime:
    return d if d.tzinfo else d.replace(tzinfo=UTC)  # SQLite gives naive datetimes back


def digest(secret: str) -> str:
    """The sha256 (hex) that rows hold instead of the token or session id."""
    return hashlib.sha256(secret.encode()).hexdigest()


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(
            "a token name is 1-64 letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit, got {name!r}"
        )
    if name.isascii() and name.isdigit():
        raise ValueError(f"a token name cannot be all digits (it would read as an id): {name!r}")
    return name


# --- tokens ---------------------------------------------------------------------------


def create_token(
    session: Session, name: str, role: Role, *, now: datetime | None = None
) -> tuple[ApiToken, str]:
    """A new token: its row and the token itself, which exists nowhere else after this
    returns (the caller shows it once). NameTaken when a live token has ``name``."""
    check_name(name)
    plain = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(name=name, role=Role(role).value, token_hash=digest(plain),
                   created_at=now or utcnow())  # fmt: skip
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:
        raise NameTaken(f"a token named {name!r} exists; revoke it first") from None
    return row, plain


def list_tokens(session: Session, *, include_revoked: bool = False) -> list[ApiToken]:
    q = select(ApiToken).order_by(ApiToken.id)
    if not include_revoked:
        q = q.where(ApiToken.revoked_at.is_(None))
    return list(session.scalars(q))


def find_token(session: Session, ref: str) -> ApiToken:
    """The live token named ``ref``, or with id ``ref`` (digits; revoked or not)."""
    if ref.isascii() and ref.isdigit():
        # An id past any row's (and past BIGINT: PostgreSQL would refuse the query) is
        # simply not found.
        row = session.get(ApiToken, int(ref)) if len(ref) <= 18 else None
    else:
        q = select(ApiToken).where(ApiToken.name == ref, ApiToken.revoked_at.is_(None))
        row = session.scalars(q).first()
    if row is None:
        raise NotFound(f"no token {ref!r} (give a live token's name or any token's id)")
    return row


def revoke_token(
    session: Session, ref: str, *, now: datetime | None = None
) -> tuple[ApiToken, int]:
    """Revoke a token and every dashboard session opened with it: (the row, how many
    sessions ended). Revoking a revoked token changes nothing."""
    now = now or utcnow()
    row = find_token(session, ref)
    if row.revoked_at is None:
        row.revoked_at = now
    ended = session.execute(
        update(DashboardSession)
        .where(DashboardSession.token_id == row.id, DashboardSession.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    session.flush()
    return row, int(ended.rowcount or 0)  # type: ignore[attr-defined]


def lookup_token(session: Session, plain: str) -> ApiToken | None:
    """The live token whose hash matches ``plain`` (None: unknown or revoked)."""
    if not plain.startswith(TOKEN_PREFIX):
        return None  # not one of ours: no query
    want = digest(plain)
    row = session.scalars(select(ApiToken).where(ApiToken.token_hash == want)).first()
    if row is None or row.revoked_at is not None:
        return None
    return row if hmac.compare_digest(row.token_hash, want) else None


# --- dashboard sessions -----------------------------------------------------------------


def open_session(
    session: Session,
    *,
    role: Role,
    token_id: int | None,
    ttl: timedelta,
    now: datetime | None = None,
) -> str:
    """A new dashboard session; returns the session id for the cookie (stored hashed)."""
    now = now or utcnow()
    plain = SESSION_PREFIX + secrets.token_urlsafe(32)
    session.add(
        DashboardSession(
            session_hash=digest(plain),
            token_id=token_id,
            role=Role(role).value,
            created_at=now,
            expires_at=now + ttl,
        )
    )
    session.flush()
    return plain


def lookup_session(
    session: Session, plain: str, *, now: datetime | None = None
) -> DashboardSession | None:
    """The live session ``plain`` names: not revoked, not expired, and its token (if it
    has one) not revoked. None otherwise."""
    if not plain.startswith(SESSION_PREFIX):
        return None
    now = now or utcnow()
    want = digest(plain)
    row = session.scalars(
        select(DashboardSession).where(DashboardSession.session_hash == want)
    ).first()
    if row is None or row.revoked_at is not None or _utc(row.expires_at) <= now:
        return None
    if row.token_id is not None:
        token = session.get(ApiToken, row.token_id)
        if token is None or token.revoked_at is not None:
            return None
    return row if hmac.compare_digest(row.session_hash, want) else None


def close_session(session: Session, plain: str, *, now: datetime | None = None) -> bool:
    """Revoke the session ``plain`` names (logout); False when there was none live."""
    if not plain.startswith(SESSION_PREFIX):
        return False
    ended = session.execute(
        update(DashboardSession)
        .where(
            DashboardSession.session_hash == digest(plain), DashboardSession.revoked_at.is_(None)
        )
        .values(revoked_at=now or utcnow())
    )
    return bool(ended.rowcount)  # type: ignore[attr-defined]


def revoke_all_sessions(session: Session, *, now: datetime | None = None) -> int:
    """End every live dashboard session; how many ended."""
    now = now or utcnow()
    ended = session.execute(
        update(DashboardSession)
        .where(DashboardSession.revoked_at.is_(None), DashboardSession.expires_at > now)
        .values(revoked_at=now)
    )
    return int(ended.rowcount or 0)  # type: ignore[attr-defined]


# --- agent enrolment (the token a launched task carries) -------------------------------
#
# A launch's task carries an enrolment token, never the attempt's agent token: SkyPilot
# stores the task (secrets included) in plaintext in its request database, returns it
# from /api/status, and writes it into the driver scripts on the head (SKYPILOT.md
# 1.13). Each node exchanges the enrolment token once, at its first register, for the
# attempt's agent token (``auth.job_token``, which it keeps in memory only), and the
# exchange is a row here: the same token and node again is a replay, refused. Past
# ``expires`` (a launch's provisioning and setup time, SKYRESUME_ENROLMENT_TTL_S) it
# opens nothing either. So the copy SkyPilot keeps is spent once the nodes are up.
#
# The token itself is stateless (like the agent token: minting writes nothing, so a
# launcher can mint inside the reconciler's transaction, on any replica):
# ``sre_<expires, unix seconds, hex>.<nonce>.<HMAC-SHA256 of job, attempt, expires,
# nonce>``, keyed by a key derived from the bootstrap token.

ENROLMENT_PREFIX = "sre_"
_ENROLMENT_KEY_LABEL = b"skyresume enrolment tokens v1"
_ENROLMENT = re.compile(r"^sre_([0-9a-f]{1,12})\.([A-Za-z0-9_-]{16,64})\.([0-9a-f]{64})$")


class EnrolmentRefused(ValueError):
    """The enrolment token opens nothing (the message says why); the API answers 401."""


def _enrolment_mac(service_token: str, job_id: str, attempt: int, expires: int, nonce: str) -> str:
    key = hmac.new(service_token.encode(), _ENROLMENT_KEY_LABEL, hashlib.sha256).digest()
    msg = f"{job_id}\n{int(attempt)}\n{expires}\n{nonce}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def enrolment_token(
    service_token: str, job_id: str, attempt: int, *, ttl: timedelta, now: datetime | None = None
) -> str:
    """A new enrolment token for the nodes of one launch of ``attempt`` of ``job_id``,
    valid for ``ttl`` and once per node."""
    expires = int(((now or utcnow()) + ttl).timestamp())
    nonce = secrets.token_urlsafe(16)
    mac = _enrolment_mac(service_token, job_id, attempt, expires, nonce)
    return f"{ENROLMENT_PREFIX}{expires:x}.{nonce}.{mac}"


def use_enrolment(
    session: Session,
    service_token: str,
    plain: str,
    job_id: str,
    attempt: int,
    node_id: str,
    *,
    instance: str | None = None,
    now: datetime | None = None,
) -> None:
    """Spend ``plain`` for ``node_id`` (one of ``<job>-a<attempt>-n<k>``, k below the
    attempt's node count), or :class:`EnrolmentRefused` naming why: not one of ours,
    another attempt's, expired, or already used by this node (a replay).

    ``instance`` (the agent process's random id, sent with its register) makes the
    exchange idempotent for that process alone: the same agent asking again with the
    same token, because the answer to its first register was lost (a slow service, a
    dropped connection), is answered again; anyone else presenting the spent token is
    still a replay."""
    now = now or utcnow()
    m = _ENROLMENT.match(plain)
    if m is None:
        raise EnrolmentRefused("not an enrolment token")
    expires, nonce, mac = int(m.group(1), 16), m.group(2), m.group(3)
    want = _enrolment_mac(service_token, job_id, attempt, expires, nonce)
    if not hmac.compare_digest(mac, want):
        raise EnrolmentRefused(f"this enrolment token is not for attempt {attempt} of job {job_id}")
    if now.timestamp() >= expires:
        at = datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds")
        raise EnrolmentRefused(
            f"this enrolment token expired at {at} (SKYRESUME_ENROLMENT_TTL_S after its launch)"
        )
    row = session.execute(
        select(Attempt.num_nodes, Attempt.handle).where(
            Attempt.job_id == job_id, Attempt.number == attempt
        )
    ).first()
    nodes = row.num_nodes if row is not None else None
    # Node ranks 0..num_nodes-1, or any id the attempt's launches named: a standby
    # asked for again is ranked past every earlier try's (``LaunchSpare``).
    launched = ((row.handle if row is not None else None) or {}).get("node_ids") or []
    k = node_id.removeprefix(f"{job_id}-a{attempt}-n")
    ranked = k.isascii() and k.isdigit() and len(k) < 6 and nodes is not None and int(k) < nodes
    if nodes is None or not (ranked or node_id in launched):
        raise EnrolmentRefused(
            f"node {node_id!r} is not a node of attempt {attempt} of job {job_id} "
            f"({nodes or 0} nodes: {job_id}-a{attempt}-n0...)"
        )
    token_hash = digest(plain)
    used = session.get(AgentEnrolment, (token_hash, node_id))
    if used is None:
        try:
            with session.begin_nested():
                row = AgentEnrolment(
                    token_hash=token_hash, node_id=node_id, job_id=job_id, attempt=attempt,
                    used_at=now, instance_hash=digest(instance) if instance else None,
                )  # fmt: skip
                session.add(row)
                session.flush()
            return
        except IntegrityError:  # another register of the same node won the race
            used = session.get(AgentEnrolment, (token_hash, node_id))
    if (
        used is not None
        and instance
        and used.instance_hash
        and hmac.compare_digest(used.instance_hash, digest(instance))
    ):
        return  # the same agent again: its first answer never reached it
    when = _utc(used.used_at).isoformat(timespec="seconds") if used is not None else "just now"
    raise EnrolmentRefused(
        f"this enrolment token was already used by node {node_id} at {when}: a replay "
        "(a registered agent presents the agent token its register returned)"
    )
