"""Object storage behind one protocol: local disk (file://), S3 (boto3), GCS.

Chosen by URI scheme with :func:`store_for_uri`. Keys are ``/``-separated and
relative to the store's root; a store never logs credentials. SDKs are imported
inside the adapters so that importing this module stays cheap (the training
library and the CLI import it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI/key and the reason."""


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
            raise StorageError(f"{self.root}/{key}: no such object")
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
            raise StorageError(f"{self.root}/{key}: no such object") from None

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


def store_for_uri(uri: str) -> tuple[ObjectStore, str]:
    """The store for a URI and the key prefix inside it (no trailing slash)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"{uri}: file:// URIs must be absolute paths (file:///path)")
        return LocalStore(parsed.path), ""
    if parsed.scheme == "" and uri.startswith("/"):
        return LocalStore(uri), ""
    raise StorageError(f"{uri}: unsupported scheme {parsed.scheme!r} (use file://, s3:// or gs://)")
