"""Request dependencies: a session per request (one transaction), and operator auth."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.orm import Session

from orchestrator.api.auth import token_matches


def get_session(request: Request) -> Iterator[Session]:
    session = request.app.state.sessionmaker()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def require_operator(request: Request) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not token_matches(token.strip(), request.app.state.token):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid token", headers={"WWW-Authenticate": "Bearer"}
        )


# scope="function": commit (and give the connection back) when the handler returns,
# before the response is sent. With the default, a client could read its own 201
# before the row was committed (seen on PostgreSQL as a foreign-key failure).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
OperatorDep = Depends(require_operator)
