"""The operator CLI: the Typer app, a thin REST client of the service, plus ``serve``
and ``db``.

What the commands share (output format, consoles, ``fail``, the REST client) is in
:mod:`orchestrator.commands.common`; each area's commands are in
``orchestrator/commands/<area>.py``; ``serve`` and ``db`` call
:mod:`orchestrator.server`, which wires the service. Imports run one way, cli ->
commands.* / server -> commands.common, so no module needs this one.

Heavy modules (FastAPI, SQLAlchemy, uvicorn, cloud SDKs, torch) are imported inside
the functions that need them, so ``skyresume --help`` and the client commands start
fast. Every failure the operator can cause or fix (service down, wrong token, bad
spec, unreachable database) prints one ``error:`` line and exits non-zero;
tracebacks are for bugs.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.table import Column, Table

from orchestrator import server
from orchestrator.commands import cloud, failures, goodput, operator, plan, recovery, tokens
from orchestrator.commands.common import (
    Client,
    Output,
    OutputOpt,
    attempt_progress,
    console,
    err_console,
    fail,
    load_settings,
    print_json,
    redact_url,
    visible,
)

app = typer.Typer(
    name="skyresume",
    help="Keep multi-node PyTorch training alive on spot instances.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema (Alembic).", no_args_is_help=True)
app.add_typer(db_app, name="db")


def _job_table(items: list[dict[str, Any]]) -> Table:
    # An id is something to copy: never wrapped nor cut, at 80 columns or in a pipe
    # (rich squeezes every column to fit the width). The reason wraps instead.
    t = Table(
        Column("ID", no_wrap=True, min_width=max((len(j["id"]) for j in items), default=2)),
        Column("NAME", overflow="fold"),
        Column("STATUS", no_wrap=True),
        "NODES",
        "RESTARTS",
        Column("CREATED", no_wrap=True, min_width=10),
        Column("REASON", overflow="fold", ratio=1),
    )
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
    return Table(
        "ID",
        Column("JOB", no_wrap=True, min_width=12),
        "AT",
        "KIND",
        "CLASS",
        "WHERE",
        Column("MESSAGE", overflow="fold", ratio=1),
    )


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address")] = None,
    port: Annotated[int | None, typer.Option(help="port (0 = any free port)")] = None,
    db_url: Annotated[str | None, typer.Option("--db-url", help="SQLAlchemy URL")] = None,
) -> None:
    """Run the service (API; SQLite under ~/.skyresume unless SKYRESUME_DATABASE_URL)."""
    overrides = {"host": host, "port": port, "database_url": db_url}
    settings = server.bind_settings(
        load_settings(**{k: v for k, v in overrides.items() if v is not None})
    )
    url = redact_url(settings.effective_database_url)
    from orchestrator.package import PackageUnavailable
    from orchestrator.settings import NotRoutable

    try:
        service = server.build_service(settings)
    except server.DatabaseError as e:
        fail(f"cannot open the database {url}: {e}")
    except (server.LocalNetworkError, PackageUnavailable, NotRoutable, server.TLSError) as e:
        fail(str(e), 2)
    except (server.AlreadyServing, server.TokenFileError) as e:
        fail(str(e))
    try:
        server.bind_service(service)  # before the banner: a port in use is one line
    except server.BindError as e:
        service.cleanup.close()
        fail(str(e))
    where = "SKYRESUME_TOKEN" if settings.token else str(settings.token_path)
    reconciler = f"on, launcher {settings.launcher}" if service.reconciler else "off"
    if service.reconciler is not None:
        reconciler += f", nodes reach it at {service.reconciler.service_url}"
        note = server.launcher_note(service)
        reconciler += f"; {note}" if note else ""
    err_console.print(
        f"skyresume serving on {settings.scheme}://{settings.host}:{settings.port} "
        f"(database {url}; operator token in {where}; reconciler {reconciler})",
        # One line in service.log, however narrow; paths print as they are.
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
    server.run_service(service)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="job spec YAML")],
    output: OutputOpt = Output.table,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="print the SkyPilot task YAML the first launch would submit (as SkyPilot "
            "reads it: its image, disk and ports), and submit nothing",
        ),
    ] = False,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", help="KEY=VALUE for task.envs (a SkyPilot YAML's empty envs)"),
    ] = None,
    secret: Annotated[
        list[str] | None,
        typer.Option("--secret", help="KEY=VALUE for task.secrets (never shown back)"),
    ] = None,
) -> None:
    """Submit a job spec (validated here first, then by the service)."""
    from orchestrator.commands.plan import parse_key_values
    from orchestrator.domain.spec import SpecError, load_yaml_document, parse_job_spec_yaml

    try:
        text = file.read_bytes()
    except OSError as e:
        fail(f"cannot read {file}: {e.strerror}", 2)
    try:
        spec = parse_job_spec_yaml(text)
    except SpecError as e:
        fail(f"{file}: invalid job spec: {e}", 2)
    yaml_path = spec.task.skypilot_yaml
    envs, secrets = parse_key_values(env, "--env"), parse_key_values(secret, "--secret")
    ctype = "application/yaml"
    if (yaml_path and not Path(yaml_path).is_absolute()) or envs or secrets:
        doc = load_yaml_document(text)
        if yaml_path and not Path(yaml_path).is_absolute():
            # Resolved once, here, against the spec's folder (as `plan` reads it),
            # never against the service's working directory at launch.
            doc["task"]["skypilot_yaml"] = str((file.parent / yaml_path).resolve())
        for key, given in (("envs", envs), ("secrets", secrets)):
            if given:
                doc["task"][key] = {**(doc["task"].get(key) or {}), **given}
        text = json.dumps(doc).encode()
        ctype = "application/json"
    if dry_run:
        out = Client().request(
            "POST", "/v1/jobs/render", content=text, headers={"content-type": ctype}
        )
        if output is Output.json:
            print_json(out)
        else:
            # The YAML alone on stdout (it can be piped to a file, or to `sky launch`).
            err_console.print(
                f"# {out['cluster_name']} on {out['placement']}", markup=False, highlight=False
            )
            print(visible(out["task_yaml"]), end="")
        return
    # One key per submit: a retry after a lost answer gets the job made the first time
    # (201 then, 200 now), never a second job (api/routes_jobs.py, store/submissions.py).
    key = f"cli-{uuid.uuid4()}"
    headers = {"content-type": ctype, "idempotency-key": key}
    job = Client().request("POST", "/v1/jobs", content=text, headers=headers, retries=3)
    if output is Output.json:
        print_json(job)
    else:
        console.print(f"submitted {job['id']} ({job['name']}): {job['status']}")
        # What the service said of the task at submit: which of the spec and the YAML
        # decided nodes and spot, and each field of it skyresume does not run.
        events = Client().request("GET", f"/v1/jobs/{job['id']}/events")
        for e in events["items"]:
            if e["kind"] == "task_note":
                console.print(f"note: {e['message']}", markup=False, highlight=False)


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
        print_json(page)
        return
    console.print(_job_table(page["items"]))
    shown = offset + len(page["items"])
    if shown < page["total"]:
        console.print(f"{shown} of {page['total']}; next page: --offset {shown}")


def _now_line(job: dict[str, Any], attempts: dict[str, Any]) -> str:
    """The job's status now, and what its newest attempt is known to have trained."""
    line = f"{job['id']} is {job['status']}"
    if job.get("status_reason"):
        line += f" ({job['status_reason']})"
    if attempts["items"]:
        a = attempts["items"][-1]
        line += f"; attempt {a['number']} {a['state']}: {attempt_progress(a)}"
    else:
        line += "; no attempt launched yet"
    return line


@app.command()
def show(job_id: str, output: OutputOpt = Output.table) -> None:
    """One job: its spec, status and transition history."""
    job = Client().request("GET", f"/v1/jobs/{job_id}")
    if output is Output.json:
        print_json(job)
        return
    console.print(_job_table([job]))
    console.print(_now_line(job, Client().request("GET", f"/v1/jobs/{job_id}/attempts")))
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
                    print_json(page)
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
        print_json(job)
    else:
        console.print(f"{job['id']}: {job['status']}")


def _migrate(action: Literal["upgrade", "downgrade"], revision: str, db_url: str | None) -> None:
    url = db_url or load_settings().effective_database_url
    try:
        rev = server.migrate(url, action, revision)
    except server.DatabaseError as e:
        fail(f"{action} of {redact_url(url)} failed: {e}")
    console.print(f"{redact_url(url)} is at revision {rev or 'base'}")


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
    url = db_url or load_settings().effective_database_url
    try:
        rev = server.current_revision(url)
    except server.DatabaseError as e:
        fail(f"cannot read {redact_url(url)}: {e}")
    console.print(rev or "base (empty)")


# After the core commands, so that --help lists them first.
for area in (cloud, failures, goodput, operator, plan, recovery, tokens):
    area.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
