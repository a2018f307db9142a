"""Checkpoint listing, upload and staging on every backend, with the faults that matter:
corrupt and truncated objects, missing shards, a server that drops mid-transfer."""

from __future__ import annotations

from pathlib import Path

import pytest

# tests/cloud is on sys.path (pytest prepends a test file's folder; tests/ has no packages).
from cloud_checkpoints import make_local_checkpoint, shards

from orchestrator.cloud import storage
from orchestrator.cloud.storage import (
    StorageError,
    list_checkpoints,
    stage_checkpoint,
    store_for_uri,
    upload_checkpoint,
)
from orchestrator.contract import COMMIT_NAME, MANIFEST_NAME, check_commit


def key_of(uri: str, rel: str) -> str:
    _, prefix = store_for_uri(uri)
    return f"{prefix}/{rel}" if prefix else rel


def test_newest_complete_checkpoint_is_staged_and_verified(store_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for step in (100, 200):
        upload_checkpoint(str(make_local_checkpoint(src, step, shards(step))), store_uri)
    staged = stage_checkpoint(store_uri, str(tmp_path / "stage"), workers=4, part_size=16_384)
    assert staged.step == 200
    dest = Path(staged.path)
    for rel in shards(0):
        assert (dest / rel).read_bytes() == (src / "step_200" / rel).read_bytes()
    check_commit((dest / COMMIT_NAME).read_bytes(), (dest / MANIFEST_NAME).read_bytes())


def test_partial_checkpoint_is_never_staged(store_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    upload_checkpoint(str(make_local_checkpoint(src, 100, shards(1))), store_uri)
    store, _ = store_for_uri(store_uri)
    # step 300: shards and manifest but no COMMIT, as after a crash mid-save
    d = make_local_checkpoint(src, 300, shards(3))
    for p in d.iterdir():
        store.put_file(str(p), key_of(store_uri, f"step_300/{p.name}"))
    listed = {c.step: c for c in list_checkpoints(store_uri)}
    assert listed[100].complete
    assert not listed[300].complete and listed[300].reason == "no COMMIT"
    assert stage_checkpoint(store_uri, str(tmp_path / "stage")).step == 100


def test_corrupt_object_falls_back_to_the_next_newest(store_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for step in (100, 200):
        upload_checkpoint(str(make_local_checkpoint(src, step, shards(step))), store_uri)
    store, _ = store_for_uri(store_uri)
    # Same size, different bytes: only the checksum can tell.
    store.put_bytes(key_of(store_uri, "step_200/__1_0.distcp"), b"\0" * 50_000)
    staged = stage_checkpoint(store_uri, str(tmp_path / "stage"))
    assert staged.step == 100
    (skip,) = [s for s in staged.skipped if s.step == 200]
    assert "__1_0.distcp" in skip.reason and "sha256" in skip.reason


def test_truncated_object_makes_a_checkpoint_incomplete(store_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    upload_checkpoint(str(make_local_checkpoint(src, 100, shards(1))), store_uri)
    store, _ = store_for_uri(store_uri)
    store.put_bytes(key_of(store_uri, "step_100/__0_0.distcp"), b"short")
    (info,) = list_checkpoints(store_uri)
    assert not info.complete
    assert "__0_0.distcp" in info.reason
    with pytest.raises(StorageError, match="no complete checkpoint"):
        stage_checkpoint(store_uri, str(tmp_path / "stage"))


def test_restaging_skips_verified_files(store_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    upload_checkpoint(str(make_local_checkpoint(src, 100, shards(1))), store_uri)
    first = stage_checkpoint(store_uri, str(tmp_path / "stage"))
    assert first.downloaded_bytes == first.bytes
    # Damage one local file: only that one is fetched again.
    (Path(first.path) / "__2_0.distcp").write_bytes(b"x")
    second = stage_checkpoint(store_uri, str(tmp_path / "stage"))
    assert second.downloaded_bytes == 50_000
    assert (Path(second.path) / "__2_0.distcp").read_bytes() == (
        src / "step_100" / "__2_0.distcp"
    ).read_bytes()


def test_dropped_ranges_are_retried_and_the_file_completes(
    store_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that drops connections mid-transfer: every third range read fails
    once; each failed range is re-fetched alone and the result still verifies."""
    src = tmp_path / "src"
    upload_checkpoint(str(make_local_checkpoint(src, 100, shards(1))), store_uri)
    real_store, prefix = store_for_uri(store_uri)
    calls = {"n": 0}

    class Dropping:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(real_store, name)

        def get_range(self, key: str, start: int, length: int) -> bytes:
            calls["n"] += 1
            if calls["n"] % 3 == 0:
                raise ConnectionResetError("connection reset by peer (injected)")
            return real_store.get_range(key, start, length)

    monkeypatch.setattr(storage, "store_for_uri", lambda uri: (Dropping(), prefix))
    monkeypatch.setattr(storage, "_retry", _fast_retry(storage._retry))
    staged = stage_checkpoint(store_uri, str(tmp_path / "stage"), workers=2, part_size=10_000)
    assert staged.step == 100
    assert calls["n"] > 15  # 15 ranges plus the retried ones
    for rel in shards(0):
        assert (Path(staged.path) / rel).read_bytes() == (src / "step_100" / rel).read_bytes()


def _fast_retry(real):  # type: ignore[no-untyped-def]
    return lambda fn, what, attempts, backoff: real(fn, what, attempts, 0.0)


def test_upload_never_commits_without_every_shard(store_uri: str, tmp_path: Path) -> None:
    d = make_local_checkpoint(tmp_path / "src", 100, shards(1))
    (d / "__1_0.distcp").unlink()
    with pytest.raises(StorageError, match=r"__1_0\.distcp"):
        upload_checkpoint(str(d), store_uri)
    store, _ = store_for_uri(store_uri)
    assert not store.exists(key_of(store_uri, f"step_100/{COMMIT_NAME}"))


def test_empty_root_has_no_checkpoints_and_stage_says_so(store_uri: str, tmp_path: Path) -> None:
    assert list_checkpoints(store_uri) == []
    with pytest.raises(StorageError, match="no complete checkpoint"):
        stage_checkpoint(store_uri, str(tmp_path / "stage"))
