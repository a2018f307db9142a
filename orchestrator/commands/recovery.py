"""CLI: ``incidents JOB``, ``attempts JOB``, ``chaos ...`` and ``demo``.

``chaos`` injects real failures into a job on the local launcher through the service
(the launcher lives there): a preemption notice on a node's metadata endpoint, a
whole node killed, an agent killed alone, a rank frozen or slowed, a node's link
cut or slowed by the kernel (nodes in network namespaces), a region out of capacity;
and, through the agents on any launcher, faults a rank injects into itself
(NaN, loss spike, OOM, Xid, transport error, user error).
"""

from pathlib import Path
from typing import Annotated, Any

import typer

from orchestrator.commands.common import (
    Client,
    Output,
    OutputOpt,
    attempt_progress,
    console,
    print_json,
)
from orchestrator.contract import Provider
from orchestrator.incident_report import incident_evidence, incident_table

chaos_app = typer.Typer(help="Inject failures into a job on the local launcher.")

JobArg = Annotated[str, typer.Argument(help="job id")]
NodeOpt = Annotated[int, typer.Option("--node", min=0, help="node rank in the current attempt")]


def _chaos(job: str, body: dict[str, Any]) -> None:
    print_json(Client().request("POST", f"/v1/jobs/{job}/chaos", json=body))


@chaos_app.command("preempt")
def chaos_preempt(
    job: JobArg,
    node: NodeOpt,
    provider: Annotated[
        Provider | None, typer.Option(help="notice format (default: the node's own cloud)")
    ] = None,
    in_seconds: Annotated[
        float, typer.Option(min=0, help="how far ahead the notice announces the end")
    ] = 30.0,
) -> None:
    """Serve a spot preemption notice on the node's metadata endpoint."""
    body: dict[str, Any] = {"action": "preempt", "node": node, "in_seconds": in_seconds}
    if provider is not None:
        body["provider"] = provider.value
    _chaos(job, body)


@chaos_app.command("kill-node")
def chaos_kill_node(job: JobArg, node: NodeOpt) -> None:
    """SIGKILL every process of the node at once, without notice."""
    _chaos(job, {"action": "kill-node", "node": node})


@chaos_app.command("kill-agent")
def chaos_kill_agent(job: JobArg, node: NodeOpt) -> None:
    """SIGKILL the node's agent alone (its ranks keep running)."""
    _chaos(job, {"action": "kill-agent", "node": node})


RankOpt = Annotated[int | None, typer.Option("--rank", min=0, help="global rank (default: first)")]


@chaos_app.command("hang-rank")
def chaos_hang_rank(job: JobArg, node: NodeOpt, rank: RankOpt = None) -> None:
    """Freeze one rank (SIGSTOP): its peers block in the next collective."""
    _chaos(job, {"action": "hang-rank", "node": node, "rank": rank})


@chaos_app.command("slow-rank")
def chaos_slow_rank(
    job: JobArg,
    node: NodeOpt,
    rank: RankOpt = None,
    duty: Annotated[float, typer.Option(min=0.01, max=0.99, help="fraction stopped")] = 0.5,
    seconds: Annotated[float, typer.Option(min=1, help="for how long")] = 60.0,
) -> None:
    """Make one rank a straggler by stopping it part of the time."""
    body = {"action": "slow-rank", "node": node, "rank": rank, "duty": duty, "seconds": seconds}
    _chaos(job, body)


@chaos_app.command("nan")
def chaos_nan(job: JobArg, node: NodeOpt) -> None:
    """Make the node's ranks report a NaN loss (through the agent's control file)."""
    _chaos(job, {"action": "nan", "node": node})


def _fault(action: str, doc: str):  # type: ignore[no-untyped-def]
    def command(job: JobArg, node: NodeOpt, rank: RankOpt = None) -> None:
        _chaos(job, {"action": action, "node": node, "rank": rank})

    command.__doc__ = doc
    chaos_app.command(action)(command)


# Faults a rank injects into itself at its next step (through the agent, any launcher).
_fault("spike", "Make the loss jump far above its trend for a while (a persistent spike).")
_fault("oom", "Make a rank raise torch.OutOfMemoryError (CUDA's message) at its next step.")
_fault("xid", "Make a rank write a real Xid line to its log and die as on a lost GPU.")
_fault("transport", "Make a rank's collective fail with a real transport error.")
_fault("user-error", "Make a rank raise KeyError from its own frame (a user bug).")


HealAfterOpt = Annotated[
    float | None,
    typer.Option("--seconds", min=0.1, help="heal by itself after this long (default: never)"),
]


@chaos_app.command("partition")
def chaos_partition(job: JobArg, node: NodeOpt, seconds: HealAfterOpt = None) -> None:
    """Take the node's link down for real: its processes live on and reach nobody.

    Needs the local launcher with nodes in network namespaces (root)."""
    body: dict[str, Any] = {"action": "partition", "node": node}
    if seconds is not None:
        body["seconds"] = seconds
    _chaos(job, body)


@chaos_app.command("slow-link")
def chaos_slow_link(
    job: JobArg,
    node: NodeOpt,
    rate: Annotated[str, typer.Option(help="tc rate, e.g. 20mbit or 2mbps; 0 lifts it")],
    seconds: HealAfterOpt = None,
) -> None:
    """Limit the node's link both ways with tc (a token bucket): a real slow link."""
    body: dict[str, Any] = {"action": "slow-link", "node": node, "rate": rate}
    if seconds is not None:
        body["seconds"] = seconds
    _chaos(job, body)


@chaos_app.command("heal")
def chaos_heal(job: JobArg, node: NodeOpt) -> None:
    """Undo partition and slow-link on the node's link."""
    _chaos(job, {"action": "heal", "node": node})


@chaos_app.command("stockout")
def chaos_stockout(
    region: Annotated[str, typer.Argument(help="local region (SKYRESUME_LOCAL_REGIONS)")],
    seconds: Annotated[float, typer.Option(min=0, help="how long; 0 lifts it")] = 600.0,
) -> None:
    """Make a local region refuse launches for lack of capacity, as a cloud does."""
    body = {"region": region, "seconds": seconds}
    print_json(Client().request("POST", "/v1/chaos/stockout", json=body))


def register(app: typer.Typer) -> None:
    app.add_typer(chaos_app, name="chaos")

    @app.command()
    def incidents(job: JobArg, output: OutputOpt = Output.table) -> None:
        """Failures the restart protocol handled: class, steps lost, MTTR by step."""
        data = Client().request("GET", f"/v1/jobs/{job}/incidents")
        if output is Output.json:
            print_json(data)
        else:
            console.print(incident_table(data["items"]))
            for line in incident_evidence(data["items"]):
                console.print(line, markup=False, highlight=False)

    @app.command()
    def attempts(job: JobArg, output: OutputOpt = Output.table) -> None:
        """Every launch of a job with its nodes and their ranks' last steps."""
        from rich.table import Table

        data = Client().request("GET", f"/v1/jobs/{job}/attempts")
        if output is Output.json:
            print_json(data)
            return
        t = Table(
            "ATTEMPT", "STATE", "WHERE", "NODES", "ADDRESSES", "TRAINED", "RANK STEPS",
            "ENDED BECAUSE",
        )
        for a in data["items"]:
            steps = [r.get("step") for n in a["nodes"] for r in n["ranks"]]
            t.add_row(
                str(a["number"]),
                a["state"],
                f"{a['cloud']}/{a['region']}",
                str(a["num_nodes"]),
                # Each node's address by node rank: where to look when one misbehaves.
                " ".join(f"{n['node_rank']}={n.get('address') or '?'}" for n in a["nodes"]),
                attempt_progress(a),
                ",".join("-" if s is None else str(s) for s in steps),
                a.get("end_reason") or "",
            )
        console.print(t)

    @app.command()
    def demo(
        home: Annotated[
            Path | None, typer.Option(help="state directory (default: a new temporary one)")
        ] = None,
        steps: Annotated[int, typer.Option(min=40, help="training steps")] = 120,
        timeout: Annotated[float, typer.Option(min=60, help="give up after (s)")] = 900.0,
        launcher: Annotated[
            str,
            typer.Option(help="local, or skypilot: SkyPilot's real provisioner on the "
                         "emulated AWS (root; scripts/awsemu-prepare first)"),
        ] = "local",
        elastic: Annotated[
            bool,
            typer.Option(
                "--elastic",
                help="an elastic 3x1 run (min_nodes 2): a node killed, the 2 survivors "
                "train at once, the group grows back to 3",
            ),
        ] = False,
    ) -> None:
        """A 2x2 CPU training run, preempted then a node killed, recovered from both.

        Starts the service (SQLite, local launcher), submits the job, injects the
        failures, prints the incident table. Exits 0 only if training finished with
        every resume validated on every rank. ``--launcher skypilot``: a 2x1 run
        through SkyPilot's API server on the emulated AWS, a spot notice on one node
        (docs/awsemu.md: Through SkyPilot). ``--elastic``: a 3x1 job with min_nodes 2
        loses a node, shrinks onto the survivors while the replacement comes up as
        standby, then grows back (at least 200 steps; docs/recovery.md)."""
        if elastic:
            if launcher != "local":
                raise typer.BadParameter("--elastic runs on the local launcher")
            from orchestrator.demo_elastic import run_demo as run_elastic_demo

            raise typer.Exit(run_elastic_demo(home=home, steps=steps, timeout_s=timeout))
        if launcher == "skypilot":
            from orchestrator.demo_skypilot import run_demo as run_sky_demo

            raise typer.Exit(run_sky_demo(home=home, steps=max(steps, 150)))
        if launcher != "local":
            raise typer.BadParameter(f"launcher must be local or skypilot, got {launcher!r}")
        from orchestrator.demo import run_demo

        raise typer.Exit(run_demo(home=home, steps=steps, timeout_s=timeout))
