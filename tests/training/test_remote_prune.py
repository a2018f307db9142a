"""Old checkpoints leave the object store too, but never the newest complete one
and never one still being uploaded. On a directory and on a real S3 server (moto)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import torch

from orchestrator.cloud.storage import list_checkpoints, store_for_uri, upload_checkpoint
from orchestrator.contract import COMMIT_NAME
from training.checkpoint import Checkpointer, Committed, prune_remote


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(params=["file", "s3"])
def remote(request, tmp_path, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    if request.param == "file":
        return f"file://{tmp_path / 'bucket'}/run"
    import boto3

    endpoint = request.getfixturevalue("moto_endpoint")
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SKYRESUME_S3_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    bucket = "ckpt-" + secrets.token_hex(4)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


def _state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "step": torch.tensor(step)}


def test_uploads_keep_only_the_newest_k_complete_in_the_store(remote, tmp_path):
    committed: list[Committed] = []
    ckpt = Checkpointer(
        tmp_path / "local", keep=2, use_async=True, upload_uri=remote, on_commit=committed.append
    )
    for step in (2, 4, 6, 8):
        ckpt.save(_state(step), step)
    ckpt.close()
    assert [(c.step, c.uploaded_uri) for c in committed] == [
        (s, f"{remote}/step_{s}") for s in (2, 4, 6, 8)
    ]
    assert [(c.step, c.complete) for c in list_checkpoints(remote)] == [(6, True), (8, True)]
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step_6", "step_8"]


def test_a_partial_upload_newer_than_the_newest_complete_is_left_alone(remote, tmp_path):
    local = tmp_path / "local"
    ckpt = Checkpointer(local, keep=10, use_async=False)
    for step in (1, 2, 3, 4):
        ckpt.save(_state(step), step)
    for step in (1, 2, 3):
        upload_checkpoint(str(local / f"step_{step}"), remote)
    # step 4 is mid-upload: shards there, no COMMIT yet. step 0 is an abandoned partial.
    store, prefix = store_for_uri(remote)
    for step in (0, 4):
        for f in (local / "step_4").glob("*.distcp"):
            store.put_file(str(f), f"{prefix}/step_{step}/{f.name}".lstrip("/"))
    deleted = prune_remote(remote, keep=2)
    assert sorted(k.rsplit("/", 1)[-1] for k in deleted) == ["step_0", "step_1"]
    left = {c.step: c.complete for c in list_checkpoints(remote)}
    assert left == {2: True, 3: True, 4: False}
    assert prune_remote(remote, keep=2) == []
    with pytest.raises(ValueError, match="keep at least 2"):
        prune_remote(remote, keep=1)


def test_a_deleted_checkpoint_loses_its_commit_first(tmp_path, monkeypatch):
    # COMMIT goes before the shards, so a reader racing the prune sees a partial
    # checkpoint, never a complete-looking one with files missing.
    import orchestrator.cloud.storage as storage

    remote = f"file://{tmp_path / 'bucket'}"
    local = tmp_path / "local"
    ckpt = Checkpointer(local, keep=10, use_async=False)
    for step in (1, 2, 3):
        ckpt.save(_state(step), step)
        upload_checkpoint(str(local / f"step_{step}"), remote)
    store, _ = store_for_uri(remote)
    order: list[str] = []
    real_delete = store.delete

    def recording_delete(key: str) -> None:
        order.append(key.rsplit("/", 1)[-1])
        real_delete(key)

    monkeypatch.setattr(store, "delete", recording_delete)
    monkeypatch.setattr(storage, "store_for_uri", lambda uri: (store, ""))
    prune_remote(remote, keep=2)
    assert order[:2] == [COMMIT_NAME, "manifest.json"] and len(order) >= 4
    assert not (tmp_path / "bucket" / "step_1" / COMMIT_NAME).exists()
