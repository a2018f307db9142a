"""Staging the resume checkpoint onto the node's disk, before torchrun starts.

The service names one confirmed step directory in ``Env.STAGE_FROM`` (``s3://``,
``gs://`` or ``file://``), and in ``Env.RESUME_FROM`` the place the ranks will load it
from, ``{node_disk}/staged/step_<N>``, with ``Env.EXPECTED_STEP`` = N. The agent
brings the step there with the same code on every launcher
(``orchestrator.cloud.storage.stage_checkpoint``: file by file, each verified by
sha256 before it carries its manifest name; files already there and verified are
kept, so an in-place restart downloads nothing) and only then starts torchrun. A
rank is never handed a remote URI as a path: ``training`` refuses one (exit 78).

Exactly the step asked for, or nothing: ``stage_checkpoint`` falls back to an older
complete checkpoint when the newest is corrupt (right for ``latest``, wrong here:
the service confirmed *this* step on every node, and ranks loading different steps
is what validation exists to prevent). So the step is checked in the store's
listing first (a missing object or a torn COMMIT is refused before any byte moves),
and a stage that landed on another step is refused naming why step N was skipped.
What that costs: a shard whose bytes are corrupt at the right size is found only
by downloading it, and then the older checkpoint has been staged before the
refusal (it is removed again when it was not on the disk before).

Imported only when ``STAGE_FROM`` is set: the object-store SDKs load then, not on
every agent start.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

from orchestrator.contract import Env, parse_step_dir, step_dir_name

#: Under the node's disk: where staged steps land (``Env.RESUME_FROM`` names one).
STAGED_DIR = "staged"
#: What a run-context value writes for the node's local disk directory.
NODE_DISK_TOKEN = "{node_disk}"
#: Run-context variables the token may appear in.
RUN_ENV_PREFIX = "SKYRESUME_RUN_"
SCHEMES = ("s3", "gs", "file")


def node_disk_values(env: Mapping[str, str], node_disk: Path | str) -> dict[str, str]:
    """``env`` with ``{node_disk}`` replaced by the node's disk in every
    ``SKYRESUME_RUN_*`` value (what the task templates' run sections did in bash)."""
    disk = str(node_disk)
    return {
        k: v.replace(NODE_DISK_TOKEN, disk) if k.startswith(RUN_ENV_PREFIX) else v
        for k, v in env.items()
    }


def safe_uri(uri: str) -> str:
    """The URI without any ``user:password@`` part: what a report may carry."""
    p = urlparse(uri)
    if "@" not in p.netloc:
        return uri
    return urlunparse(p._replace(netloc=p.netloc.rsplit("@", 1)[1]))


class StageError(Exception):
    """The step cannot be staged; the message names the URI and what is wrong."""


@dataclass(frozen=True)
class StageOutcome:
    """What the ``staged`` report carries (and the service stores as the event)."""

    ok: bool
    step: int | None
    """The step asked for (None when the URI names no step directory)."""
    detail: str
    """Why it failed, naming the object; on success where the step landed."""
    bytes: int
    """Bytes downloaded from the store (0 when everything was already on disk)."""
    seconds: float
    uri: str
    """The source URI, without credentials."""
    path: str = ""
    """The staged step directory ('' when staging failed)."""

    def report_fields(self, node_id: str) -> dict[str, Any]:
        return {
            "node_id": node_id,
            "step": self.step,
            "ok": self.ok,
            "detail": self.detail[:1024],
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "uri": self.uri,
        }


def split_step_uri(uri: str) -> tuple[str, int]:
    """(the URI of the checkpoint root above the step, the step) of a ``step_<N>`` URI."""
    p = urlparse(uri)
    if p.scheme not in SCHEMES:
        raise StageError(f"{safe_uri(uri)}: staging reads s3://, gs:// or file:// URIs")
    path = p.path.rstrip("/")
    parent, _, name = path.rpartition("/")
    step = parse_step_dir(name)
    if step is None or (p.scheme != "file" and not p.netloc):
        raise StageError(f"{safe_uri(uri)}: does not name a step_<N> directory")
    root = urlunparse(p._replace(path=parent or ("/" if p.scheme == "file" else "")))
    return root, step


def stage_step(
    uri: str,
    node_disk: Path,
    *,
    expected_step: int | None = None,
    workers: int = 16,
    part_size: int = 16 << 20,
) -> StageOutcome:
    """Stage the one step directory ``uri`` names into ``node_disk/staged/step_<N>``.

    Never raises for a storage problem: the outcome says what went wrong."""
    from orchestrator.cloud.storage import StorageError, list_checkpoints, stage_checkpoint

    t0 = time.monotonic()
    shown = safe_uri(uri)
    step: int | None = None

    def failed(detail: str, downloaded: int = 0) -> StageOutcome:
        return StageOutcome(False, step, detail, downloaded, time.monotonic() - t0, shown)

    try:
        root, step = split_step_uri(uri)
    except StageError as e:
        return failed(str(e))
    if expected_step is not None and expected_step != step:
        return failed(f"{shown} is step {step}, but {Env.EXPECTED_STEP} says {expected_step}")
    dest_root = node_disk / STAGED_DIR
    try:
        found = {c.step: c for c in list_checkpoints(root)}
        info = found.get(step)
        if info is None:
            there = ", ".join(str(s) for s in sorted(found)) or "none"
            return failed(f"{shown}: no such checkpoint in the store (steps there: {there})")
        if not info.complete:
            return failed(f"{shown}: not a complete checkpoint: {info.reason}")
        before = {d.name for d in dest_root.iterdir()} if dest_root.is_dir() else set()
        staged = stage_checkpoint(
            root, str(dest_root), at_most=step, workers=workers, part_size=part_size
        )
    except StorageError as e:
        return failed(f"staging {shown}: {e}")
    except OSError as e:  # the node's disk: full, read-only, gone
        return failed(f"staging {shown} into {dest_root}: {e}")
    if staged.step != step:
        why = "; ".join(s.reason for s in staged.skipped if s.step == step) or "skipped"
        landed = Path(staged.path)
        if landed.name not in before:
            shutil.rmtree(landed, ignore_errors=True)  # not ours to keep: never asked for
        return failed(f"{shown}: refused ({why})", staged.downloaded_bytes)
    path = dest_root / step_dir_name(step)
    if Path(staged.path) != path:
        return failed(f"{shown}: staged into {staged.path}, expected {path}")
    return StageOutcome(
        True,
        step,
        f"step {step} staged into {path} ({staged.files} files, {staged.bytes} bytes)",
        staged.downloaded_bytes,
        time.monotonic() - t0,
        shown,
        str(path),
    )


def stage_for_ranks(env: Mapping[str, str], node_disk: Path) -> StageOutcome | None:
    """Stage what ``env`` (the ranks' environment, ``{node_disk}`` already replaced)
    asks for; None when it asks for nothing (no ``STAGE_FROM``).

    Refuses a ``RESUME_FROM`` that is not the staged directory: the ranks would load
    something other than what was verified here."""
    uri = env.get(Env.STAGE_FROM, "").strip()
    if not uri:
        return None
    raw = env.get(Env.EXPECTED_STEP, "").strip()
    try:
        expected = int(raw) if raw else None
    except ValueError:
        step = parse_step_dir(urlparse(uri).path)
        detail = f"{Env.EXPECTED_STEP}={raw!r} is not an integer"
        return StageOutcome(False, step, detail, 0, 0.0, safe_uri(uri))
    out = stage_step(uri, node_disk, expected_step=expected)
    resume = env.get(Env.RESUME_FROM, "").strip()
    if out.ok and resume and Path(urlparse(resume).path).resolve() != Path(out.path).resolve():
        detail = f"{Env.RESUME_FROM}={resume!r} is not the staged {out.path}"
        return StageOutcome(False, out.step, detail, out.bytes, out.seconds, out.uri)
    return out
