"""No token in a log line: the service's request loggers scrub bearer values, our
token shapes and the bootstrap token, and uvicorn's access lines still format."""

from __future__ import annotations

import logging

import pytest
from uvicorn.logging import AccessFormatter

from orchestrator.api.auth import REDACT, REDACTED_LOGGERS, RedactSecrets, job_token

BOOT = "Zq3-bootstrap-token-with-no-shape-of-its-own"


@pytest.fixture
def redact() -> RedactSecrets:
    f = RedactSecrets()
    f.literals.add(BOOT)
    return f


def record(msg: str, args: tuple | None = None, name: str = "uvicorn.access") -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)


@pytest.mark.parametrize(
    "line",
    [
        "Authorization: Bearer sro_abcdefghijklmnop",
        "authorization: bearer whatever-it-is",
        "GET /v1/jobs?token=s3cr3t&limit=5",
        "GET /dashboard/?session=abc HTTP/1.1",
        f"agent token {job_token('k', 'j-1', 3)}",
        "cookie srs_0123456789abcdef",
        f"the bootstrap {BOOT} itself",
    ],
    ids=["bearer", "bearer-lower", "query-token", "query-session", "agent", "session", "boot"],
)
def test_a_secret_in_a_message_is_redacted(redact, line):
    r = record(line)
    redact.filter(r)
    text = r.getMessage()
    assert "[redacted]" in text
    for secret in ("sro_abc", "whatever-it-is", "s3cr3t", "sra_", "srs_0123", BOOT, "=abc"):
        assert secret not in text


def test_uvicorn_access_lines_keep_their_shape_and_lose_the_token(redact):
    r = record(
        '%s - "%s %s HTTP/%s" %d',
        ("10.0.0.5:4242", "GET", f"/v1/jobs?token={BOOT}&limit=5", "1.1", 200),
    )
    assert redact.filter(r) is True
    line = AccessFormatter(fmt="%(message)s", use_colors=False).format(r)
    assert line == '10.0.0.5:4242 - "GET /v1/jobs?token=[redacted]&limit=5 HTTP/1.1" 200'


def test_an_ordinary_line_is_left_alone(redact):
    r = record("attempt 2 of job j-1 is not the current attempt (node n0)")
    redact.filter(r)
    assert r.getMessage() == "attempt 2 of job j-1 is not the current attempt (node n0)"


def test_the_app_puts_the_filter_on_the_request_loggers_with_its_bootstrap_token(app):
    for name in REDACTED_LOGGERS:
        assert REDACT in logging.getLogger(name).filters
    assert app.state.token in REDACT.literals
