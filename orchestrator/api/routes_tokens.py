"""/v1/tokens and /v1/sessions: token and dashboard-session management (admin), and
/v1/whoami (any role).

A token is in a response once, in the 201 of its creation; every other answer
names tokens by name and id only. Revoking a token also ends every dashboard
session opened with it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, status
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.api.deps import AdminDep, OperatorDep, PrincipalDep, SessionDep
from orchestrator.api.schemas import UtcDatetime
from orchestrator.api.strict import StrictQueryRoute
from orchestrator.domain.roles import Role
from orchestrator.store import tokens
from orchestrator.store.repo import NotFound

admin = APIRouter(
    prefix="/v1", dependencies=[AdminDep], tags=["tokens"], route_class=StrictQueryRoute
)
anyone = APIRouter(
    prefix="/v1", dependencies=[OperatorDep], tags=["tokens"], route_class=StrictQueryRoute
)


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, examples=["ci-submit"])
    role: Role


class TokenOut(BaseModel):
    id: int
    name: str
    role: Role
    created_at: UtcDatetime
    revoked_at: UtcDatetime | None


class TokenCreated(TokenOut):
    token: str
    """The token itself: shown here once, stored nowhere (only its hash)."""


class TokenList(BaseModel):
    items: list[TokenOut]


class Revoked(BaseModel):
    token: TokenOut
    sessions_revoked: int


class SessionsRevoked(BaseModel):
    revoked: int


class WhoAmI(BaseModel):
    name: str
    role: Role


@admin.post("/tokens", status_code=201, response_model=TokenCreated)
def create_token(body: TokenIn, session: SessionDep) -> TokenCreated:
    """A new operator token with a role. 409 when a live token has that name."""
    try:
        row, plain = tokens.create_token(session, body.name, body.role)
    except tokens.NameTaken as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from None
    except ValueError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(e)) from None
    out = TokenOut.model_validate(row, from_attributes=True)
    return TokenCreated(**out.model_dump(), token=plain)


@admin.get("/tokens", response_model=TokenList)
def list_tokens(
    session: SessionDep,
    all_: Annotated[bool, Query(alias="all", description="include revoked tokens")] = False,
) -> TokenList:
    rows = tokens.list_tokens(session, include_revoked=all_)
    return TokenList(items=[TokenOut.model_validate(r, from_attributes=True) for r in rows])


@admin.post("/tokens/{ref}/revoke", response_model=Revoked)
def revoke_token(
    session: SessionDep,
    ref: Annotated[str, Path(min_length=1, max_length=64, description="a name or an id")],
) -> Revoked:
    """Revoke a token (by live name or id) and the dashboard sessions opened with it."""
    try:
        row, ended = tokens.revoke_token(session, ref)
    except NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from None
    return Revoked(token=TokenOut.model_validate(row, from_attributes=True), sessions_revoked=ended)


@admin.post("/sessions/revoke-all", response_model=SessionsRevoked)
def revoke_all_sessions(session: SessionDep) -> SessionsRevoked:
    """End every dashboard session (everyone logs in again)."""
    return SessionsRevoked(revoked=tokens.revoke_all_sessions(session))


@anyone.get("/whoami", response_model=WhoAmI)
def whoami(principal: PrincipalDep) -> WhoAmI:
    """The name and role of the token this request came with."""
    return WhoAmI(name=principal.name, role=principal.role)


router = APIRouter()
router.include_router(admin)
router.include_router(anyone)
