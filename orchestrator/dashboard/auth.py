"""Browser sessions for the dashboard.

The operator types a token once on the login form (the bootstrap token or any live
operator token, of any role: the dashboard only reads); the service opens a
server-side session (:mod:`orchestrator.store.tokens`) and the browser holds its
random session id in a cookie. The database keeps only the id's sha256, so neither
a leaked cookie nor a leaked table is an API bearer token.

A session ends when it expires (``dashboard_session_hours``, 12 h by default), on
logout, when the token it was opened with is revoked, or when an admin revokes every
session (``skyresume token revoke-sessions``). Every page checks the row, so an end
takes effect on the next request.

The cookie is HttpOnly (no script reads it), SameSite=Strict (no other site's page
can send it: the CSRF defence for the dashboard's POSTs), scoped to ``/dashboard``,
and Secure when the request came over HTTPS (over plain HTTP a Secure cookie would
never come back, which would make login on a loopback service impossible).
"""

from __future__ import annotations

from datetime import timedelta

from fastapi import Request, Response

from orchestrator.api.auth import operator_principal
from orchestrator.store import tokens
from orchestrator.store.db import read_session
from orchestrator.store.models import DashboardSession

COOKIE = "skyresume_dashboard"
COOKIE_PATH = "/dashboard"


def _ttl(request: Request) -> timedelta:
    return timedelta(hours=request.app.state.settings.dashboard_session_hours)


def current_session(request: Request) -> DashboardSession | None:
    """The live session this request's cookie names (one lookup per request)."""
    if hasattr(request.state, "dashboard_session"):
        held: DashboardSession | None = request.state.dashboard_session
        return held
    given = request.cookies.get(COOKIE, "")
    row = None
    if given:
        with read_session(request.app.state.sessionmaker) as s:
            row = tokens.lookup_session(s, given)
    request.state.dashboard_session = row
    return row


def is_logged_in(request: Request) -> bool:
    return current_session(request) is not None


def open_session(request: Request, given_token: str) -> str | None:
    """A new session for the holder of ``given_token``: its id for the cookie, or None
    when the token is not a live operator token."""
    principal = operator_principal(request, given_token.strip())
    if principal is None:
        return None
    with request.app.state.sessionmaker.begin() as s:
        return tokens.open_session(
            s, role=principal.role, token_id=principal.token_id, ttl=_ttl(request)
        )


def end_session(request: Request) -> None:
    """Revoke the session of this request's cookie (logout)."""
    given = request.cookies.get(COOKIE, "")
    if given:
        with request.app.state.sessionmaker.begin() as s:
            tokens.close_session(s, given)


def set_session(request: Request, response: Response, session_id: str) -> None:
    response.set_cookie(
        COOKIE,
        session_id,
        max_age=int(_ttl(request).total_seconds()),
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


def _origin(url: str) -> str | None:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if not parts.scheme or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}".lower()


def foreign_origin(request: Request) -> str | None:
    """The other site a form POST came from (None: this one, or no browser said).

    Login CSRF: without this check, any page could post its own operator token to
    our login and leave the victim's browser logged in as the attacker, so what they
    then type into the dashboard lands in the attacker's account. SameSite cookies do
    not help with a login, which sets the cookie rather than sends one. A browser
    sends ``Origin`` on every cross-site POST (``null`` from a sandboxed page), else
    ``Referer``; a request with neither is not from a browser page and is let through.
    """
    given = request.headers.get("origin") or request.headers.get("referer")
    if given is None:
        return None
    ours = {_origin(str(request.base_url))}
    settings = request.app.state.settings
    ours |= {_origin(u) for u in (settings.public_url, settings.service_url) if u}
    theirs = _origin(given) if given != "null" else "null"
    return None if theirs in ours else str(theirs or given)[:200]


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
