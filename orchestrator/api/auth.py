"""Who a request is: the bootstrap token, operator tokens with roles, agent tokens.

* The **bootstrap token**: ``SKYRESUME_TOKEN``, or in local mode a random token the
  service creates once in ``<home>/token`` (mode 0600) and the CLI reads from there,
  so a single-user machine needs no setup. It is admin and is never stored in the
  database; it is compared in constant time.
* **Operator tokens** (``sro_...``): made with ``skyresume token create --role R``,
  stored as their sha256 (:mod:`orchestrator.store.tokens`), each with a role:
  viewer (reads), operator (writes: submit, cancel, chaos) or admin (tokens and
  sessions). Revoked ones get 401.
* **Agent tokens** (``sra_...``): what one attempt's nodes are given, as a task
  secret. HMAC-SHA256 of ``job id + attempt``, keyed by a key derived from the
  bootstrap token, so it costs no query to check (heartbeats must stay cheap) and
  opens the agent routes of that one attempt and nothing else: an old attempt's
  node cannot speak for the new one, and a leaked node credential opens no operator
  route. Changing the bootstrap token ends every agent token (and so every running
  attempt's link to the service): rotate it between jobs.

No token is ever logged: :class:`RedactSecrets` scrubs the loggers that carry
request data (uvicorn's access and error logs) of bearer values and of anything
shaped like our tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.settings import Settings

if TYPE_CHECKING:
    from fastapi import Request

    from orchestrator.domain.roles import Role

AGENT_TOKEN_PREFIX = "sra_"
#: The name the bootstrap token goes by in messages and in ``token list``.
BOOTSTRAP = "bootstrap"
_AGENT_KEY_LABEL = b"skyresume agent tokens v2"


def ensure_local_token(settings: Settings) -> str:
    if settings.token:
        return settings.token
    path = settings.token_path
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    # O_EXCL: two services starting at once must not hand out different tokens.
    tmp = path.with_name(f".token.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        token = path.read_text().strip()
    finally:
        tmp.unlink(missing_ok=True)
    return token


def read_client_token(settings: Settings) -> str | None:
    if settings.token:
        return settings.token
    path: Path = settings.token_path
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def token_matches(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())


def job_token(service_token: str, job_id: str, attempt: int) -> str:
    """The bearer token of attempt ``attempt`` of job ``job_id``'s agents (see the
    module docstring). The key is derived from the bootstrap token rather than the
    token itself, so no HMAC output is ever keyed by a credential that is also a
    bearer token."""
    key = hmac.new(service_token.encode(), _AGENT_KEY_LABEL, hashlib.sha256).digest()
    msg = f"{job_id}\n{int(attempt)}".encode()
    return AGENT_TOKEN_PREFIX + hmac.new(key, msg, hashlib.sha256).hexdigest()


def node_token(service_token: str, job_id: str, attempt: int, node_id: str) -> str:
    """The bearer token ``register`` hands node ``node_id`` of that attempt: it opens
    that node's routes only, so one node's token cannot report as its peers (a
    compromised node could otherwise mark the others lost, or speak for their ranks).
    Same shape as :func:`job_token` (``sra_``), a different message under its key."""
    key = hmac.new(service_token.encode(), _AGENT_KEY_LABEL, hashlib.sha256).digest()
    msg = f"{job_id}\n{int(attempt)}\nnode\n{node_id}".encode()
    return AGENT_TOKEN_PREFIX + hmac.new(key, msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Whoever presented an operator token (bootstrap or stored)."""

    name: str
    role: Role
    token_id: int | None
    """The ``api_tokens`` row; None for the bootstrap token."""


def bearer_token(request: Request) -> str | None:
    """The ``Authorization: Bearer`` value (None: absent or another scheme)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def operator_principal(request: Request, token: str) -> Principal | None:
    """Who ``token`` is, as an operator token (None: not one, or revoked). The
    bootstrap token costs no query; a stored token one indexed lookup."""
    from orchestrator.domain.roles import Role
    from orchestrator.store import tokens
    from orchestrator.store.db import read_session

    if token_matches(token, request.app.state.token):
        return Principal(BOOTSTRAP, Role.admin, None)
    if not token.startswith(tokens.TOKEN_PREFIX):
        return None
    with read_session(request.app.state.sessionmaker) as s:  # every request: no write lock
        row = tokens.lookup_token(s, token)
        return None if row is None else Principal(row.name, Role(row.role), row.id)


# --- keeping tokens out of logs ---------------------------------------------------------

_SHAPES = re.compile(
    r"(?i:bearer)\s+\S+"  # an Authorization header value
    r"|\bsr[oas]_[A-Za-z0-9_\-]{8,}"  # our operator, agent and session tokens
    r"|(?<=[?&])(?P<key>(?i:token|session|access_token))=[^&\s\"]+"  # in a query string
)


def _redacted(m: re.Match[str]) -> str:
    return f"{m['key']}=[redacted]" if m["key"] else "[redacted]"


class RedactSecrets(logging.Filter):
    """Replaces bearer values, our token shapes and the given literal secrets (the
    bootstrap token has no shape of its own) in a record's message and arguments.

    The arguments are scrubbed one by one, not folded into the message: uvicorn's
    access formatter unpacks ``record.args`` itself."""

    def __init__(self) -> None:
        super().__init__("skyresume-redact")
        self.literals: set[str] = set()

    def scrub(self, text: str) -> str:
        for lit in self.literals:
            if lit and lit in text:
                text = text.replace(lit, "[redacted]")
        return _SHAPES.sub(_redacted, text)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.scrub(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self.scrub(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {
                k: self.scrub(v) if isinstance(v, str) else v for k, v in record.args.items()
            }
        return True


#: One filter per process: every app adds its bootstrap token to it.
REDACT = RedactSecrets()
#: The loggers that carry request data (paths with query strings, tracebacks).
REDACTED_LOGGERS = ("uvicorn.access", "uvicorn.error", "uvicorn", "fastapi")


def install_redaction(*literals: str) -> None:
    REDACT.literals.update(x for x in literals if x)
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if REDACT not in logger.filters:
            logger.addFilter(REDACT)
