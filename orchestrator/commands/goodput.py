"""CLI: ``skyresume goodput JOB [-o json]``, a client of ``GET /v1/jobs/{id}/goodput``.

The table view answers "where did the time and money go": the split of wall time
(Meta's effective training time), one row per phase (attempt) with the nodes it
trained on, its training time, throughput and node-hours (an elastic run's shrunk
phases marked, their standby spares counted apart), then one row per incident with
its MTTR broken down by restart-protocol step, the steps redone and what it cost (a
planned reshape, an elastic grow, marked as one).
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


def _nodes(a: dict[str, Any]) -> str:
    """``3``, or a shrunk phase's ``2 of 3, shrunk, +1 spare (given back)``."""
    if not a.get("shrunk"):
        return str(a["training_nodes"])
    spare = f"+{a['spare_nodes']} spare" + (" (given back)" if a["spare_released"] else "")
    return f"{a['training_nodes']} of {a['num_nodes']}, shrunk, {spare}"


def _rate(a: dict[str, Any]) -> str:
    x = a["steps_per_second"]
    if x is None:
        return "?"
    return f"{x:.3g}" + (" (step time)" if a["throughput_source"] == "step_time" else "")


def _phases(doc: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table("#", "NODES", "TRAINED", "STEPS/S", "NODE-H", "SPARE NODE-H", "COST",
              title="phases (attempts): the nodes each trained on")  # fmt: skip
    for a in doc["attempts"]:
        t.add_row(
            str(a["number"]),
            _nodes(a),
            _duration(a["training_seconds"]),
            _rate(a),
            f"{a['node_hours']:.2f}",
            f"{a['spare_node_hours']:.2f}" if a["shrunk"] else "-",
            _usd(a["usd"]),
        )
    return t


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
    planned = sum(1 for i in doc["incidents"] if i["planned"])
    restarts = f"{doc['restart_count']} restarts" + (
        f" ({planned} of them planned reshapes)" if planned else ""
    )
    console.print(
        f"{doc['job_id']} ({doc['name']}) {doc['status']}, {restarts}: "
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
    if doc["attempts"]:
        console.print(_phases(doc))
    if doc["shrunk_seconds"] or doc["reshape_seconds"]:
        console.print(
            f"time spent shrunk {_duration(doc['shrunk_seconds'])} "
            f"({_share(doc['shrunk_seconds'], wall)} of wall); planned reshapes (grows) "
            f"{_duration(doc['reshape_seconds'])} of the restart-protocol time; training "
            f"nodes {doc['node_hours']:.2f} node-h, standby spares "
            f"{doc['spare_node_hours']:.2f} node-h",
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
            i["failure_class"] + (" (planned reshape)" if i["planned"] else ""),
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
