"""CLI commands for failures: ``classify``, ``advise``, ``simulate``.

All three run locally on the pure core (no service needed): an operator classifies a
log they hold, asks for a checkpoint interval, or compares recovery policies.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from orchestrator.commands.common import Output, OutputOpt, fail

if TYPE_CHECKING:
    from orchestrator.domain.simulator import ElasticPlan

#: The classifier reads a log's tail; rank logs can be gigabytes, the cause is at the end.
TAIL_LINES = 2000


def _read_tail(path: str) -> str:
    if path == "-":
        text = sys.stdin.read()
    else:
        p = Path(path)
        if not p.is_file():
            fail(f"log file {path!r} does not exist or is not a file", 2)
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            fail(f"cannot read log file {path!r}: {e.strerror}", 2)
    return "\n".join(text.splitlines()[-TAIL_LINES:])


def classify(
    logfile: Annotated[str, typer.Argument(help="rank/agent/kernel log, or - for stdin")],
    exit_code: Annotated[
        int | None, typer.Option("--exit-code", help="the rank's exit code")
    ] = None,
    signal: Annotated[
        str | None, typer.Option("--signal", help="signal that ended it: 9 or SIGKILL")
    ] = None,
    notice: Annotated[
        str | None, typer.Option("--notice", help="preemption notice kind, if one arrived")
    ] = None,
) -> None:
    """Classify a failure from its log tail: JSON {class, retryable, confidence, evidence}."""
    from orchestrator.domain.failures import classify_failure

    text = _read_tail(logfile)
    try:
        result = classify_failure(exit_code, signal, text, notice_kind=notice)
    except ValueError as e:
        fail(f"--signal: {e}", 2)
    print(json.dumps(result.to_json_dict()))


def advise(
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs in the job")],
    save_seconds: Annotated[
        float, typer.Option("--save-seconds", help="measured blocking save time")
    ],
    restart_seconds: Annotated[
        float, typer.Option("--restart-seconds", help="failure to first step again")
    ],
    mtbf_hours: Annotated[
        float | None,
        typer.Option("--mtbf-hours", help="job MTBF; default: Llama 3's rate for --gpus"),
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Checkpoint interval (Young) and expected lost time."""
    from orchestrator.domain.advisor import advise as _advise

    for name, value in (("--gpus", gpus), ("--save-seconds", save_seconds)):
        if value <= 0:
            fail(f"{name} must be positive, got {value}", 2)
    if restart_seconds < 0:
        fail(f"--restart-seconds must be >= 0, got {restart_seconds}", 2)
    if mtbf_hours is not None and mtbf_hours <= 0:
        fail(f"--mtbf-hours must be positive, got {mtbf_hours}", 2)
    a = _advise(gpus, save_seconds, restart_seconds, mtbf_hours)
    if output is Output.json:
        print(json.dumps(a.to_json_dict()))
        return
    src = "given" if mtbf_hours is not None else "Llama 3 rate"
    print(f"MTBF:                {a.mtbf_hours:.1f} h ({src}, {gpus} GPUs)")
    print(f"checkpoint interval: {a.interval_minutes:.1f} min ({a.interval_seconds:.0f} s)")
    print(f"expected lost time:  {a.lost.total:.2%}")
    print(f"  saves:             {a.lost.save_fraction:.2%}")
    print(f"  work redone:       {a.lost.rework_fraction:.2%}")
    print(f"  restarts:          {a.lost.restart_fraction:.2%}")


def simulate(
    gpus: Annotated[int, typer.Option("--gpus")] = 16_384,
    days: Annotated[float, typer.Option("--days")] = 54.0,
    failure_model: Annotated[
        str, typer.Option("--failure-model", help="llama3 or none")
    ] = "llama3",
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy", help="skyresume, skypilot-managed, torchrun (repeat; default all)"
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    price: Annotated[float, typer.Option("--price-per-gpu-hour")] = 2.0,
    spot_per_day: Annotated[
        float, typer.Option("--spot-preemptions-per-day", help="add noticed spot reclaims")
    ] = 0.0,
    elastic: Annotated[
        bool,
        typer.Option(
            "--elastic",
            help="also compare skyresume elastic (train on the survivors while a replacement "
            "provisions) with skyresume waiting for a full set, per provisioning time",
        ),
    ] = False,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="with --elastic")] = 8,
    min_nodes: Annotated[
        int | None,
        typer.Option("--min-nodes", help="with --elastic; default one node of slack (nodes - 1)"),
    ] = None,
    provision_seconds: Annotated[
        list[float] | None,
        typer.Option(
            "--provision-seconds",
            help="with --elastic, repeat; default 72.9 (measured via SkyPilot on the emulated "
            "AWS, BENCHMARKS.md), 300 and 900 (assumed)",
        ),
    ] = None,
    provision_sigma: Annotated[
        float, typer.Option("--provision-sigma", help="with --elastic: lognormal spread")
    ] = 0.0,
    restart_seconds: Annotated[
        float | None,
        typer.Option(
            "--restart-seconds",
            help="with --elastic: one restart onto a new node set; default skyresume's 90",
        ),
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Compare recovery policies under a failure model (discrete-event, seeded)."""
    from orchestrator.domain import simulator as sim

    if gpus <= 0:
        fail(f"--gpus must be positive, got {gpus}", 2)
    if days <= 0:
        fail(f"--days must be positive, got {days}", 2)
    if price < 0 or spot_per_day < 0:
        fail("--price-per-gpu-hour and --spot-preemptions-per-day must be >= 0", 2)
    names = [m.value for m in sim.FailureModelName]
    if failure_model not in names:
        fail(f"--failure-model {failure_model!r} is not one of {', '.join(names)}", 2)
    chosen = policy or list(sim.POLICIES)
    unknown = [p for p in chosen if p not in sim.POLICIES]
    if unknown:
        fail(f"--policy {unknown[0]!r} is not one of {', '.join(sim.POLICIES)}", 2)
    plans = (
        _elastic_plans(
            gpus, gpus_per_node, min_nodes, provision_seconds, provision_sigma, restart_seconds
        )
        if elastic
        else []
    )
    model = sim.failure_model(failure_model, spot_preemptions_per_day=spot_per_day)
    results = sim.compare({p: sim.POLICIES[p] for p in chosen}, model, gpus, days, seed, price)
    base = sim.POLICIES["skyresume"]
    rows = [sim.compare_elastic(base, p, model, days, seed, price) for p in plans]
    if output is Output.json:
        doc: dict[str, object] = {
            "gpus": gpus, "days": days, "failure_model": failure_model, "seed": seed,
            "results": [r.to_json_dict() for r in results],
        }  # fmt: skip
        if rows:
            doc["elastic"] = {
                "policy": base.name,
                "restart_seconds": plans[0].restart_for(base),
                "rows": [c.to_json_dict() for c in rows],
            }
        print(json.dumps(doc))
        return
    print(f"{gpus} GPUs, {days:g} days, failure model {failure_model}, seed {seed}")
    print(f"{'policy':<18}{'effective':>10}{'failures':>10}{'down h':>10}{'redo h':>10}"
          f"{'save h':>10}{'lost $':>16}")  # fmt: skip
    for r in results:
        print(
            f"{r.policy:<18}{r.effective_fraction:>10.2%}{r.failures:>10}"
            f"{r.down_seconds / 3600:>10.1f}{r.rework_seconds / 3600:>10.1f}"
            f"{r.save_seconds / 3600:>10.1f}{r.lost_cost:>16,.0f}"
        )
    if not rows:
        return
    plan = plans[0]
    print()
    print(
        f"{base.name} elastic vs waiting for a full set: {plan.nodes} nodes of "
        f"{plan.gpus_per_node}, min {plan.min_nodes}, restart {plan.restart_for(base):g} s, "
        f"grow = one {base.blocking_save_seconds:g} s save + one restart"
    )
    print(f"{'provision s':>12}{'waiting':>10}{'elastic':>10}{'ratio':>9}{'gained h':>10}"
          f"{'shrinks':>9}{'grows':>7}{'waits':>7}")  # fmt: skip
    for c in rows:
        e = c.elastic
        print(
            f"{c.plan.provision_seconds:>12g}{c.waiting.effective_fraction:>10.2%}"
            f"{e.effective_fraction:>10.2%}{c.effective_ratio:>9.4f}{c.gained_hours:>10.1f}"
            f"{e.shrinks:>9}{e.grows:>7}{e.waits:>7}"
        )


def _elastic_plans(
    gpus: int,
    gpus_per_node: int,
    min_nodes: int | None,
    provision_seconds: list[float] | None,
    provision_sigma: float,
    restart_seconds: float | None,
) -> list[ElasticPlan]:
    """One plan per provisioning time; refuses what the domain would refuse, as one line."""
    from orchestrator.domain import simulator as sim

    if gpus_per_node <= 0 or gpus % gpus_per_node:
        fail(f"--gpus {gpus} is not a whole number of --gpus-per-node {gpus_per_node}", 2)
    nodes = gpus // gpus_per_node
    floor = max(1, nodes - 1) if min_nodes is None else min_nodes
    if not 1 <= floor <= nodes:
        fail(f"--min-nodes must be in 1..{nodes}, got {floor}", 2)
    delays = provision_seconds or [sim.MEASURED_PROVISION_SECONDS, *sim.ASSUMED_PROVISION_SECONDS]
    if any(d < 0 for d in delays) or provision_sigma < 0 or (restart_seconds or 0) < 0:
        fail("--provision-seconds, --provision-sigma and --restart-seconds must be >= 0", 2)
    return [
        sim.ElasticPlan(nodes, floor, gpus_per_node, d, provision_sigma, restart_seconds)
        for d in delays
    ]


def register(app: typer.Typer) -> None:
    app.command("classify")(classify)
    app.command("advise")(advise)
    app.command("simulate")(simulate)
