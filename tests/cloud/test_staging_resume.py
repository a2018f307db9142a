"""Staging keeps each file the moment it verifies: a stage cut short resumes from the
files it finished, leaves no unverified bytes under a manifest name, and stops
fetching once something has failed. Hashing in flight gives the file's sha256 in
whatever order its ranges land. Local disk as the store (the same code path as S3
and GCS; test_seaweedfs.py and test_checkpoint_staging.py cover the real servers)."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from pathlib import Path

import pytest
from cloud_checkpoints import make_local_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cloud import storage
from orchestrator.cloud.storage import (
    LocalStore,
    StorageError,
    download_ranges,
    stage_checkpoint,
    upload_checkpoint,
)
from orchestrator.contract import COMMIT_NAME


class FailingOn:
    """A LocalStore whose ranged reads of one key always fail (a dead shard server)."""

    def __init__(self, real: LocalStore, bad_key_suffix: str, delay: float = 0.0) -> None:
        self.real = real
        self.bad = bad_key_suffix
        self.delay = delay
        self.reads: list[tuple[str, int]] = []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.real, name)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.reads.append((key, start))
        if key.endswith(self.bad):
            raise ConnectionResetError("connection reset by peer (injected)")
        time.sleep(self.delay)
        return self.real.get_range(key, start, length)


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    real = storage._retry
    monkeypatch.setattr(storage, "_retry", lambda fn, what, attempts, backoff: real(fn, what, 2, 0))


def test_stage_cut_short_keeps_verified_files_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_backoff: None
) -> None:
    content = {f"__{r}_0.distcp": os.urandom(30_000 + r) for r in range(4)}
    uri = f"file://{tmp_path / 'bucket'}"
    upload_checkpoint(str(make_local_checkpoint(tmp_path / "src", 100, content)), uri)
    real = LocalStore(str(tmp_path / "bucket"))
    failing = FailingOn(real, "__3_0.distcp")
    monkeypatch.setattr(storage, "store_for_uri", lambda u: (failing, ""))

    with pytest.raises(StorageError, match=r"__3_0\.distcp"):
        stage_checkpoint(uri, str(tmp_path / "stage"), workers=1, part_size=8_192)
    dest = tmp_path / "stage" / "step_100"
    assert not (dest / COMMIT_NAME).exists()
    assert sorted(p.name for p in dest.iterdir()) == [f"__{r}_0.distcp" for r in range(3)]
    for r in range(3):  # what is there under a manifest name is whole and right
        assert (dest / f"__{r}_0.distcp").read_bytes() == content[f"__{r}_0.distcp"]

    monkeypatch.setattr(storage, "store_for_uri", lambda u: (real, ""))
    again = stage_checkpoint(uri, str(tmp_path / "stage"), workers=1, part_size=8_192)
    assert again.step == 100
    assert again.downloaded_bytes == len(content["__3_0.distcp"])  # only the missing one
    assert (dest / COMMIT_NAME).exists()


def test_first_failure_stops_the_ranges_not_yet_started(tmp_path: Path, no_backoff: None) -> None:
    store = LocalStore(str(tmp_path / "bucket"))
    for name in ("a", "b", "c"):
        store.put_bytes(name, os.urandom(100_000))
    failing = FailingOn(store, "a", delay=0.001)
    jobs = [(n, str(tmp_path / "out" / n), 100_000) for n in ("a", "b", "c")]
    with pytest.raises(StorageError, match="a@0"):
        download_ranges(failing, jobs, workers=1, part_size=100)  # 3000 ranges, >= 3 s
    # 'a' at 0 twice (its retry), then at most what the one worker took before
    # the error reached the caller (a handful; 1,000 leaves room for a busy box).
    assert failing.reads[:2] == [("a", 0), ("a", 0)]
    assert len(failing.reads) < 1_000


def test_empty_files_stage_and_verify(tmp_path: Path) -> None:
    content = {"empty.bin": b"", "__0_0.distcp": os.urandom(5_000)}
    uri = f"file://{tmp_path / 'bucket'}"
    upload_checkpoint(str(make_local_checkpoint(tmp_path / "src", 7, content)), uri)
    staged = stage_checkpoint(uri, str(tmp_path / "stage"), workers=2, part_size=1_000)
    assert (Path(staged.path) / "empty.bin").read_bytes() == b""
    assert (Path(staged.path) / "__0_0.distcp").read_bytes() == content["__0_0.distcp"]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(min_value=1, max_value=5_000),
    part=st.integers(min_value=1, max_value=1_200),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_in_flight_hash_is_the_files_sha256_in_any_arrival_order(
    size: int, part: int, seed: int
) -> None:
    data = random.Random(seed).randbytes(size)
    ranges = [(off, data[off : off + part]) for off in range(0, size, part)]
    random.Random(seed + 1).shuffle(ranges)
    hasher = storage._InOrderHasher(size)
    digests: list[str] = []
    lock = threading.Lock()

    def feed(chunk: list[tuple[int, bytes]]) -> None:
        for off, piece in chunk:
            got = hasher.add(off, piece)
            if got is not None:
                with lock:
                    digests.append(got)

    threads = [threading.Thread(target=feed, args=(ranges[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert digests == [hashlib.sha256(data).hexdigest()]  # exactly once, and right
