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

import contextlib
import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
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
        created=datetime.now(timezone.utc).isoformat(),
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


def drop_rank_shards(step_dir: Path, rank: int) -> None:
    """Delete ``rank``'s shards of one save. The directory may vanish meanwhile: on a
    disk the nodes share, another node's rank prunes whole directories (:func:`prune`)
    while this one lists it, and a listing whose directory is removed under it raises;
    a shard already gone is what was wanted."""
    with contextlib.suppress(FileNotFoundError):
        for p in step_dir.glob(f"__{rank}_*.distcp"):
            p.unlink(missing_ok=True)


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


def split_replicated(state_dict: dict, *, group=None) -> dict:
    """This rank's share of a state dict whose plain entries are replicated (DDP).

    DCP writes a replicated tensor once, from one rank, but ``async_save`` first
    copies every rank's *whole* state to CPU memory, so with DDP each rank copies
    everything and the step blocks for that. Here the entries every rank has are
    spread over the ranks (largest first, to the least loaded; the same choice on
    every rank) and each rank keeps only its own plus what only it has (its RNG
    states). Sharded entries (DTensor, FSDP2) stay where they are. The checkpoint
    is the same as a full save: DCP's metadata lists every entry once, and a load
    asks for the whole state as usual. Same key means same value is DCP's own rule
    for plain tensors (its deduplication keeps one copy), so nothing new is assumed.
    A collective on ``group``: every rank calls it.
    """
    import torch
    import torch.distributed as dist

    leaves: dict[tuple, object] = {}

    def walk(d: dict, prefix: tuple) -> None:
        for k, v in d.items():
            if isinstance(v, dict) and v:
                walk(v, (*prefix, k))
            else:
                leaves[(*prefix, k)] = v

    walk(state_dict, ())

    def nbytes(v: object) -> int | None:
        if isinstance(v, torch.Tensor):
            # Exact type: subclasses (DTensor) are sharded already; leave them alone.
            return v.numel() * v.element_size() if type(v) is torch.Tensor else None
        return 64  # a small Python object (scheduler fields, sampler position)

    if any(isinstance(v, torch.Tensor) and type(v) is not torch.Tensor for v in leaves.values()):
        return state_dict  # sharded (FSDP2): each rank already holds and copies 1/N
    movable = sorted(((p, n) for p, v in leaves.items() if (n := nbytes(v)) is not None), key=repr)
    world = dist.get_world_size(group)
    gathered: list[list | None] = [None] * world
    dist.all_gather_object(gathered, movable, group=group)
    common = set.intersection(*({p for p, _ in g or []} for g in gathered))
    sizes = dict(gathered[0] or [])
    load = [0] * world
    owner: dict[tuple, int] = {}
    for p in sorted(common, key=lambda p: (-sizes[p], repr(p))):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[p] = r
        load[r] += sizes[p]
    rank = dist.get_rank(group)
    out: dict = {}
    for p, v in leaves.items():
        if owner.get(p, rank) != rank:
            continue
        d = out
        for k in p[:-1]:
            d = d.setdefault(k, {})
        d[p[-1]] = v
    return out


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


def prune_remote(uri: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints under ``uri`` (any ObjectStore);
    delete older complete ones and partial ones older than the oldest one kept.

    Never touches the newest complete checkpoint (keep >= 2) nor anything newer than
    it: a partial step newer than that may be an upload in flight (ours, or an agent
    uploading a node's local tier after its ranks exited). A deleted checkpoint loses
    its COMMIT first, so a reader that lists it meanwhile sees it partial, and
    staging moves on to the next-newest when an object vanishes mid-download.
    Returns the step keys deleted.
    """
    from orchestrator.cloud.storage import list_checkpoints, store_for_uri

    if keep < 2:
        raise ValueError("keep at least 2 complete checkpoints")
    found = list_checkpoints(uri)  # oldest first
    complete = [c for c in found if c.complete]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep].step
    doomed = [c for c in found if c.step < oldest_kept]
    store, _prefix = store_for_uri(uri)
    for c in doomed:
        keys = [o.key for o in store.list(c.key + "/")]
        first = [k for k in keys if k.endswith("/" + COMMIT_NAME)]
        second = [k for k in keys if k.endswith("/" + MANIFEST_NAME)]
        for k in first + second + [k for k in keys if k not in first and k not in second]:
            store.delete(k)
    return [c.key for c in doomed]


@dataclass(frozen=True)
class Committed:
    """A save that is complete locally (and, if ``uploaded_uri``, durably)."""

    step: int
    path: Path
    """The committed local step directory."""
    uploaded_uri: str | None
    """The step directory's URI in the checkpoint store once it is complete there
    (uploaded, or written there directly); None when the upload failed."""
    world_size: int
    blocking_s: float | None = None
    """How long training was blocked by this save (async: the copy to host memory)."""
    uploads: tuple[tuple[int, int, float], ...] = ()
    """(rank, bytes, seconds) of each rank's upload of its own shards (remote stores)."""


class Checkpointer:
    """Periodic saves, sync or async, never more than one in flight.

    Async: ``torch.distributed.checkpoint.async_save`` blocks only while the state is
    copied to CPU memory. Everything after that (DCP's write, each rank hashing its
    shards, rank 0 writing manifest.json and COMMIT, the upload, pruning) runs on
    one background thread per save, on a gloo process group of its own: on the
    default group, gloo aborts every rank when a background collective overlaps a
    training one. Each rank's thread issues the same collectives in the same order,
    so they line up without the training loop's help. ``save()`` (the next one),
    ``wait()`` and ``close()`` join the thread first; every rank calls them at the
    same step.

    ``on_commit`` is called on every rank, from that thread for async saves, once a
    save is committed and its upload (if any) finished or failed. An upload failure
    does not stop training: the local copy is complete, the failure is printed, and
    ``Committed.uploaded_uri`` is None.
    """

    def __init__(
        self,
        root: Path,
        *,
        keep: int = 3,
        use_async: bool = True,
        extra: dict | None = None,
        upload_uri: str | None = None,
        durable_uri: str | None = None,
        on_commit: Callable[[Committed], None] | None = None,
        split_replicated: bool = True,
    ) -> None:
        """``root`` is the fast local tier. With ``upload_uri`` (file://, s3://,
        gs://), every committed save is then copied there, COMMIT last, and old
        ones are pruned there too. ``durable_uri`` names ``root`` itself when it is
        already the durable store (a file:// checkpoint URI used directly)."""
        import torch.distributed as dist

        if keep < 2:
            raise ValueError("keep at least 2 complete checkpoints")
        self.root = Path(root)
        self.upload_uri = upload_uri
        self.durable_uri = durable_uri
        self.keep = keep
        self.use_async = use_async
        self.extra = dict(extra or {})
        self.on_commit = on_commit
        self.split_replicated = split_replicated
        """Each rank saves (and, async, copies) only its share of replicated state."""
        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if self._distributed else 0
        self._world = dist.get_world_size() if self._distributed else 1
        self._group = dist.new_group(backend="gloo") if (use_async and self._distributed) else None
        # What collectives use: the async group, or none at all outside torchrun.
        self._coll_group = self._group if self._distributed else _NO_GROUP
        self._local_rank = int(os.environ.get("LOCAL_RANK", self._rank))
        self._committed: list[int] = []
        self._thread: threading.Thread | None = None
        self._thread_step: int | None = None
        self._thread_error: BaseException | None = None
        self.last_blocking_s: float | None = None
        self.last_uploads: tuple[tuple[int, int, float], ...] = ()
        self.last_committed: Committed | None = None

    @property
    def in_flight(self) -> int | None:
        """The step of the save not yet committed, if any."""
        return self._thread_step if self._thread is not None else None

    def save(self, state_dict: dict, step: int, *, extra: dict | None = None) -> None:
        """Start (async) or do (sync) a save of ``state_dict`` as ``step_<step>``.
        ``extra`` adds to the manifest's free-form fields for this save only."""
        import time

        self.wait()
        extra = {**self.extra, **(extra or {})}
        t0 = time.perf_counter()
        if self._distributed and self.split_replicated:
            state_dict = split_replicated(state_dict, group=self._coll_group_or_none())
        if not self.use_async or (self._group is None and self._distributed):
            save_distributed(state_dict, self.root, step, extra=extra)
            self.last_blocking_s = time.perf_counter() - t0
            self._after_commit(step)
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
        self._thread_error = None
        self._thread_step = step
        self._thread = threading.Thread(
            target=self._finish_async,
            args=(step, future, extra),
            name=f"skyresume-ckpt-{step}",
            daemon=True,
        )
        self._thread.start()

    def _finish_async(self, step: int, future: object, extra: dict) -> None:
        try:
            future.result()  # type: ignore[attr-defined]
            _gather_and_commit(
                step_path(self.root, step), step, self._rank, self._world, self._coll_group, extra
            )
            self._after_commit(step)
        except BaseException as e:  # re-raised on the training thread by wait()
            self._thread_error = e

    def _after_commit(self, step: int) -> None:
        uploaded = self._upload(step)
        self._prune_local(step)
        self.last_committed = Committed(
            step, step_path(self.root, step), uploaded, self._world, self.last_blocking_s,
            self.last_uploads,
        )  # fmt: skip
        if self.on_commit is not None:
            self.on_commit(self.last_committed)

    def _prune_local(self, step: int) -> None:
        """Each rank deletes its own shards of saves older than the newest ``keep``
        this run committed (on a node without rank 0, no local directory ever gets
        a COMMIT, so ``prune`` alone would never free it); one rank per node then
        prunes whole directories by their COMMIT markers."""
        self._committed.append(step)
        for old in self._committed[: -self.keep]:
            drop_rank_shards(step_path(self.root, old), self._rank)
        del self._committed[: -self.keep]
        if self._local_rank == 0:
            prune(self.root, self.keep)

    def wait(self) -> int | None:
        """Finish the save in flight, if any; returns its step once committed.
        Raises what the background save raised (the save is then not committed)."""
        if self._thread is None:
            return None
        self._thread.join()
        step, error = self._thread_step, self._thread_error
        self._thread = self._thread_step = self._thread_error = None
        if error is not None:
            raise CheckpointError(f"save of step {step} failed: {error}") from error
        return step

    def _upload(self, step: int) -> str | None:
        """Copy a committed local save to ``upload_uri``: each rank its own shards
        (nodes share no disk), then rank 0 checks the listing against the manifest
        and writes manifest.json and, last, COMMIT, then prunes old remote ones.
        Any failure stops before COMMIT, so the remote copy is never taken for
        complete when it is not. Returns the remote step URI, or None if it failed
        (on every rank: the outcome is shared)."""
        if not self.upload_uri:
            if self.durable_uri:
                return f"{self.durable_uri.rstrip('/')}/{step_dir_name(step)}"
            return None
        import time

        import torch.distributed as dist

        from orchestrator.cloud.storage import StorageError, store_for_uri

        step_dir = step_path(self.root, step)
        failed = ""
        sent, t0 = 0, time.perf_counter()
        try:
            store, prefix = store_for_uri(self.upload_uri)
            key = "/".join(p for p in (prefix, step_dir.name) if p)
            names = [p.name for p in step_dir.glob(f"__{self._rank}_*.distcp")]
            if self._rank == 0:
                names.append(".metadata")
            for name in names:
                store.put_file(str(step_dir / name), f"{key}/{name}")
                sent += (step_dir / name).stat().st_size
        except (StorageError, OSError) as e:
            failed = f"rank {self._rank}: {e}"
        mine = (failed, sent, time.perf_counter() - t0)
        # Each rank's upload rate over its own node's link: what tells a slow link.
        self.last_uploads = ((self._rank, sent, mine[2]),)
        if self._distributed:
            gathered: list[tuple[str, int, float] | None] = [None] * self._world
            dist.all_gather_object(gathered, mine, group=self._coll_group_or_none())
            failed = "; ".join(g[0] for g in gathered if g and g[0])
            self.last_uploads = tuple(
                (r, int(g[1]), float(g[2])) for r, g in enumerate(gathered) if g
            )
        if not failed and self._rank == 0:
            try:
                self._publish(store, key, step_dir)
            except (StorageError, CheckpointError, OSError) as e:
                failed = str(e)
        if self._distributed:
            outcome: list[str | None] = [failed if self._rank == 0 else None]
            dist.broadcast_object_list(outcome, src=0, group=self._coll_group_or_none())
            failed = outcome[0] or ""
        target = f"{self.upload_uri.rstrip('/')}/{step_dir.name}"
        if failed:
            print(f"rank {self._rank}: upload of {target} failed: {failed}", file=sys.stderr)
            return None
        return target

    def _coll_group_or_none(self):
        return None if self._coll_group is _NO_GROUP else self._coll_group

    def _publish(self, store, key: str, step_dir: Path) -> None:
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
        assert self.upload_uri is not None
        for gone in prune_remote(self.upload_uri, self.keep):
            print(f"pruned {gone} from {self.upload_uri}", file=sys.stderr)

    def close(self) -> None:
        self.wait()
