"""Browser sessions for the dashboard.

The operator types the token once on the login form; the browser then holds a
cookie that is *derived* from the token (HMAC-SHA256 of a fixed label, keyed by the
token), not the token itself. So a leaked cookie opens the dashboard but is not an
API bearer token, and changing the token ends every dashboard session.

The cookie is HttpOnly (no script reads it), SameSite=Strict (no other site's page
can send it: the CSRF defence for the dashboard's POSTs), scoped to ``/dashboard``,
and Secure when the request came over HTTPS (over plain HTTP a Secure cookie would
never come back, which would make login on a loopback service impossible).
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request, Response

COOKIE = "skyresume_dashboard"
COOKIE_PATH = "/dashboard"
MAX_AGE_S = 7 * 24 * 3600
_LABEL = b"skyresume dashboard session v1"


def session_value(token: str) -> str:
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).hexdigest()


def is_logged_in(request: Request) -> bool:
    given = request.cookies.get(COOKIE, "")
    expected = session_value(request.app.state.token)
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def token_is_right(request: Request, given: str) -> bool:
    return hmac.compare_digest(given.strip().encode(), request.app.state.token.encode())


def set_session(request: Request, response: Response) -> None:
    response.set_cookie(
        COOKIE,
        session_value(request.app.state.token),
        max_age=MAX_AGE_S,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_session(request: Request, response: Response) -> None:
    response.delete_cookie(
        COOKIE,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def safe_next(target: str | None) -> str:
    """Where to go after login: only a dashboard path on this site (no open redirect)."""
    if (
        target
        and target.startswith("/dashboard")
        and not target.startswith("//")
        and "\\" not in target
        and all(c.isprintable() for c in target)
    ):
        return target
    return "/dashboard/"
