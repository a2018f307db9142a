"""CLI commands for failures: ``classify``, ``advise``, ``simulate``.

All three run locally on the pure core (no service needed): an operator classifies a
log they hold, asks for a checkpoint interval, or compares recovery policies.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.commands.common import Output, OutputOpt, fail

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
    model = sim.failure_model(failure_model, spot_preemptions_per_day=spot_per_day)
    results = sim.compare({p: sim.POLICIES[p] for p in chosen}, model, gpus, days, seed, price)
    if output is Output.json:
        doc = {"gpus": gpus, "days": days, "failure_model": failure_model, "seed": seed}
        print(json.dumps({**doc, "results": [r.to_json_dict() for r in results]}))
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


def register(app: typer.Typer) -> None:
    app.command("classify")(classify)
    app.command("advise")(advise)
    app.command("simulate")(simulate)
