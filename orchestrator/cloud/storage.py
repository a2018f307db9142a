"""Object storage behind one protocol: local disk (file://), S3 (boto3), GCS.

Chosen by URI scheme with :func:`store_for_uri`. Keys are ``/``-separated and
relative to the store's root; a store never logs credentials. SDKs are imported
inside the adapters so that importing this module stays cheap (the training
library and the CLI import it).

Staging (:func:`stage_checkpoint`) is the read path of a recovery: it picks the
newest checkpoint whose COMMIT names its manifest, splits every manifest file into
ranges, fetches them on a thread pool (each range retried on its own, so a server
that drops mid-transfer costs one range, not the file) and hashes each file while
its ranges land, in order. A file is renamed to its manifest name the moment its
size and sha256 match, so only verified bytes ever carry a manifest name: files
already on disk that verify are skipped, and an interrupted stage resumes from the
files it finished. A checkpoint with a corrupt or missing object is skipped with
the reason and the next-newest complete one is tried: resuming older beats not
resuming, and never resuming garbage.

Where the time goes (bench/staging.py, BENCHMARKS.md): against a local server on
few cores every byte costs CPU three times (receive, sha256, write), and sha256
costs about as much as receiving; parallel ranges win where one connection is
limited by the network, as on S3 and GCS.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from orchestrator.contract import (
    COMMIT_NAME,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    check_commit,
    commit_marker,
    manifest_digest,
    parse_step_dir,
)


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI/key and the reason."""


class ChecksumError(StorageError):
    """An object's size or sha256 differs from its manifest entry (names the file)."""


class NotFoundError(StorageError):
    """No such object (or bucket); never retried."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class ObjectStore(Protocol):
    """What checkpoints need from a bucket or a directory."""

    def put_file(self, local_path: str, key: str) -> None: ...
    def get_file(self, key: str, local_path: str) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def list(self, prefix: str = "") -> list[ObjectInfo]: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of the object from ``start`` (fewer only at its end)."""
        ...


class LocalStore:
    """A directory as an object store. Writes go to a temp name and are renamed,
    so a reader never sees a half-written object."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        key = key.lstrip("/")
        if ".." in key.split("/"):
            raise StorageError(f"unsafe key {key!r}")
        return self.root / key

    def put_file(self, local_path: str, key: str) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, dest)

    def get_file(self, key: str, local_path: str) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFoundError(f"{self.root}/{key}: no such object")
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{local_path}.partial-{os.getpid()}"
        shutil.copyfile(src, tmp)
        os.replace(tmp, local_path)

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, dest)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"{self.root}/{key}: no such object") from None

    def _walk(self, base: Path) -> Iterator[Path]:
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if ".partial-" not in f:
                    yield Path(dirpath) / f

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        if not self.root.exists():
            return []
        out = []
        for p in self._walk(self.root):
            key = p.relative_to(self.root).as_posix()
            if key.startswith(prefix):
                out.append(ObjectInfo(key, p.stat().st_size))
        return sorted(out, key=lambda o: o.key)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with self._path(key).open("rb") as f:
                f.seek(start)
                return f.read(length)
        except FileNotFoundError:
            raise NotFoundError(f"{self.root}/{key}: no such object") from None


def _s3_endpoint() -> str | None:
    return os.environ.get("SKYRESUME_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")


# What boto3's credential chain reads from the environment. A botocore session
# resolves credentials once and keeps them, so one shared session would keep using
# the first keys it saw after the environment changed (another endpoint, rotated
# static keys); one session per distinct setting, each built once (a session costs
# ~100 ms of loading service models).
_CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
_sessions: dict[tuple[str | None, ...], Any] = {}
_sessions_lock = threading.Lock()


def _s3_client(**kwargs: Any) -> Any:
    """An S3 client from the session for the current credential environment. Made
    under a lock: boto3 sessions are not thread-safe (their clients are)."""
    import boto3.session

    env = tuple(os.environ.get(k) for k in _CREDENTIAL_ENV)
    with _sessions_lock:
        if env not in _sessions:
            _sessions[env] = boto3.session.Session()
        return _sessions[env].client("s3", **kwargs)


class S3Store:
    """An S3 bucket through boto3 (any S3-compatible server via the endpoint URL).

    Credentials come from boto3's own chain; they never appear in a message here.
    """

    def __init__(self, bucket: str, endpoint_url: str | None = None, max_pool: int = 64) -> None:
        from botocore.config import Config

        self.bucket = bucket
        self.endpoint_url = endpoint_url or _s3_endpoint()
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.client = _s3_client(
            endpoint_url=self.endpoint_url,
            region_name=region,
            config=Config(
                retries={"max_attempts": 5, "mode": "standard"},
                max_pool_connections=max_pool,
                connect_timeout=5,
                read_timeout=60,
            ),
        )

    def _name(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _error(self, e: Exception, key: str) -> StorageError:
        from botocore.exceptions import ClientError

        if isinstance(e, ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                return NotFoundError(f"s3://{self.bucket}: no such bucket")
            if code in ("NoSuchKey", "404", "NotFound"):
                return NotFoundError(f"{self._name(key)}: no such object")
            return StorageError(f"{self._name(key)}: {code or 'error'}")
        return StorageError(f"{self._name(key)}: {type(e).__name__}: {e}")

    def _call(self, key: str, fn: Callable[..., Any], **kw: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as e:
            raise self._error(e, key) from None

    def put_file(self, local_path: str, key: str) -> None:
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=16 << 20)
        try:
            self.client.upload_file(local_path, self.bucket, key, Config=cfg)
        except Exception as e:
            raise self._error(e, key) from None

    def get_file(self, key: str, local_path: str) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{local_path}.partial-{os.getpid()}"
        try:
            self.client.download_file(self.bucket, key, tmp)
        except Exception as e:
            Path(tmp).unlink(missing_ok=True)
            raise self._error(e, key) from None
        os.replace(tmp, local_path)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(key, self.client.put_object, Key=key, Body=data)

    def get_bytes(self, key: str) -> bytes:
        r = self._call(key, self.client.get_object, Key=key)
        return bytes(r["Body"].read())

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        rng = f"bytes={start}-{start + length - 1}"
        r = self._call(key, self.client.get_object, Key=key, Range=rng)
        return bytes(r["Body"].read())

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                out.extend(ObjectInfo(o["Key"], int(o["Size"])) for o in page.get("Contents", []))
        except Exception as e:
            raise self._error(e, prefix) from None
        return sorted(out, key=lambda o: o.key)

    def exists(self, key: str) -> bool:
        try:
            self._call(key, self.client.head_object, Key=key)
        except NotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        self._call(key, self.client.delete_object, Key=key)


class GCSStore:
    """A GCS bucket through google-cloud-storage.

    With ``STORAGE_EMULATOR_HOST`` set (an emulator), the client uses anonymous
    credentials; otherwise Google's default credential chain.
    """

    def __init__(self, bucket: str) -> None:
        from google.cloud import storage

        if os.environ.get("STORAGE_EMULATOR_HOST"):
            from google.auth.credentials import AnonymousCredentials

            self.client = storage.Client(
                project=os.environ.get("GOOGLE_CLOUD_PROJECT", "skyresume-local"),
                credentials=AnonymousCredentials(),
            )
        else:
            self.client = storage.Client()
        self.bucket_name = bucket
        self.bucket = self.client.bucket(bucket)

    def _name(self, key: str) -> str:
        return f"gs://{self.bucket_name}/{key}"

    def _error(self, e: Exception, key: str) -> StorageError:
        from google.api_core import exceptions as gexc

        if isinstance(e, gexc.NotFound):
            msg = str(getattr(e, "message", "") or e).lower()
            if "bucket" in msg and "object" not in msg:
                return NotFoundError(f"gs://{self.bucket_name}: no such bucket")
            return NotFoundError(f"{self._name(key)}: no such object")
        if isinstance(e, gexc.GoogleAPICallError):
            return StorageError(f"{self._name(key)}: HTTP {e.code}")
        return StorageError(f"{self._name(key)}: {type(e).__name__}: {e}")

    def _do(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except StorageError:
            raise
        except Exception as e:
            raise self._error(e, key) from None

    def put_file(self, local_path: str, key: str) -> None:
        self._do(key, lambda: self.bucket.blob(key).upload_from_filename(local_path))

    def get_file(self, key: str, local_path: str) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{local_path}.partial-{os.getpid()}"
        try:
            self._do(key, lambda: self.bucket.blob(key).download_to_filename(tmp, checksum=None))
        except StorageError:
            Path(tmp).unlink(missing_ok=True)
            raise
        os.replace(tmp, local_path)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._do(key, lambda: self.bucket.blob(key).upload_from_string(data))

    def get_bytes(self, key: str) -> bytes:
        return bytes(self._do(key, lambda: self.bucket.blob(key).download_as_bytes(checksum=None)))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        # ``end`` is inclusive in google-cloud-storage; the checksum is skipped
        # because a range has none; the manifest's sha256 covers the whole file.
        blob = self.bucket.blob(key)
        return bytes(
            self._do(
                key,
                lambda: blob.download_as_bytes(start=start, end=start + length - 1, checksum=None),
            )
        )

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        def go() -> list[ObjectInfo]:
            blobs = self.client.list_blobs(self.bucket_name, prefix=prefix or None)
            return [ObjectInfo(b.name, int(b.size or 0)) for b in blobs]

        return sorted(self._do(prefix, go), key=lambda o: o.key)

    def exists(self, key: str) -> bool:
        if not self._do(key, self.bucket.exists):
            raise NotFoundError(f"gs://{self.bucket_name}: no such bucket")
        return bool(self._do(key, self.bucket.blob(key).exists))

    def delete(self, key: str) -> None:
        # Deleting what is already gone is success (idempotent cleanup).
        with contextlib.suppress(NotFoundError):
            self._do(key, self.bucket.blob(key).delete)


def store_for_uri(uri: str) -> tuple[ObjectStore, str]:
    """The store for a URI and the key prefix inside it (no trailing slash)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"{uri}: file:// URIs must be absolute paths (file:///path)")
        return LocalStore(parsed.path), ""
    if parsed.scheme == "" and uri.startswith("/"):
        return LocalStore(uri), ""
    if parsed.scheme in ("s3", "gs"):
        bucket = parsed.netloc
        # Bucket names: 3-63 chars of lowercase letters, digits, dots, dashes (both clouds).
        ok = 3 <= len(bucket) <= 63 and all(
            c.islower() or c.isdigit() or c in ".-_" for c in bucket
        )
        if not ok:
            raise StorageError(f"{uri}: {bucket!r} is not a valid bucket name")
        prefix = parsed.path.strip("/")
        if ".." in prefix.split("/"):
            raise StorageError(f"{uri}: '..' is not allowed in an object prefix")
        store: ObjectStore = S3Store(bucket) if parsed.scheme == "s3" else GCSStore(bucket)
        return store, prefix
    raise StorageError(f"{uri}: unsupported scheme {parsed.scheme!r} (use file://, s3:// or gs://)")


# --- checksums and parallel transfers -------------------------------------------------


def file_sha256(path: str, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# Retries around each range or shard, on top of the SDK's own (botocore retries a
# refused connection within ~3 s). Together they ride out a storage endpoint that
# restarts or a network that drops for up to ~20 s: 0.5 + 1 + 2 + 4 + 8 s of waits.
RETRY_ATTEMPTS = 6
RETRY_BACKOFF_S = 0.5


def _retry(fn: Callable[[], Any], what: str, attempts: int, backoff: float) -> Any:
    """Retry transient failures; a missing object or bucket is final at once.

    Waits ``backoff * 2**i``, each stretched by up to a half at random, so ranges
    that failed together do not all come back at the same instant."""
    for i in range(attempts):
        try:
            return fn()
        except NotFoundError:
            raise
        except Exception as e:
            if i == attempts - 1:
                if isinstance(e, StorageError):
                    raise
                raise StorageError(f"{what}: {type(e).__name__}: {e}") from None
            time.sleep(backoff * (2**i) * (1 + random.random() / 2))
    raise AssertionError("unreachable")


class _InOrderHasher:
    """sha256 of a file whose ranges land in any order: each range is fed as soon as
    every byte before it has been fed, so the file is never read back to verify it.

    Ranges waiting for an earlier one are held in memory. The pool takes ranges in
    file order, so an earlier range is always already in flight: at most about
    ``workers`` ranges wait at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._h = hashlib.sha256()
        self._next = 0
        self._waiting: dict[int, bytes] = {}
        self._feeding = False
        self._lock = threading.Lock()

    def add(self, off: int, data: bytes) -> str | None:
        """Feed a range; the hex digest once the whole file has been fed, else None.
        Exactly one call returns the digest."""
        with self._lock:
            self._waiting[off] = data
            if self._feeding:
                return None  # the thread that is feeding picks this one up
            self._feeding = True
        while True:
            with self._lock:
                chunk = self._waiting.pop(self._next, None)
                if chunk is None:
                    self._feeding = False
                    return None
                self._next += len(chunk)
                last = self._next >= self.size
            self._h.update(chunk)  # outside the lock: hashlib lets go of the GIL
            if last:
                return self._h.hexdigest()


def download_ranges(
    store: ObjectStore,
    jobs: list[tuple[str, str, int]],
    *,
    workers: int = 16,
    part_size: int = 16 << 20,
    attempts: int = RETRY_ATTEMPTS,
    backoff: float = RETRY_BACKOFF_S,
    on_bytes: Callable[[int], None] | None = None,
    on_file: Callable[[str, str], None] | None = None,
) -> None:
    """Download ``(key, local_path, size)`` objects, splitting each into ranges that
    run in parallel and land in place with ``os.pwrite``. Each range is retried on
    its own, so a dropped connection re-fetches one range, not the file.

    Every file is hashed while it downloads; ``on_file(local_path, sha256)`` runs
    (on a worker thread) as soon as a file is complete and closed, so a caller can
    verify and keep it before the rest finish: an interrupted transfer keeps what
    it verified. The first error stops the ranges not yet started and is raised."""
    if workers < 1 or part_size < 1:
        raise ValueError(f"workers ({workers}) and part_size ({part_size}) must be >= 1")
    fds: dict[str, int] = {}
    tasks: list[tuple[str, str, _InOrderHasher, int, int]] = []
    fds_lock = threading.Lock()

    def finish(path: str, digest: str) -> None:
        with fds_lock:
            fd = fds.pop(path)
        os.close(fd)
        if on_file:
            on_file(path, digest)

    try:
        empty = []
        for key, path, size in jobs:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fds[path] = fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, size)
            if size == 0:
                empty.append(path)
                continue
            hasher = _InOrderHasher(size)
            tasks.extend(
                (key, path, hasher, off, min(part_size, size - off))
                for off in range(0, size, part_size)
            )
        for path in empty:
            finish(path, hashlib.sha256(b"").hexdigest())

        def fetch(task: tuple[str, str, _InOrderHasher, int, int]) -> None:
            key, path, hasher, off, length = task
            data = _retry(
                lambda: store.get_range(key, off, length), f"{key}@{off}", attempts, backoff
            )
            if len(data) != length:
                raise ChecksumError(f"{key}: short read at {off} ({len(data)} of {length} bytes)")
            os.pwrite(fds[path], data, off)
            if on_bytes:
                on_bytes(length)
            digest = hasher.add(off, data)
            if digest is not None:
                finish(path, digest)

        pool = ThreadPoolExecutor(max_workers=workers)
        try:
            for fut in [pool.submit(fetch, t) for t in tasks]:
                fut.result()
        finally:
            # On an error, drop the queued ranges instead of fetching them all first.
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        for fd in fds.values():
            os.close(fd)


# --- checkpoints ----------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    key: str
    """The step directory's key prefix in the store."""
    complete: bool
    reason: str
    """Why it is not complete ('' when it is)."""
    files: int
    size: int
    digest: str = ""
    """The manifest's digest (what the COMMIT names) when complete: a step saved again
    is another checkpoint with the same step number."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "key": self.key,
            "complete": self.complete,
            "reason": self.reason,
            "files": self.files,
            "size": self.size,
            "digest": self.digest,
        }


@dataclass
class StagedCheckpoint:
    step: int
    path: str
    files: int
    bytes: int
    downloaded_bytes: int
    skipped: list[CheckpointInfo] = field(default_factory=list)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _inspect(
    store: ObjectStore, step: int, key: str, objs: dict[str, int]
) -> tuple[CheckpointInfo, Manifest | None, bytes]:
    size, count = sum(objs.values()), len(objs)

    def bad(reason: str) -> tuple[CheckpointInfo, None, bytes]:
        return CheckpointInfo(step, key, False, reason, count, size), None, b""

    if MANIFEST_NAME not in objs:
        return bad("no manifest")
    if COMMIT_NAME not in objs:
        return bad("no COMMIT")
    try:
        mbytes = store.get_bytes(_join(key, MANIFEST_NAME))
        check_commit(
            store.get_bytes(_join(key, COMMIT_NAME)), mbytes, source=_join(key, COMMIT_NAME)
        )
        manifest = Manifest.from_json(mbytes, source=_join(key, MANIFEST_NAME))
    except (ManifestError, StorageError) as e:
        return bad(str(e))
    if manifest.step != step:
        return bad(f"manifest says step {manifest.step}")
    for f in manifest.files:
        if f.path not in objs:
            return bad(f"missing {f.path}")
        if objs[f.path] != f.size:
            return bad(f"{f.path}: size {objs[f.path]}, manifest says {f.size}")
    info = CheckpointInfo(step, key, True, "", count, size, manifest_digest(mbytes))
    return info, manifest, mbytes


def _scan(uri: str) -> tuple[ObjectStore, list[tuple[CheckpointInfo, Manifest | None, bytes]]]:
    store, prefix = store_for_uri(uri)
    groups: dict[str, dict[str, int]] = {}
    for o in store.list(_join(prefix, "")):
        rel = o.key[len(prefix) + 1 :] if prefix else o.key
        top, _, rest = rel.partition("/")
        if rest and parse_step_dir(top) is not None:
            groups.setdefault(top, {})[rest] = o.size
    found = [
        _inspect(store, parse_step_dir(top) or 0, _join(prefix, top), objs)
        for top, objs in groups.items()
    ]
    return store, sorted(found, key=lambda f: f[0].step)


def list_checkpoints(uri: str) -> list[CheckpointInfo]:
    """Every ``step_<N>`` under ``uri``, oldest first, complete or not (with why not)."""
    return [info for info, _, _ in _scan(uri)[1]]


def _verified(path: Path, size: int, sha256: str) -> bool:
    return path.is_file() and path.stat().st_size == size and file_sha256(str(path)) == sha256


def _stage_one(
    store: ObjectStore,
    info: CheckpointInfo,
    manifest: Manifest,
    mbytes: bytes,
    dest: Path,
    workers: int,
    part_size: int,
    on_bytes: Callable[[int], None],
) -> int:
    """Stage one checkpoint into ``dest``; returns bytes downloaded.

    Each file lands as ``<name>.partial`` and is renamed to its name only once its
    sha256 matches the manifest, so whatever sits under a manifest name has been
    verified, and a stage cut short resumes from the files it finished."""
    dest.mkdir(parents=True, exist_ok=True)
    # A stale COMMIT from an earlier stage must not vouch for files about to change.
    (dest / COMMIT_NAME).unlink(missing_ok=True)
    todo = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        ok = list(pool.map(lambda f: _verified(dest / f.path, f.size, f.sha256), manifest.files))
    for f, good in zip(manifest.files, ok):  # map: one result per file, in order
        if good:
            on_bytes(f.size)
        else:
            todo.append(f)
    by_partial = {str(dest / f"{f.path}.partial"): f for f in todo}

    def verify(partial: str, got: str) -> None:
        f = by_partial[partial]
        if got != f.sha256:
            raise ChecksumError(
                f"{_join(info.key, f.path)}: sha256 {got[:12]}..., manifest says {f.sha256[:12]}..."
            )
        os.replace(partial, dest / f.path)

    try:
        download_ranges(
            store,
            [(_join(info.key, f.path), p, f.size) for p, f in by_partial.items()],
            workers=workers,
            part_size=part_size,
            on_bytes=on_bytes,
            on_file=verify,
        )
    finally:
        # Unverified bytes never stay behind (a bad file, or one cut off mid-way).
        for p in by_partial:
            Path(p).unlink(missing_ok=True)
    (dest / MANIFEST_NAME).write_bytes(mbytes)
    (dest / COMMIT_NAME).write_bytes(commit_marker(mbytes))
    return sum(f.size for f in todo)


def stage_checkpoint(
    uri: str,
    local_dir: str,
    *,
    workers: int = 16,
    part_size: int = 16 << 20,
    on_progress: Callable[[int, int], None] | None = None,
    at_most: int | None = None,
) -> StagedCheckpoint:
    """Download the newest complete checkpoint under ``uri`` into ``local_dir/step_<N>``
    (with ``at_most``, the newest at or before that step: a rollback past an anomaly).

    Verified local files are kept (resume). A checkpoint whose objects fail their
    checksum is skipped and the next-newest complete one is tried; StorageError
    when none can be staged, naming each checkpoint and why.
    """
    store, found = _scan(uri)
    if at_most is not None:
        found = [f for f in found if f[0].step <= at_most]
    candidates = [f for f in reversed(found) if f[0].complete]
    skipped = [info for info, _, _ in reversed(found) if not info.complete]
    lock = threading.Lock()
    for info, manifest, mbytes in candidates:
        assert manifest is not None
        total = sum(f.size for f in manifest.files)
        done = [0]

        def on_bytes(n: int, total: int = total, done: list[int] = done) -> None:
            with lock:
                done[0] += n
                if on_progress:
                    on_progress(done[0], total)

        dest = Path(local_dir) / Path(info.key).name
        try:
            got = _stage_one(store, info, manifest, mbytes, dest, workers, part_size, on_bytes)
        except ChecksumError as e:
            skipped.append(
                CheckpointInfo(info.step, info.key, False, str(e), info.files, info.size)
            )
            continue
        except NotFoundError as e:
            # Deleted between listing and download (retention pruning): try the next.
            skipped.append(
                CheckpointInfo(info.step, info.key, False, str(e), info.files, info.size)
            )
            continue
        return StagedCheckpoint(info.step, str(dest), len(manifest.files), total, got, skipped)
    why = "; ".join(f"step {s.step}: {s.reason}" for s in skipped) or "nothing under it"
    raise StorageError(f"{uri}: no complete checkpoint could be staged ({why})")


def upload_checkpoint(local_step_dir: str, uri: str, *, workers: int = 16) -> CheckpointInfo:
    """Upload a local ``step_<N>`` directory (with its manifest) to ``uri/step_<N>``.

    Shards go first, in parallel, each retried; then the listing is checked against
    the manifest; then manifest.json; COMMIT last. A failure anywhere raises before
    COMMIT, so a half-uploaded checkpoint is never taken for a complete one.
    """
    src = Path(local_step_dir)
    step = parse_step_dir(src.name)
    if step is None:
        raise StorageError(f"{local_step_dir}: not a step_<N> directory")
    try:
        mbytes = (src / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise StorageError(f"{local_step_dir}: no {MANIFEST_NAME}") from None
    try:
        manifest = Manifest.from_json(mbytes, source=str(src / MANIFEST_NAME))
    except ManifestError as e:
        raise StorageError(str(e)) from None
    store, prefix = store_for_uri(uri)
    key = _join(prefix, src.name)

    def put(f: Any) -> None:
        path = src / f.path
        if not path.is_file() or path.stat().st_size != f.size:
            raise StorageError(f"{path}: missing or not {f.size} bytes as the manifest says")
        _retry(
            lambda: store.put_file(str(path), _join(key, f.path)),
            str(path),
            RETRY_ATTEMPTS,
            RETRY_BACKOFF_S,
        )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for fut in [pool.submit(put, f) for f in manifest.files]:
            fut.result()
    listed = {o.key: o.size for o in store.list(_join(key, ""))}
    for f in manifest.files:
        if listed.get(_join(key, f.path)) != f.size:
            raise StorageError(f"{_join(key, f.path)}: not in the store after upload")
    store.put_bytes(_join(key, MANIFEST_NAME), mbytes)
    store.put_bytes(_join(key, COMMIT_NAME), commit_marker(mbytes))
    size = sum(f.size for f in manifest.files)
    return CheckpointInfo(step, key, True, "", len(manifest.files) + 2, size)
