"""Builders of small, valid checkpoints on local disk for the cloud tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from orchestrator.contract import MANIFEST_NAME, Manifest, ManifestFile


def make_local_checkpoint(root: Path, step: int, files: dict[str, bytes]) -> Path:
    d = root / f"step_{step}"
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    m = Manifest(
        step,
        len(files),
        "2026-12-01T00:00:00+00:00",
        tuple(
            ManifestFile(rel, len(data), hashlib.sha256(data).hexdigest())
            for rel, data in sorted(files.items())
        ),
    )
    (d / MANIFEST_NAME).write_bytes(m.to_json())
    return d


def shards(seed: int, n: int = 3, size: int = 50_000) -> dict[str, bytes]:
    out = {f"__{r}_0.distcp": os.urandom(size) for r in range(n)}
    out[".metadata"] = f"meta-{seed}".encode()
    return out
