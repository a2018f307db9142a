"""CLI: ``logs JOB``, ``watch JOB`` and ``alerts ...`` (webhooks).

``logs`` asks the current attempt's agents to upload their tails, waits a moment
for them, and prints what the service holds: the agent's own log, torchrun's, and
each rank's, per node. A dead node's tails are what it last uploaded (agents send
them every few seconds and at exit), so a SIGKILLed node's last lines are there.
``--follow`` keeps asking and prints only the lines that are new.

``watch`` is a live terminal view (Rich) of ``GET /v1/jobs/{id}/live``: status,
step, each node with address, heartbeat age, health checks and ranks, and the open
incident's protocol steps as they start and end.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Any

import typer

from orchestrator.commands.common import Client, Output, OutputOpt, console, fail, print_json

JobArg = Annotated[str, typer.Argument(help="job id")]
alerts_app = typer.Typer(help="Alert webhooks (incident opened/closed, job failed/succeeded).")

#: Seconds ``logs`` waits for the agents to answer an upload request.
UPLOAD_WAIT_S = 3.0


def _printable(line: str) -> str:
    """A log line as text: control characters (a terminal escape in a rank's output
    could rewrite the operator's screen) shown as ``?``, tabs kept."""
    return "".join(
        c if c == "\t" or (c >= " " and not "\x7f" <= c <= "\x9f") else "?" for c in line
    )


def _nodes_of(
    client: Client, job: str, attempt: int | None
) -> tuple[int | None, list[dict[str, Any]]]:
    items = client.request("GET", f"/v1/jobs/{job}/attempts")["items"]
    if not items:
        return None, []
    chosen = (
        items[-1] if attempt is None else next((a for a in items if a["number"] == attempt), None)
    )
    if chosen is None:
        fail(f"job {job} has no attempt {attempt} (attempts: {[a['number'] for a in items]})", 2)
    return chosen["number"], chosen["nodes"]


def _ask_upload(client: Client, job: str, node_id: str | None) -> bool:
    """Best effort: a job with no running attempt has only what was stored."""
    params = {"node": node_id} if node_id else {}
    try:
        r = client.http.post(f"/v1/jobs/{job}/logs/request", params=params)
    except Exception:
        return False
    return r.status_code == 200


def _fetch(
    client: Client, job: str, attempt: int | None, node_id: str | None, rank: int | None
) -> list[dict[str, Any]]:
    params: dict[str, Any] = {}
    if attempt is not None:
        params["attempt"] = attempt
    if node_id is not None:
        params["node"] = node_id
    if rank is not None:
        params["rank"] = rank
    items: list[dict[str, Any]] = client.request("GET", f"/v1/jobs/{job}/logs", params=params)[
        "items"
    ]
    return items


def _new_lines(before: list[str], after: list[str]) -> list[str]:
    """The lines of ``after`` past the longest suffix of ``before`` it starts with (a
    tail window slides: what scrolled out is gone, what is new comes at the end)."""
    for k in range(min(len(before), len(after)), 0, -1):
        if before[-k:] == after[:k]:
            return after[k:]
    return after


def logs(
    job: JobArg,
    node: Annotated[
        str | None, typer.Option("--node", help="node rank in the attempt, or node id")
    ] = None,
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="only this rank's log")] = None,
    attempt: Annotated[
        int | None, typer.Option("--attempt", min=0, help="attempt number (default: newest)")
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new lines")] = False,
    output: OutputOpt = Output.table,
) -> None:
    """A node's agent, torchrun and rank logs, as its agent last uploaded them."""
    client = Client()
    number, nodes = _nodes_of(client, job, attempt)
    addresses = {n["node_id"]: (n["node_rank"], n.get("address")) for n in nodes}
    node_id: str | None = None
    if node is not None:
        if node.isdigit():
            match = [n["node_id"] for n in nodes if n["node_rank"] == int(node)]
            if not match:
                fail(f"attempt {number} of job {job} has no node rank {node}", 2)
            node_id = match[0]
        else:
            node_id = node
    latest = _fetch(client, job, number, node_id, rank)
    if _ask_upload(client, job, node_id):
        stamps = {(i["node_id"], i["source"]): i["uploaded_at"] for i in latest}
        deadline = time.monotonic() + UPLOAD_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.3)
            latest = _fetch(client, job, number, node_id, rank)
            if latest and all(
                stamps.get((i["node_id"], i["source"])) != i["uploaded_at"] for i in latest
            ):
                break
    if output is Output.json:
        print_json(latest)
        return
    if not latest and not follow:
        fail(f"no logs stored for job {job} attempt {number} (no agent uploaded any yet)")
    seen: dict[tuple[str, str], list[str]] = {}
    for item in latest:
        n_rank, address = addresses.get(item["node_id"], ("?", None))
        console.print(
            f"==> {item['node_id']} (node rank {n_rank}, {address or 'no address'}) "
            f"{item['source']}: {item['reason']} upload at {item['uploaded_at']} <==",
            markup=False,
            highlight=False,
        )
        for line in item["lines"]:
            console.print(_printable(line), markup=False, highlight=False, emoji=False)
        seen[(item["node_id"], item["source"])] = item["lines"]
    while follow:
        time.sleep(2.0)
        _ask_upload(client, job, node_id)
        for item in _fetch(client, job, number, node_id, rank):
            key = (item["node_id"], item["source"])
            for line in _new_lines(seen.get(key, []), item["lines"]):
                console.print(
                    f"[{item['node_id']} {item['source']}] {_printable(line)}",
                    markup=False,
                    highlight=False,
                    emoji=False,
                )
            seen[key] = item["lines"]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _when(value: str | None) -> str:
    if not value:
        return "-"
    return datetime.fromisoformat(value).strftime("%H:%M:%S")


def render_live(data: dict[str, Any]) -> Any:
    """One frame of ``watch``: a Rich renderable of ``/v1/jobs/{id}/live``."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    job, a = data["job"], data.get("attempt")
    head = Text()
    head.append(f"{job['name']} ({job['id']}) ", style="bold")
    head.append(job["status"], style="bold green" if job["status"] == "RUNNING" else "bold yellow")
    head.append(f"  step {data['step'] if data['step'] is not None else '-'}")
    if a:
        head.append(
            f"  attempt {a['number']} ({a['state']}) "
            f"{a['cloud']} {a['region']} {a['instance_type']}"
        )
    if job.get("reason"):
        head.append(f"\n{job['reason']}", style="dim")
    nodes = Table("NODE", "RANK", "ADDRESS", "STATE", "HEARTBEAT", "HEALTH", "RANKS (step/loss)")
    for n in data["nodes"]:
        h = n.get("health")
        health = "-" if h is None else ("passed" if h["ok"] else f"FAILED: {h['message']}")
        ranks = " ".join(
            f"r{r['rank']}:{'-' if r.get('step') is None else r['step']}"
            + (f"/{r['loss']:.4g}" if r.get("loss") is not None else "")
            for r in n["ranks"]
        )
        nodes.add_row(
            Text(n["node_id"]),
            str(n["node_rank"]),
            Text(n.get("address") or "-"),
            n["state"],
            _age(n.get("heartbeat_age_s")),
            Text(health),
            Text(ranks),
        )
    parts: list[Any] = [head, nodes]
    inc = data.get("incident")
    if inc:
        title = f"incident #{inc['id']} {inc['failure_class']}" + (
            " (in progress)" if inc["ongoing"] else " (ended)"
        )
        steps = Table("STEP", "STARTED", "FINISHED", "OUTCOME", "DETAIL", title=title)
        for st in inc["steps"]:
            outcome = "not started" if st["started_at"] is None else (st["outcome"] or "running")
            steps.add_row(
                st["step"],
                _when(st["started_at"]),
                _when(st["finished_at"]),
                outcome,
                Text(st.get("detail") or ""),
            )
        parts.append(steps)
    return Group(*parts)


TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


def watch(
    job: JobArg,
    interval: Annotated[float, typer.Option(min=0.2, help="seconds between refreshes")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit")] = False,
) -> None:
    """A live view of a job, its nodes and the running incident (Ctrl-C to stop).
    Ends by itself when the job ends."""
    from rich.live import Live

    client = Client()
    data = client.request("GET", f"/v1/jobs/{job}/live")
    if once:
        console.print(render_live(data))
        return
    try:
        with Live(render_live(data), console=console, refresh_per_second=4) as live:
            while data["job"]["status"] not in TERMINAL:
                time.sleep(interval)
                data = client.request("GET", f"/v1/jobs/{job}/live")
                live.update(render_live(data))
    except KeyboardInterrupt:
        pass


@alerts_app.command("add")
def alerts_add(
    url: Annotated[str, typer.Argument(help="the receiver (http:// or https://)")],
    job: Annotated[str | None, typer.Option("--job", help="only this job (default: all)")] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Add a webhook; prints its HMAC secret once (receivers check each body with it)."""
    body: dict[str, Any] = {"url": url}
    if job:
        body["job_id"] = job
    data = Client().request("POST", "/v1/alerts/webhooks", json=body)
    if output is Output.json:
        print_json(data)
        return
    console.print(f"webhook {data['id']} -> {data['url']}", markup=False, highlight=False)
    console.print(f"secret (shown once): {data['secret']}", markup=False, highlight=False)


@alerts_app.command("list")
def alerts_list(output: OutputOpt = Output.table) -> None:
    """The stored webhooks (the global one from SKYRESUME_ALERT_WEBHOOK_URL is not listed)."""
    from rich.table import Table

    data = Client().request("GET", "/v1/alerts/webhooks")
    if output is Output.json:
        print_json(data)
        return
    t = Table("ID", "URL", "JOB")
    for w in data["items"]:
        t.add_row(str(w["id"]), w["url"], w["job_id"] or "every job")
    console.print(t)


@alerts_app.command("remove")
def alerts_remove(webhook_id: Annotated[int, typer.Argument(help="webhook id")]) -> None:
    Client().request("DELETE", f"/v1/alerts/webhooks/{webhook_id}")
    console.print(f"removed webhook {webhook_id}")


def register(app: typer.Typer) -> None:
    app.command("logs")(logs)
    app.command("watch")(watch)
    app.add_typer(alerts_app, name="alerts")
