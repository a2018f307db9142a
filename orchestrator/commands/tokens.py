"""CLI: ``skyresume token create|list|revoke|revoke-sessions``, clients of the admin
routes ``/v1/tokens`` and ``/v1/sessions`` (the caller's token must be admin: the
bootstrap token, or a token created with ``--role admin``).

``create`` prints the new token once, alone on stdout (so ``TOKEN=$(skyresume token
create ...)`` works) and what it is on stderr; the service keeps only its hash, so a
lost token is revoked and created again, never shown again.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from orchestrator.commands.common import (
    Client,
    Output,
    OutputOpt,
    console,
    err_console,
    print_json,
)
from orchestrator.domain.roles import Role

token_app = typer.Typer(
    help="Operator tokens (viewer, operator, admin) and dashboard sessions.",
    no_args_is_help=True,
)


def _when(value: str | None) -> str:
    return "" if not value else value[:19].replace("T", " ")


@token_app.command("create")
def create(
    name: Annotated[str, typer.Option("--name", help="what the token is for, e.g. ci-submit")],
    role: Annotated[Role, typer.Option("--role", help="viewer, operator or admin")],
    output: OutputOpt = Output.table,
) -> None:
    """Create a token with a role and print it once (it is stored only hashed)."""
    doc: dict[str, Any] = Client().request(
        "POST", "/v1/tokens", json={"name": name, "role": role.value}
    )
    if output is Output.json:
        print_json(doc)
        return
    err_console.print(
        f"token {doc['name']!r} (id {doc['id']}, role {doc['role']}); shown once, keep it now:",
        markup=False,
        highlight=False,
    )
    typer.echo(doc["token"])


@token_app.command("list")
def list_(
    all_: Annotated[bool, typer.Option("--all", help="revoked tokens too")] = False,
    output: OutputOpt = Output.table,
) -> None:
    """Tokens by name, role and dates (never the tokens themselves)."""
    from rich.table import Table

    doc: dict[str, Any] = Client().request("GET", "/v1/tokens", params={"all": all_})
    if output is Output.json:
        print_json(doc)
        return
    t = Table("ID", "NAME", "ROLE", "CREATED", "REVOKED")
    for row in doc["items"]:
        t.add_row(
            str(row["id"]), row["name"], row["role"], _when(row["created_at"]),
            _when(row["revoked_at"]),
        )  # fmt: skip
    console.print(t)


@token_app.command("revoke")
def revoke(
    ref: Annotated[str, typer.Argument(help="a live token's name, or any token's id")],
    output: OutputOpt = Output.table,
) -> None:
    """Revoke a token (it gets 401 from now on) and end its dashboard sessions."""
    from urllib.parse import quote

    doc: dict[str, Any] = Client().request("POST", f"/v1/tokens/{quote(ref, safe='')}/revoke")
    if output is Output.json:
        print_json(doc)
        return
    tok = doc["token"]
    console.print(
        f"revoked token {tok['name']!r} (id {tok['id']}, role {tok['role']}); "
        f"{doc['sessions_revoked']} dashboard session(s) ended",
        markup=False,
        highlight=False,
    )


@token_app.command("revoke-sessions")
def revoke_sessions(output: OutputOpt = Output.table) -> None:
    """End every dashboard session: everyone logs in again."""
    doc: dict[str, Any] = Client().request("POST", "/v1/sessions/revoke-all")
    if output is Output.json:
        print_json(doc)
        return
    console.print(f"{doc['revoked']} dashboard session(s) ended")


def register(app: typer.Typer) -> None:
    app.add_typer(token_app, name="token")
