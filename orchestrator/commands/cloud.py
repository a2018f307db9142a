"""CLI commands for the cloud adapters: ``metadata probe``, ``checkpoints ls|stage``.

They run on the node or the operator's machine directly (no service needed). SDKs
are imported inside the commands so ``skyresume --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from orchestrator.commands.common import fail
from orchestrator.contract import PROVIDERS

metadata_app = typer.Typer(help="Cloud metadata: preemption notices.", no_args_is_help=True)
checkpoints_app = typer.Typer(help="Checkpoints in object storage.", no_args_is_help=True)


#: ``--provider``'s choices: a provider whose format is read, or auto to detect it.
PROVIDER_CHOICES = (*PROVIDERS, "auto")


def _provider_choice(value: str) -> str:
    if value not in PROVIDER_CHOICES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(PROVIDER_CHOICES)}")
    return value


@metadata_app.command("probe")
def probe(
    provider: Annotated[
        str,
        typer.Option(
            callback=_provider_choice,
            help=f"{', '.join(PROVIDERS)}, or auto to detect it",
        ),
    ] = "auto",
    endpoint: Annotated[
        str | None,
        typer.Option(help="base URL of the metadata service (default: the provider's own)"),
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds per request")] = 2.0,
) -> None:
    """Print the current preemption notice as JSON, or {"notice": null} when none."""
    from orchestrator.cloud import metadata as md

    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        fail(f"--endpoint {endpoint!r} must be an http:// or https:// URL", 2)
    if provider == "auto":
        found = md.detect_provider(endpoint, timeout=min(timeout, 1.0))
        if found is None:
            where = endpoint or "the default metadata endpoints"
            fail(f"no AWS, GCP or Azure metadata service answered at {where}")
        chosen = found
    else:
        chosen = md.Provider(provider)
    kw: dict[str, float] = {"timeout": timeout}
    if chosen is md.Provider.azure:
        kw["first_timeout"] = max(timeout, 30.0)
    result = md.poller_for(chosen, endpoint, **kw).poll()
    if result.state == "unknown":
        fail(f"{chosen} metadata unreadable: {result.error}")
    notice = result.notice.to_dict() if result.notice else None
    print(json.dumps({"provider": str(chosen), "notice": notice}))


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@checkpoints_app.command("ls")
def checkpoints_ls(
    uri: Annotated[str, typer.Argument(help="checkpoint root: s3://, gs:// or file://")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List checkpoints under URI: step, complete or not, files and size."""
    from orchestrator.cloud.storage import StorageError, list_checkpoints

    try:
        found = list_checkpoints(uri)
    except StorageError as e:
        fail(str(e))
    if as_json:
        print(json.dumps([c.to_dict() for c in found]))
        return
    if not found:
        print(f"no checkpoints under {uri}")
        return
    for c in found:
        state = "complete" if c.complete else f"INCOMPLETE ({c.reason})"
        print(f"step {c.step:>10}  {state:<30} {c.files:>5} files  {_human(c.size)}")


@checkpoints_app.command("stage")
def checkpoints_stage(
    uri: Annotated[str, typer.Argument(help="checkpoint root: s3://, gs:// or file://")],
    local_dir: Annotated[str, typer.Argument(help="local directory to stage into")],
    workers: Annotated[int, typer.Option(min=1, max=256, help="parallel transfers")] = 16,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
) -> None:
    """Download the newest complete checkpoint to LOCAL_DIR, verifying every file."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from orchestrator.cloud.storage import StorageError, stage_checkpoint

    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        disable=quiet or not sys.stderr.isatty(),
        transient=True,
    )
    task = progress.add_task("staging", total=None)

    def on_progress(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    try:
        with progress:
            staged = stage_checkpoint(uri, local_dir, workers=workers, on_progress=on_progress)
    except StorageError as e:
        fail(str(e))
    for skipped in staged.skipped:
        print(f"skipped step {skipped.step}: {skipped.reason}", file=sys.stderr)
    print(
        json.dumps(
            {
                "step": staged.step,
                "path": staged.path,
                "files": staged.files,
                "bytes": staged.bytes,
                "downloaded_bytes": staged.downloaded_bytes,
            }
        )
    )


def register(app: typer.Typer) -> None:
    app.add_typer(metadata_app, name="metadata")
    app.add_typer(checkpoints_app, name="checkpoints")
