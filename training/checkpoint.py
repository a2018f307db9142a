"""Checkpoints that are never partial.

A save is a directory ``step_<N>`` (see ``orchestrator.contract``) holding the DCP
shards (one ``__<rank>_<i>.distcp`` per rank), DCP's ``.metadata``, ``manifest.json``
and, written last, ``COMMIT``. The protocol:

1. every rank writes its shard with ``torch.distributed.checkpoint`` (sync, or
   ``async_save``, which blocks only for the copy to CPU memory);
2. every rank hashes the files *it* wrote and the lists are gathered on rank 0
   (multi-node runs have no shared disk, so no rank can hash another's files);
3. rank 0 writes ``manifest.json`` (step, world size, every file with size and
   sha256), then ``COMMIT`` carrying the manifest's digest, each via rename.

A reader trusts a directory only if ``verify_checkpoint`` passes: COMMIT present
and naming this manifest, every listed file present with its size and checksum.
Anything else is partial or corrupt, is reported with the file and the reason,
and the next-newest complete checkpoint is offered instead.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from orchestrator.cloud.storage import file_sha256
from orchestrator.contract import (
    COMMIT_NAME,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    ManifestFile,
    check_commit,
    commit_marker,
    parse_step_dir,
    step_dir_name,
)


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded. The message names the file and why."""


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def files_written_by_rank(step_dir: Path, rank: int) -> list[ManifestFile]:
    """The shard files DCP's FileSystemWriter wrote for ``rank`` (rank 0 also owns
    ``.metadata``), with sizes and checksums."""
    names = sorted(p.name for p in step_dir.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (step_dir / ".metadata").exists():
        names.append(".metadata")
    out = []
    for name in names:
        p = step_dir / name
        out.append(ManifestFile(name, p.stat().st_size, file_sha256(str(p))))
    return out


def commit_checkpoint(
    step_dir: Path,
    *,
    step: int,
    world_size: int,
    files: list[ManifestFile],
    extra: dict | None = None,
) -> Manifest:
    """Write manifest.json then COMMIT (rank 0 only, after every rank's files exist)."""
    if not any(f.path == ".metadata" for f in files):
        raise CheckpointError(f"{step_dir}: refusing to commit without DCP's .metadata")
    manifest = Manifest(
        step=step,
        world_size=world_size,
        created=datetime.now(UTC).isoformat(),
        files=tuple(sorted(files, key=lambda f: f.path)),
        extra=dict(extra or {}),
    )
    data = manifest.to_json()
    _atomic_write(step_dir / MANIFEST_NAME, data)
    _atomic_write(step_dir / COMMIT_NAME, commit_marker(data))
    return manifest


def verify_checkpoint(step_dir: Path, *, deep: bool = True) -> Manifest:
    """The manifest of a complete checkpoint, or CheckpointError naming what is wrong.

    ``deep`` re-hashes every file; without it sizes are still checked.
    """
    commit = step_dir / COMMIT_NAME
    manifest_path = step_dir / MANIFEST_NAME
    if not commit.is_file():
        raise CheckpointError(f"{commit}: missing (the save never finished)")
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing")
    data = manifest_path.read_bytes()
    try:
        check_commit(commit.read_bytes(), data, source=str(commit))
        manifest = Manifest.from_json(data, source=str(manifest_path))
    except ManifestError as e:
        raise CheckpointError(str(e)) from None
    if parse_step_dir(step_dir.name) != manifest.step:
        raise CheckpointError(f"{manifest_path}: says step {manifest.step} in {step_dir.name}")
    for f in manifest.files:
        p = step_dir / f.path
        if not p.is_file():
            raise CheckpointError(f"{p}: missing shard")
        size = p.stat().st_size
        if size != f.size:
            raise CheckpointError(f"{p}: {size} bytes, manifest says {f.size} (truncated?)")
        if deep and file_sha256(str(p)) != f.sha256:
            raise CheckpointError(f"{p}: checksum mismatch (corrupted)")
    return manifest


@dataclass(frozen=True)
class Found:
    path: Path
    manifest: Manifest
    rejected: tuple[tuple[Path, str], ...]
    """Newer directories that were skipped, with the reason."""


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_<N>`` directory under root, newest first."""
    if not root.is_dir():
        return []
    out = [
        (s, p) for p in root.iterdir() if p.is_dir() and (s := parse_step_dir(p.name)) is not None
    ]
    return sorted(out, reverse=True)


def find_latest_complete(root: Path, *, deep: bool = True) -> Found | None:
    """The newest checkpoint that verifies; None if there is none."""
    rejected: list[tuple[Path, str]] = []
    for _step, path in step_dirs(root):
        try:
            return Found(path, verify_checkpoint(path, deep=deep), tuple(rejected))
        except CheckpointError as e:
            rejected.append((path, str(e)))
    return None


def prune(root: Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints (at least 2); delete older ones,
    and partial directories older than the newest complete one (a partial newer
    than it may be a save still in flight). Returns what was deleted."""
    if keep < 2:
        raise ValueError("keep at least 2 complete checkpoints")
    complete_seen = 0
    newest_complete: int | None = None
    deleted = []
    for step, path in step_dirs(root):
        is_complete = (path / COMMIT_NAME).is_file()
        if is_complete:
            complete_seen += 1
            newest_complete = step if newest_complete is None else newest_complete
            if complete_seen <= keep:
                continue
        elif newest_complete is None:
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def step_path(root: Path, step: int) -> Path:
    return root / step_dir_name(step)


# --- distributed save / load (imports torch) ------------------------------------------


def save_distributed(
    state_dict: dict, root: Path, step: int, *, extra: dict | None = None, process_group=None
) -> Path:
    """Synchronous sharded save of ``state_dict`` as ``root/step_<N>``, committed.

    Every rank of ``process_group`` (default: the world) must call it. Returns the
    step directory once COMMIT exists, on every rank.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    step_dir = step_path(root, step)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    world = dist.get_world_size(process_group) if distributed else 1
    _prepare_step_dir(step_dir, rank, process_group if distributed else _NO_GROUP)
    dcp.save(
        state_dict,
        checkpoint_id=str(step_dir),
        process_group=process_group,
        no_dist=not distributed,
    )
    _gather_and_commit(
        step_dir, step, rank, world, process_group if distributed else _NO_GROUP, extra
    )
    return step_dir


#: Marks "not distributed": no collectives at all (None means the default group).
_NO_GROUP = object()


def _prepare_step_dir(step_dir: Path, rank: int, group) -> None:
    """Rank 0 clears a leftover partial directory of this step (a save killed
    earlier must not contribute stale shards) and creates it; all ranks wait."""
    if rank == 0:
        if step_dir.exists() and not (step_dir / COMMIT_NAME).exists():
            shutil.rmtree(step_dir)
        step_dir.mkdir(parents=True, exist_ok=True)
    if group is not _NO_GROUP:
        import torch.distributed as dist

        dist.barrier(group)


def _gather_and_commit(step_dir: Path, step: int, rank: int, world: int, group, extra) -> None:
    """Each rank hashes its own files (nodes share no disk); rank 0 gathers the
    lists and commits; every rank returns once COMMIT exists."""
    mine = files_written_by_rank(step_dir, rank)
    files = mine
    if group is not _NO_GROUP:
        import torch.distributed as dist

        gathered: list[list[ManifestFile] | None] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        files = [f for per_rank in gathered for f in (per_rank or [])]
    if rank == 0:
        commit_checkpoint(step_dir, step=step, world_size=world, files=files, extra=extra)
    if group is not _NO_GROUP:
        import torch.distributed as dist

        dist.barrier(group)


def load_distributed(state_dict: dict, step_dir: Path, *, process_group=None) -> Manifest:
    """Verify ``step_dir`` and load it into ``state_dict`` in place (DCP reshards
    when the world size differs). Raises CheckpointError before touching state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    manifest = verify_checkpoint(step_dir)
    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(
        state_dict,
        checkpoint_id=str(step_dir),
        process_group=process_group,
        no_dist=not distributed,
    )
    return manifest


class Checkpointer:
    """Periodic saves, sync or async, never more than one in flight.

    Async: ``torch.distributed.checkpoint.async_save`` blocks only while the state is
    copied to CPU memory; the write runs in the background on a process group of
    its own (on the default group gloo aborts every rank when a background
    collective overlaps the training ones). A save is finalized (shards gathered,
    manifest and COMMIT written, old ones pruned) before the next one starts, at
    ``wait()``, or at ``close()`` — every rank calls these at the same step, so the
    collectives inside line up.
    """

    def __init__(
        self,
        root: Path,
        *,
        keep: int = 3,
        use_async: bool = True,
        extra: dict | None = None,
        upload_uri: str | None = None,
    ) -> None:
        """``root`` is the fast local tier. With ``upload_uri`` (file://, s3://,
        gs://), every committed save is then copied there, COMMIT last."""
        import torch.distributed as dist

        self.root = Path(root)
        self.upload_uri = upload_uri
        self.keep = keep
        self.use_async = use_async
        self.extra = dict(extra or {})
        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if self._distributed else 0
        self._world = dist.get_world_size() if self._distributed else 1
        self._group = dist.new_group(backend="gloo") if (use_async and self._distributed) else None
        # What collectives use: the async group, or none at all outside torchrun.
        self._coll_group = self._group if self._distributed else _NO_GROUP
        self._pending: tuple[int, object] | None = None
        self.last_blocking_s: float | None = None

    def save(self, state_dict: dict, step: int) -> None:
        import time

        self.wait()
        t0 = time.perf_counter()
        if not self.use_async:
            save_distributed(state_dict, self.root, step, extra=self.extra)
            self.last_blocking_s = time.perf_counter() - t0
            self._upload(step)
            self._prune()
            return
        import torch.distributed.checkpoint as dcp

        step_dir = step_path(self.root, step)
        _prepare_step_dir(step_dir, self._rank, self._coll_group)
        future = dcp.async_save(
            state_dict,
            checkpoint_id=str(step_dir),
            process_group=self._group,
            no_dist=not self._distributed,
        )
        self.last_blocking_s = time.perf_counter() - t0
        self._pending = (step, future)

    def wait(self) -> int | None:
        """Finish the save in flight, if any; returns its step once committed."""
        if self._pending is None:
            return None

        step, future = self._pending
        self._pending = None
        future.result()  # type: ignore[attr-defined]
        _gather_and_commit(
            step_path(self.root, step),
            step,
            self._rank,
            self._world,
            self._coll_group,
            self.extra,
        )
        self._upload(step)
        self._prune()
        return step

    def _upload(self, step: int) -> None:
        """Copy a committed local save to ``upload_uri``: each rank its own shards
        (nodes share no disk), then rank 0 checks the listing against the manifest
        and writes manifest.json and, last, COMMIT. Any failure raises before
        COMMIT, so the remote copy is never taken for complete when it is not."""
        if not self.upload_uri:
            return
        import torch.distributed as dist

        from orchestrator.cloud.storage import StorageError, store_for_uri

        store, prefix = store_for_uri(self.upload_uri)
        step_dir = step_path(self.root, step)
        key = "/".join(p for p in (prefix, step_dir.name) if p)
        names = [p.name for p in step_dir.glob(f"__{self._rank}_*.distcp")]
        if self._rank == 0:
            names.append(".metadata")
        failed = ""
        try:
            for name in names:
                store.put_file(str(step_dir / name), f"{key}/{name}")
        except StorageError as e:
            failed = str(e)
        if self._distributed:
            errors: list[str | None] = [None] * self._world
            dist.all_gather_object(errors, failed, group=self._group)
            failed = "; ".join(e for e in errors if e)
        if failed:
            raise CheckpointError(f"upload of step {step} to {self.upload_uri} failed: {failed}")
        if self._rank == 0:
            manifest_bytes = (step_dir / MANIFEST_NAME).read_bytes()
            manifest = Manifest.from_json(manifest_bytes)
            listed = {o.key.rsplit("/", 1)[-1]: o.size for o in store.list(key + "/")}
            for f in manifest.files:
                if listed.get(f.path) != f.size:
                    raise CheckpointError(
                        f"{self.upload_uri}/{step_dir.name}/{f.path}: not uploaded at "
                        f"{f.size} bytes (found {listed.get(f.path)})"
                    )
            store.put_bytes(f"{key}/{MANIFEST_NAME}", manifest_bytes)
            store.put_bytes(f"{key}/{COMMIT_NAME}", (step_dir / COMMIT_NAME).read_bytes())
        if self._distributed:
            dist.barrier(self._group)

    def _prune(self) -> None:
        if self._rank == 0:
            prune(self.root, self.keep)

    def close(self) -> None:
        self.wait()
