"""CLI: ``skyresume goodput JOB [-o json]``, a client of ``GET /v1/jobs/{id}/goodput``.

The table view answers "where did the time and money go": the split of wall time
(Meta's effective training time), then one row per incident with its MTTR broken
down by restart-protocol step, the steps redone and what it cost.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from orchestrator.commands.common import Client, Output, OutputOpt, console, print_json

#: Column headers for the seven protocol steps (orchestrator.domain.protocol order).
_STEP_HEADERS = (
    ("detect", "DETECT"),
    ("signal", "SIGNAL"),
    ("confirm_checkpoint", "CONFIRM"),
    ("select_replacement", "SELECT"),
    ("launch", "LAUNCH"),
    ("stage", "STAGE"),
    ("validate", "VALIDATE"),
)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"


def _usd(x: float | None) -> str:
    return "unpriced" if x is None else f"${x:,.2f}"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def goodput(
    job_id: Annotated[str, typer.Argument(help="job id")],
    output: OutputOpt = Output.table,
) -> None:
    """Effective training time of a job, and each incident's MTTR, steps lost and cost."""
    from rich.table import Table

    doc: dict[str, Any] = Client().request("GET", f"/v1/jobs/{job_id}/goodput")
    if output is Output.json:
        print_json(doc)
        return

    wall = doc["wall_seconds"]
    state = "so far" if doc["live"] else "final"
    console.print(
        f"{doc['job_id']} ({doc['name']}) {doc['status']}, {doc['restart_count']} restarts: "
        f"effective training time {doc['effective_training_fraction']:.1%} ({state})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    split = Table("TIME", "SECONDS", "SHARE", title="where the wall time went")
    for label, key in (
        ("productive", "productive_seconds"),
        ("failure (restart protocol)", "failure_seconds"),
        ("lost work (thrown away)", "lost_work_seconds"),
        ("checkpoint blocking", "checkpoint_seconds"),
        ("idle (queued, no attempt)", "idle_seconds"),
        ("wall", "wall_seconds"),
    ):
        split.add_row(label, _duration(doc[key]), _share(doc[key], wall))
    console.print(split)
    step = doc["step_seconds"]
    console.print(
        f"step time {_duration(step)}; cost {_usd(doc['total_usd'])}, "
        f"of which lost {_usd(doc['lost_usd'])}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if not doc["incidents"]:
        console.print("no incidents")
        return
    t = Table("ID", title="incidents")
    for header in ("AT (UTC)", "CLASS", "WHERE", "MTTR", "REDONE", "COST"):
        # Class and time stay whole on an 80-column terminal; placement may wrap.
        t.add_column(
            header,
            no_wrap=header in ("AT (UTC)", "CLASS", "COST"),
            overflow="fold" if header == "WHERE" else "ellipsis",
        )
    steps = Table("ID", *(h for _, h in _STEP_HEADERS), title="MTTR by restart-protocol step")
    for i in doc["incidents"]:
        where = " ".join(x for x in (i["region"], i["instance_type"]) if x)
        mttr = _duration(i["mttr_seconds"]) + (" (ongoing)" if i["ongoing"] else "")
        if i["steps_lost"] is not None:
            redone = f"{i['steps_lost']} steps, {_duration(i['lost_work_seconds'])}"
        elif i["lost_work_seconds"]:
            # A plain script restarted from scratch: no steps to count, its time is gone.
            redone = f"{_duration(i['lost_work_seconds'])} of training (no step reports)"
        else:
            redone = "?"
        t.add_row(
            str(i["id"]),
            i["occurred_at"][5:16].replace("T", " "),
            i["failure_class"],
            where or "-",
            mttr,
            redone,
            _usd(i["usd"]),
        )
        steps.add_row(
            str(i["id"]), *(_duration(i["step_seconds"].get(key)) for key, _ in _STEP_HEADERS)
        )
    console.print(t)
    console.print(steps)


def register(app: typer.Typer) -> None:
    app.command("goodput")(goodput)
