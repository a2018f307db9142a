"""Request dependencies: a session per request (one transaction), and who may call.

Roles (``orchestrator.store.tokens.Role``) are enforced here, once, by method: the
operator API (``OperatorDep``, on the jobs, recovery and goodput routers) lets a
viewer read (GET, HEAD) and needs an operator for everything else; admin routes
(tokens, sessions) ask for admin with ``AdminDep``. A new write route is therefore
an operator's by default, never a viewer's. A token that is unknown or revoked is
401; a known token whose role is too low is 403 naming the role needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.orm import Session

from orchestrator.api.auth import Principal, bearer_token, operator_principal
from orchestrator.domain.roles import Role
from orchestrator.store.db import read_session

#: Methods that only read: what a viewer may call.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def get_session(request: Request) -> Iterator[Session]:
    # A read (GET, HEAD) reads in a read session: on SQLite it then takes no write lock
    # (``store.db``), which the heartbeat flush and the reconciler's lease need; the
    # read of a 2,044-node job held it for seconds on a starved service.
    maker = request.app.state.sessionmaker
    session = read_session(maker) if request.method in READ_METHODS else maker()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def unauthorized(detail: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"}
    )


def authenticate(request: Request) -> Principal:
    """The caller's operator token, resolved once per request; 401 when there is none
    or it is unknown or revoked."""
    held = getattr(request.state, "principal", None)
    if isinstance(held, Principal):
        return held
    token = bearer_token(request)
    if token is None:
        raise unauthorized("missing bearer token (Authorization: Bearer <token>)")
    principal = operator_principal(request, token)
    if principal is None:
        raise unauthorized("invalid token")  # unknown or revoked: the same to a caller
    request.state.principal = principal
    return principal


def forbid_unless(request: Request, principal: Principal, needed: Role) -> None:
    if not principal.role.allows(needed):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"{request.method} {request.url.path} needs role {needed} "
            f"(token {principal.name!r} has role {principal.role})",
        )


def require_api_access(request: Request) -> Principal:
    """Viewer for reads, operator for writes (see the module docstring)."""
    principal = authenticate(request)
    needed = Role.viewer if request.method in READ_METHODS else Role.operator
    forbid_unless(request, principal, needed)
    return principal


def require_role(needed: Role) -> Callable[[Request], Principal]:
    def dependency(request: Request) -> Principal:
        principal = authenticate(request)
        forbid_unless(request, principal, needed)
        return principal

    dependency.__name__ = f"require_{needed}"
    return dependency


# scope="function": commit (and give the connection back) when the handler returns,
# before the response is sent. With the default, a client could read its own 201
# before the row was committed (seen on PostgreSQL as a foreign-key failure).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
#: The operator API: viewers read, operators write.
OperatorDep = Depends(require_api_access)
AdminDep = Depends(require_role(Role.admin))
PrincipalDep = Annotated[Principal, Depends(authenticate)]
