"""Operator bearer tokens.

With ``SKYRESUME_TOKEN`` set, that is the token. Without it (local mode) the
service creates a random token once, in ``<home>/token`` with mode 0600, and the
CLI reads it from the same place, so a single-user machine needs no setup.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from orchestrator.settings import Settings


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


def job_token(service_token: str, job_id: str) -> str:
    """The bearer token a job's agents and ranks use: HMAC-SHA256 of the job id keyed
    by the service token. It opens that job's agent routes and nothing else, so a
    leaked node credential cannot touch other jobs or operator routes."""
    import hashlib
    import hmac

    return hmac.new(service_token.encode(), job_id.encode(), hashlib.sha256).hexdigest()
