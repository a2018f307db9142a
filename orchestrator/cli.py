"""The operator CLI: a thin REST client of the service, plus ``serve`` and ``db``.

Heavy modules (FastAPI, SQLAlchemy, uvicorn, cloud SDKs, torch) are imported inside
the commands that need them, so ``skyresume --help`` and the client commands start
fast. Every failure the operator can cause or fix (service down, wrong token, bad
spec) prints one ``error:`` line and exits non-zero; tracebacks are for bugs.
"""

from __future__ import annotations

import json
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="skyresume",
    help="Keep multi-node PyTorch training alive on spot instances.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema (Alembic).", no_args_is_help=True)
app.add_typer(db_app, name="db")


def _register_command_modules() -> None:
    # Each area keeps its commands in orchestrator/commands/<area>.py (light imports).
    from orchestrator.commands import cloud, failures, goodput, plan, recovery

    cloud.register(app)
    failures.register(app)
    goodput.register(app)
    plan.register(app)
    recovery.register(app)


console = Console()
err_console = Console(stderr=True)


class Output(StrEnum):
    table = "table"
    json = "json"


OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table or json")]


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _settings():  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from orchestrator.settings import Settings

    try:
        return Settings()
    except ValidationError as e:
        first = e.errors()[0]
        fail(f"bad setting SKYRESUME_{str(first['loc'][0]).upper()}: {first['msg']}", 2)


class Client:
    """The REST client: one place that turns HTTP failures into operator messages."""

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        import httpx

        from orchestrator.api.auth import read_client_token

        settings = _settings()
        self.url = (url or settings.effective_service_url).rstrip("/")
        self.token = token or read_client_token(settings)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def request(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        try:
            r = self.http.request(method, path, **kw)
        except httpx.ConnectError:
            fail(
                f"cannot reach the skyresume service at {self.url} (is `skyresume serve` running?)"
            )
        except httpx.TimeoutException:
            fail(f"the skyresume service at {self.url} did not answer in time")
        except httpx.HTTPError as e:
            fail(f"request to {self.url} failed: {e}")
        if r.status_code == 401:
            hint = "set SKYRESUME_TOKEN" if not self.token else "check SKYRESUME_TOKEN"
            fail(f"the service rejected the token ({hint}; local mode keeps it in <home>/token)")
        if r.status_code >= 400:
            fail(_describe_error(r), 2 if r.status_code in (400, 404, 409, 413, 415, 422) else 1)
        return r.json()


def _describe_error(r: Any) -> str:
    try:
        detail = r.json().get("detail")
    except ValueError:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    if isinstance(detail, list):
        parts = []
        for d in detail:
            loc = ".".join(str(p) for p in d.get("loc", []) if p != "body")
            parts.append(f"{loc}: {d.get('msg')}" if loc else str(d.get("msg")))
        return "invalid job spec: " + "; ".join(parts)
    return str(detail)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _job_table(items: list[dict[str, Any]]) -> Table:
    t = Table("ID", "NAME", "STATUS", "NODES", "RESTARTS", "CREATED", "REASON")
    for j in items:
        t.add_row(
            j["id"],
            j["name"],
            j["status"],
            str(j["spec"].get("num_nodes", "")),
            str(j["restart_count"]),
            j["created_at"][:19].replace("T", " "),
            j.get("status_reason") or "",
        )
    return t


def _event_rows(t: Table, items: list[dict[str, Any]]) -> None:
    for e in items:
        where = e.get("node_id") or ""
        if e.get("rank") is not None:
            where += f" rank {e['rank']}"
        t.add_row(
            str(e["id"]),
            e["job_id"],
            e["occurred_at"][:19].replace("T", " "),
            e["kind"],
            e.get("failure_class") or "",
            where.strip(),
            (e.get("message") or "")[:80],
        )


def _event_table() -> Table:
    return Table("ID", "JOB", "AT", "KIND", "CLASS", "WHERE", "MESSAGE")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address")] = None,
    port: Annotated[int | None, typer.Option(help="port (0 = any free port)")] = None,
    db_url: Annotated[str | None, typer.Option("--db-url", help="SQLAlchemy URL")] = None,
) -> None:
    """Run the service (API; SQLite under ~/.skyresume unless SKYRESUME_DATABASE_URL)."""
    import uvicorn

    from orchestrator.api.app import create_app
    from orchestrator.settings import Settings
    from orchestrator.store import db

    overrides = {
        k: v
        for k, v in {"host": host, "port": port, "database_url": db_url}.items()
        if v is not None
    }
    settings = Settings(**overrides)
    if settings.port == 0 and settings.reconcile:
        # Agents must be told where the service is before uvicorn binds: pick the port.
        from orchestrator.launchers.local import free_port

        settings = settings.model_copy(update={"port": free_port()})
    url = settings.effective_database_url
    try:
        if settings.should_auto_migrate:
            db.upgrade(url)
        app_ = create_app(settings)
    except Exception as e:
        fail(f"cannot open the database {_redact(url)}: {type(e).__name__}: {e}")
    reconciler = None
    if settings.reconcile:
        from orchestrator.reconciler.service import attach_reconciler

        reconciler = attach_reconciler(app_)
    where = "SKYRESUME_TOKEN" if settings.token else str(settings.token_path)
    err_console.print(
        f"skyresume serving on http://{settings.host}:{settings.port} "
        f"(database {_redact(url)}; operator token in {where}; "
        f"reconciler {'on, launcher ' + settings.launcher if reconciler else 'off'})"
    )
    if reconciler is not None:
        reconciler.start()
    try:
        uvicorn.run(app_, host=settings.host, port=settings.port, log_level="warning")
    finally:
        if reconciler is not None:
            reconciler.stop()
            close = getattr(app_.state.launcher, "close", None)
            if close is not None:
                close()


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable URL>"


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="job spec YAML")],
    output: OutputOpt = Output.table,
) -> None:
    """Submit a job spec (validated here first, then by the service)."""
    from orchestrator.domain.spec import SpecError, parse_job_spec_yaml

    try:
        text = file.read_bytes()
    except OSError as e:
        fail(f"cannot read {file}: {e.strerror}", 2)
    try:
        parse_job_spec_yaml(text)
    except SpecError as e:
        fail(f"{file}: invalid job spec: {e}", 2)
    job = Client().request(
        "POST", "/v1/jobs", content=text, headers={"content-type": "application/yaml"}
    )
    if output is Output.json:
        _print_json(job)
    else:
        console.print(f"submitted {job['id']} ({job['name']}): {job['status']}")


@app.command()
def jobs(
    status: Annotated[str | None, typer.Option(help="only jobs in this status")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 50,
    offset: Annotated[int, typer.Option(min=0)] = 0,
    output: OutputOpt = Output.table,
) -> None:
    """List jobs, newest first."""
    from orchestrator.domain.status import JobStatus

    params: dict[str, Any] = {"limit": limit, "offset": offset}
    if status:
        try:
            params["status"] = JobStatus(status.upper()).value
        except ValueError:
            fail(f"unknown status {status!r}; one of {', '.join(JobStatus)}", 2)
    page = Client().request("GET", "/v1/jobs", params=params)
    if output is Output.json:
        _print_json(page)
        return
    console.print(_job_table(page["items"]))
    shown = offset + len(page["items"])
    if shown < page["total"]:
        console.print(f"{shown} of {page['total']}; next page: --offset {shown}")


@app.command()
def show(job_id: str, output: OutputOpt = Output.table) -> None:
    """One job: its spec, status and transition history."""
    job = Client().request("GET", f"/v1/jobs/{job_id}")
    if output is Output.json:
        _print_json(job)
        return
    console.print(_job_table([job]))
    t = Table("AT", "FROM", "TO", "REASON", title="transitions")
    for tr in job["transitions"]:
        t.add_row(
            tr["at"][:19].replace("T", " "),
            tr["from_status"] or "-",
            tr["to_status"],
            tr["reason"] or "",
        )
    console.print(t)


@app.command()
def events(
    job_id: Annotated[str | None, typer.Argument(help="a job id; all jobs when omitted")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing new events")
    ] = False,
    after: Annotated[int, typer.Option(min=0, help="only events after this id")] = 0,
    interval: Annotated[float, typer.Option(min=0.1, help="--follow poll interval, s")] = 1.0,
    output: OutputOpt = Output.table,
) -> None:
    """Failure events, oldest first; --follow streams new ones (JSON lines with -o json)."""
    client = Client()
    path = f"/v1/jobs/{job_id}/events" if job_id else "/v1/events"
    cursor = after
    try:
        while True:
            page = client.request("GET", path, params={"after": cursor, "limit": 1000})
            items = page["items"]
            cursor = page["next_cursor"]
            if output is Output.json:
                if follow:
                    for e in items:
                        sys.stdout.write(json.dumps(e, default=str) + "\n")
                    sys.stdout.flush()
                else:
                    _print_json(page)
            elif items or not follow:
                t = _event_table()
                _event_rows(t, items)
                console.print(t)
            if not follow:
                return
            if job_id and not items:
                job = client.request("GET", f"/v1/jobs/{job_id}")
                if job["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


@app.command()
def cancel(job_id: str, output: OutputOpt = Output.table) -> None:
    """Cancel a job (nodes are taken down; its history stays)."""
    job = Client().request("POST", f"/v1/jobs/{job_id}/cancel")
    if output is Output.json:
        _print_json(job)
    else:
        console.print(f"{job['id']}: {job['status']}")


def _migrate(action: str, revision: str, db_url: str | None) -> None:
    from orchestrator.store import db

    url = db_url or _settings().effective_database_url
    move = db.upgrade if action == "upgrade" else db.downgrade
    try:
        move(url, revision)
        rev = db.current_revision(url)
    except Exception as e:
        fail(f"{action} of {_redact(url)} failed: {type(e).__name__}: {e}")
    console.print(f"{_redact(url)} is at revision {rev or 'base'}")


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument()] = "head",
    db_url: Annotated[str | None, typer.Option("--db-url")] = None,
) -> None:
    """Upgrade the schema to REVISION (default head)."""
    _migrate("upgrade", revision, db_url)


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="target revision, e.g. base or -1")],
    db_url: Annotated[str | None, typer.Option("--db-url")] = None,
) -> None:
    """Downgrade the schema (drops what later revisions added)."""
    _migrate("downgrade", revision, db_url)


@db_app.command("current")
def db_current(db_url: Annotated[str | None, typer.Option("--db-url")] = None) -> None:
    """Print the schema revision of the database."""
    from orchestrator.store import db

    url = db_url or _settings().effective_database_url
    try:
        console.print(db.current_revision(url) or "base (empty)")
    except Exception as e:
        fail(f"cannot read {_redact(url)}: {type(e).__name__}: {e}")


_register_command_modules()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
