"""A checkpoint counts only when COMMIT names its manifest and every file checks out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.contract import COMMIT_NAME, MANIFEST_NAME
from training.checkpoint import (
    CheckpointError,
    commit_checkpoint,
    drop_rank_shards,
    files_written_by_rank,
    find_latest_complete,
    prune,
    step_path,
    verify_checkpoint,
)


def _fake_save(root: Path, step: int, *, ranks: int = 2, commit: bool = True) -> Path:
    d = step_path(root, step)
    d.mkdir(parents=True)
    for r in range(ranks):
        (d / f"__{r}_0.distcp").write_bytes(os.urandom(1000 + r))
    (d / ".metadata").write_bytes(b"meta" * 10)
    if commit:
        files = [f for r in range(ranks) for f in files_written_by_rank(d, r)]
        commit_checkpoint(d, step=step, world_size=ranks, files=files)
    return d


def test_committed_checkpoint_verifies(tmp_path):
    d = _fake_save(tmp_path, 10)
    m = verify_checkpoint(d)
    assert (m.step, m.world_size) == (10, 2)
    assert {f.path for f in m.files} == {"__0_0.distcp", "__1_0.distcp", ".metadata"}


def _drop_commit(d: Path) -> str:
    (d / COMMIT_NAME).unlink()
    return "COMMIT: missing"


def _drop_shard(d: Path) -> str:
    (d / "__1_0.distcp").unlink()
    return "__1_0.distcp: missing shard"


def _truncate(d: Path) -> str:
    p = d / "__0_0.distcp"
    p.write_bytes(p.read_bytes()[:10])
    return "__0_0.distcp: 10 bytes, manifest says 1000"


def _flip_byte(d: Path) -> str:
    p = d / "__1_0.distcp"
    data = bytearray(p.read_bytes())
    data[5] ^= 0xFF
    p.write_bytes(bytes(data))
    return "__1_0.distcp: checksum mismatch"


def _torn_commit(d: Path) -> str:
    (d / COMMIT_NAME).write_bytes(b"sha256:" + b"0" * 64 + b"\n")
    return "does not match the manifest"


def _edit_manifest(d: Path) -> str:
    m = d / MANIFEST_NAME
    m.write_bytes(m.read_bytes().replace(b'"step": 20', b'"step": 21'))
    return "does not match the manifest"


DAMAGE = [_drop_commit, _drop_shard, _truncate, _flip_byte, _torn_commit, _edit_manifest]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.lstrip("_"))
def test_damaged_checkpoint_is_never_chosen_and_the_older_one_is_offered(tmp_path, damage):
    _fake_save(tmp_path, 10)
    newest = _fake_save(tmp_path, 20)
    reason = damage(newest)
    with pytest.raises(CheckpointError, match=reason):
        verify_checkpoint(newest)
    found = find_latest_complete(tmp_path)
    assert found is not None and found.manifest.step == 10
    assert found.rejected[0][0] == newest and reason in found.rejected[0][1]


def test_commit_without_dcp_metadata_is_refused(tmp_path):
    d = step_path(tmp_path, 5)
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"without DCP's \.metadata"):
        commit_checkpoint(d, step=5, world_size=1, files=files_written_by_rank(d, 0))
    assert not (d / COMMIT_NAME).exists()


def test_no_complete_checkpoint_means_none(tmp_path):
    _fake_save(tmp_path, 1, commit=False)
    assert find_latest_complete(tmp_path) is None
    assert find_latest_complete(tmp_path / "absent") is None


def test_prune_keeps_the_newest_k_complete_and_a_newer_partial(tmp_path):
    for s in (10, 20, 30, 40):
        _fake_save(tmp_path, s)
    _fake_save(tmp_path, 5, commit=False)  # stale partial, older than every complete one
    _fake_save(tmp_path, 50, commit=False)  # may be a save in flight
    deleted = prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step_10", "step_20", "step_5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_30", "step_40", "step_50"]
    with pytest.raises(ValueError):
        prune(tmp_path, keep=1)


def test_a_rank_dropping_its_shards_of_a_save_another_node_just_pruned_goes_on(
    tmp_path, monkeypatch
):
    """On a disk the nodes share, one node's rank 0 prunes step_10 while a rank of the
    other node lists step_10 for its own shards: the listing's directory is removed
    under it (here just before its scandir opens it), which once failed that rank's
    next save (seen in tests/e2e/test_service_stall_e2e.py: 'save of step 180 failed:
    No such file or directory: .../step_150')."""
    import shutil

    old = _fake_save(tmp_path, 10)
    real = os.scandir

    def pruned_meanwhile(path="."):
        if isinstance(path, (str, os.PathLike)) and Path(path) == old:
            shutil.rmtree(old)
        return real(path)

    monkeypatch.setattr(os, "scandir", pruned_meanwhile)
    drop_rank_shards(old, 1)  # raised FileNotFoundError before
    assert not old.exists()
    kept = _fake_save(tmp_path, 20)
    monkeypatch.setattr(os, "scandir", real)
    drop_rank_shards(kept, 1)
    assert sorted(p.name for p in kept.glob("__*")) == ["__0_0.distcp"]
