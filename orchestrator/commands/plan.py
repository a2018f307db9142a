"""``skyresume plan FILE``: where a job would run, what it would cost, which knobs.

FILE is a skyresume job spec or a plain SkyPilot task YAML. Planning reads
SkyPilot's catalog only (no service, no cloud credentials): candidates come from
:mod:`orchestrator.launchers.catalog`, the ranking from the pure planner, and the
last line shows the replacement the reconciler would pick if the top choice were
preempted now (its region cooled down, its instance type penalised).

Exit codes: 2 for input the operator can fix (bad spec, unknown accelerator, a
YAML SkyPilot rejects, nothing left after the job's constraints), 1 when the
catalog is missing on this machine (the message says how to get one).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from orchestrator.commands.common import Output, OutputOpt, err_console, fail, load_settings


def _is_job_spec(doc: dict[str, Any]) -> bool:
    return isinstance(doc.get("task"), dict) or "checkpoint" in doc


def _task_demand(
    path: Path, envs: dict[str, str] | None = None, secrets: dict[str, str] | None = None
) -> Any:
    """(sky.Task, TaskDemand, config) of the task YAML at ``path``, checked as
    ``submit`` checks it (``launchers.user_task.check_task_text``)."""
    from orchestrator.launchers.catalog import demand_from_task
    from orchestrator.launchers.user_task import check_task_text, read_task_text

    checked = check_task_text(read_task_text(path, str(path)), str(path), envs=envs,
                              secrets=secrets)  # fmt: skip
    return checked.task, demand_from_task(checked.task), checked.config


def _spec_from_skypilot_yaml(path: Path, envs: Any, secrets: Any) -> tuple[Any, Any, Any, Any]:
    """(JobSpec for the planner, TaskDemand, sky.Task, config) from a plain task YAML."""
    from orchestrator.domain.spec import SpecError, validate_job_spec

    task, demand, config = _task_demand(path, envs, secrets)
    raw_name = str(task.name or path.stem).lower()
    name = re.sub(r"[^a-z0-9\-_.]+", "-", raw_name).strip("-")[:63] or "task"
    doc = {
        "name": name,
        "task": {"skypilot_yaml": str(path)},
        "num_nodes": demand.num_nodes,
        "accelerators": list(demand.accelerators),
        # Planning never writes a checkpoint; the spec type needs a URI.
        "checkpoint": {"uri": "file:///tmp/skyresume-plan"},
    }
    try:
        return validate_job_spec(doc), demand, task, config
    except SpecError as e:
        raise ValueError(f"{path}: cannot plan this SkyPilot task: {e}") from None


def service_history() -> list[Any]:
    """The placement failures the service's planner weighs (``GET
    /v1/placement-history``), so this plan ranks as the live SELECT step does. A
    service that cannot be reached leaves the history empty, said on stderr."""
    import httpx

    from orchestrator.api.auth import read_client_token
    from orchestrator.domain.planner import FailureRecord

    settings = load_settings()
    url = settings.effective_service_url.rstrip("/")
    token = read_client_token(settings)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(
            f"{url}/v1/placement-history",
            headers=headers,
            timeout=5,
            verify=settings.client_verify(),
        )
        r.raise_for_status()
        items = r.json()["items"]
        out = [
            FailureRecord(
                i["cloud"], i["region"], i["instance_type"],
                datetime.fromisoformat(i["at"]), i["failure_class"],
            )
            for i in items
        ]  # fmt: skip
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        err_console.print(
            f"note: no failure history ({url} unreachable or refused: {type(e).__name__}); "
            "ranked by the catalog alone",
            markup=False,
            highlight=False,
        )
        return []
    err_console.print(f"note: ranked with {len(out)} placement failures from {url}", markup=False)
    return out


def _load(
    path: Path, envs: dict[str, str] | None = None, secrets: dict[str, str] | None = None
) -> tuple[str, Any, Any, Any, Any, list[str]]:
    """(kind, JobSpec, TaskDemand or None, sky.Task or None, task config or None,
    notes): the task, when there is one, is what SkyPilot's optimizer plans; the
    notes say which of the spec and the YAML decided nodes and spot."""
    from orchestrator.domain.spec import (
        SpecError,
        load_yaml_document,
        task_spot_note,
        validate_job_spec,
        with_task_num_nodes,
    )

    try:
        text = path.read_bytes()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}", 2)
    from orchestrator.launchers.base import TaskRejected
    from orchestrator.launchers.user_task import single_document

    try:
        single_document(text, str(path))
        doc = load_yaml_document(text, what=str(path))
    except SpecError as e:
        fail(f"{path}: {e}", 2)
    except TaskRejected as e:
        fail(str(e), 2)
    if not isinstance(doc, dict):
        fail(f"{path}: expected a job spec or a SkyPilot task (a mapping)", 2)
    if not _is_job_spec(doc):
        spec, demand, task, config = _spec_from_skypilot_yaml(path, envs, secrets)
        return "skypilot", spec, demand, task, config, []
    try:
        spec = validate_job_spec(doc)
    except SpecError as e:
        fail(f"{path}: {e}", 2)
    if spec.task.skypilot_yaml:
        # Its SkyPilot YAML (relative to the spec) gives the job's accelerators, when
        # the spec names none, and its nodes, when the spec gives no num_nodes.
        yaml_path = Path(spec.task.skypilot_yaml)
        if not yaml_path.is_absolute():
            yaml_path = path.parent / yaml_path
        all_envs = {**(getattr(spec.task, "envs", None) or {}), **(envs or {})}
        all_secrets = {**(getattr(spec.task, "secrets", None) or {}), **(secrets or {})}
        task, demand, config = _task_demand(yaml_path, all_envs, all_secrets)
        try:  # the YAML's num_nodes unless the spec gives its own, said either way
            spec, nodes = with_task_num_nodes(spec, demand.num_nodes)
        except SpecError as e:
            fail(f"{path}: {e}", 2)
        if spec.accelerator_names:  # planned over the spec's own accelerators
            return "job", spec, None, None, None, [nodes]
        spec = spec.model_copy(update={"accelerators": list(demand.accelerators)})
        return "job", spec, demand, task, config, [nodes, task_spot_note(spec)]
    return "job", spec, None, None, None, []


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """``KEY=VALUE`` pairs (``--env``, ``--secret``), as SkyPilot's CLI takes them."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            fail(f"{flag} {key!r}: use KEY=VALUE (KEY: letters, digits, '_')", 2)
        out[key] = value
    return out


#: Resource fields the plan lists as carried to the launched task unchanged.
_KEPT_FIELDS = (
    "image_id", "disk_size", "disk_tier", "network_tier", "ports", "labels", "cpus",
    "memory", "zone", "autostop", "accelerator_args", "volumes",
)  # fmt: skip


def task_resource_fields(config: dict[str, Any]) -> list[str]:
    """The task's own resource fields (and each any_of/ordered option's), as written:
    what the launch keeps beside the placement it pins."""
    res = config.get("resources")
    if not isinstance(res, dict):
        return []
    out = [f"{k}: {json.dumps(res[k], default=str)}" for k in _KEPT_FIELDS if k in res]
    for kind in ("any_of", "ordered"):
        for i, o in enumerate(res.get(kind) or []):
            if isinstance(o, dict):
                out += [
                    f"{kind}[{i}].{k}: {json.dumps(o[k], default=str)}"
                    for k in (*_KEPT_FIELDS, "use_spot")
                    if k in o
                ]
    return out


def _gpus(p: Any) -> str:
    if not p.accelerator:
        return "cpu"
    mem = f" {p.gpu_memory_gib:g} GiB" if p.gpu_memory_gib else ""
    return f"{p.accelerator_count}x {p.accelerator}{mem}"


#: The knobs in each framework's own terms (task.framework; training.integrations
#: applies them under these names): micro-batch, accumulation, activation checkpointing.
KNOB_NAMES: dict[str, tuple[str, str, str]] = {
    "skyresume": ("micro", "accum", "AC"),
    "plain": ("micro", "accum", "AC"),
    "hf": ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing"),
    "accelerate": ("batch_size", "gradient_accumulation_steps", "gradient_checkpointing"),
    "lightning": ("batch_size", "accumulate_grad_batches", "activation checkpointing"),
}


def _knobs(p: Any, framework: str = "skyresume") -> str:
    k = p.knobs
    if k is None:
        return "-"
    ac = {0: "off", 1: "every block"}.get(
        k.activation_checkpoint_every, f"every {k.activation_checkpoint_every}th"
    )
    micro, accum, ckpt = KNOB_NAMES.get(framework, KNOB_NAMES["skyresume"])
    if framework in ("skyresume", "plain"):
        return f"{micro} {k.micro_batch} x {accum} {k.grad_accum}, {ckpt} {ac}"
    return f"{micro} {k.micro_batch}, {accum} {k.grad_accum}, {ckpt} {ac}"


def _ranked_json(r: Any) -> dict[str, Any]:
    return {
        **r.placement.to_dict(),
        "score": round(r.score, 4),
        "price_per_job_hour": round(r.price_per_job_hour, 4),
        "expected_lost_fraction": round(r.expected_lost_fraction, 4),
        "recent_preemptions": round(r.recent_preemptions, 4),
        "memory": r.memory.to_dict() if r.memory else None,
    }


def plan(
    file: Annotated[Path, typer.Argument(help="a skyresume job spec or a SkyPilot task YAML")],
    exclude_region: Annotated[
        list[str] | None,
        typer.Option(
            "--exclude-region",
            help="leave out a region (us-east-1 or aws/us-east-1); repeatable",
        ),
    ] = None,
    output: OutputOpt = Output.table,
    limit: Annotated[int, typer.Option("--limit", help="rows shown in the table")] = 10,
    history: Annotated[
        bool,
        typer.Option(
            "--history/--no-history",
            help="rank with the service's placement failure history, as the live SELECT does",
        ),
    ] = True,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", help="KEY=VALUE for the task's envs (a YAML's empty ones)"),
    ] = None,
    secret: Annotated[
        list[str] | None,
        typer.Option("--secret", help="KEY=VALUE for the task's secrets (never shown)"),
    ] = None,
) -> None:
    """Rank where FILE's job would run (catalog only, no credentials needed)."""
    from orchestrator.domain.planner import rank, replacement_after_preemption
    from orchestrator.launchers.base import LaunchError
    from orchestrator.launchers.catalog import (
        CatalogUnavailable,
        UnknownAccelerator,
        gather_candidates,
        oracle_for_task,
    )

    excluded = tuple(exclude_region or ())
    envs = parse_key_values(env, "--env")
    secrets = parse_key_values(secret, "--secret")
    best = None
    try:
        # SkyPilot prints spinner payloads to stdout (e.g. while it looks an unknown
        # accelerator name up on Kubernetes); stdout here is the plan, keep it clean.
        with contextlib.redirect_stdout(io.StringIO()):
            kind, spec, demand, task, config, notes = _load(file, envs, secrets)
            if task is not None:
                # SkyPilot's own optimizer says what is launchable (and refuses with
                # its reason); the ranking below adds what it does not weigh.
                oracle = oracle_for_task(task, clouds=spec.clouds)
                candidates = list(oracle.candidates)
                best = oracle.best
            else:
                candidates = gather_candidates(
                    spec.accelerator_names, clouds=spec.clouds, regions=spec.regions
                )
    except CatalogUnavailable as e:
        fail(str(e), 1)
    except (UnknownAccelerator, LaunchError, ValueError) as e:
        fail(str(e), 2)
    if config is not None:
        from orchestrator.launchers.user_task import unsupported_lines

        notes = [*notes, *unsupported_lines(config)]
    fields = task_resource_fields(config) if config is not None else []
    now = datetime.now(UTC)
    past = service_history() if history else []
    # A task YAML's ``ordered:`` options are numbered by the catalog: a strict preference.
    strict = any(o[3] > 0 for o in demand.options) if demand is not None else None
    ranking = rank(spec, candidates, past, now, exclude_regions=excluded, strict_preference=strict)
    if not ranking.ranked:
        fail(f"no placement for {spec.name!r}: {ranking.why_empty()}", 2)
    top = ranking.ranked[0].placement
    framework = str(getattr(spec.task, "framework", "skyresume"))
    after = replacement_after_preemption(spec, candidates, past, now, top, exclude_regions=excluded)
    replacement = after.ranked[0] if after.ranked else None

    if output is Output.json:
        doc = {
            "file": str(file),
            "kind": kind,
            "job": spec.name,
            "num_nodes": spec.num_nodes,
            "spot": spec.spot,
            "framework": framework,
            "notes": notes,
            "resources_kept": fields,
            "skypilot_choice": (
                None
                if best is None
                else {
                    "cloud": best.cloud,
                    "region": best.region,
                    "instance_type": best.instance_type,
                    "spot": best.spot,
                }
            ),
            "excluded_regions": list(excluded),
            "ranked": [_ranked_json(r) for r in ranking.ranked],
            "rejected": [
                {
                    "cloud": j.candidate.cloud,
                    "region": j.candidate.region,
                    "instance_type": j.candidate.instance_type,
                    "constraint": j.constraint,
                    "reason": j.reason,
                }
                for j in ranking.rejected
            ],
            "replacement_after_preemption": (
                {"preempted": top.to_dict(), **_ranked_json(replacement)}
                if replacement
                else {"preempted": top.to_dict(), "why_none": after.why_empty()}
            ),
        }
        print(json.dumps(doc, indent=1))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # pipes and logs: do not squeeze columns to 80
    kinds = {r.placement.spot for r in ranking.ranked}
    market = "spot" if kinds == {True} else "on-demand" if kinds == {False} else "spot/on-demand"
    table = Table(title=f"{spec.name}: {spec.num_nodes} node(s), {market}")
    right = ("#", "nodes", "$/h", "$/useful h", "lost")
    cols = ("#", "cloud/region", "instance type", "GPUs", "nodes", "$/h", "$/useful h", "lost")
    for col in (*cols, "knobs"):
        table.add_column(col, justify="right" if col in right else "left", no_wrap=col != "knobs")
    for i, r in enumerate(ranking.ranked[:limit], 1):
        p = r.placement
        table.add_row(
            str(i),
            f"{p.cloud}/{p.region}",
            p.instance_type,
            _gpus(p),
            str(p.num_nodes),
            f"{r.price_per_job_hour:.2f}",
            f"{r.score:.2f}",
            f"{r.expected_lost_fraction:.0%}",
            _knobs(p, framework),
        )
    console.print(table)
    console.print(
        "$/h: spot (or on-demand) price of every node together; $/useful h: that price "
        "over the work it gets done after recompute, fewer nodes and expected "
        "preemption losses (the ranking)",
        highlight=False,
    )
    console.print(f"why #1: {'; '.join(top.reasons)}", highlight=False, markup=False)
    if best is not None:
        console.print(
            f"SkyPilot's optimizer alone: {best.cloud}/{best.region} {best.instance_type} "
            f"({'spot' if best.spot else 'on-demand'})",
            highlight=False,
            markup=False,
        )
    for line in fields:
        console.print(f"kept: {line}", highlight=False, markup=False)
    for line in notes:
        console.print(f"note: {line}", highlight=False, markup=False)
    if len(ranking.ranked) > limit:
        console.print(f"... and {len(ranking.ranked) - limit} more (--limit, or -o json)")
    if ranking.rejected:
        counts: dict[str, int] = {}
        for j in ranking.rejected:
            counts[j.constraint] = counts.get(j.constraint, 0) + 1
        console.print(
            "rejected: " + ", ".join(f"{n} by {c}" for c, n in counts.items()),
            highlight=False,
        )
        for j in ranking.rejected:
            if j.constraint == "fit":
                console.print(f"  fit: {j.reason}", highlight=False, markup=False)
                break
    if replacement is not None:
        p = replacement.placement
        console.print(
            f"after a preemption in {top.cloud}/{top.region}: {p.cloud}/{p.region} "
            f"{p.instance_type} ({_gpus(p)}) x {p.num_nodes}, "
            f"${replacement.price_per_job_hour:.2f}/h, knobs {_knobs(p, framework)}",
            highlight=False,
            markup=False,
        )
    else:
        console.print(
            f"after a preemption in {top.cloud}/{top.region}: nothing ({after.why_empty()})",
            highlight=False,
            markup=False,
        )


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
