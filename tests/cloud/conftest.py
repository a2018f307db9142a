"""Real servers on loopback for the cloud adapters: the metadata simulator, moto's
S3 server and gcp-storage-emulator. Each is started by a fixture and stopped after;
boto3 and google-cloud-storage reach them over HTTP (no mocked clients)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from orchestrator.cloud.simulator import MetadataSimulator


@pytest.fixture
def sim() -> Iterator[MetadataSimulator]:
    with MetadataSimulator() as s:
        yield s


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    from gcp_storage_emulator.server import create_server

    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    port = server._api._httpd.server_address[1]
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_env(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Environment for boto3 to reach moto; returns a fresh, empty bucket's name."""
    import boto3

    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SKYRESUME_S3_ENDPOINT_URL": moto_endpoint,
    }.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    bucket = "ckpt-" + secrets.token_hex(4)
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket
    )
    return bucket


@pytest.fixture
def gcs_env(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Environment for google-cloud-storage to reach the emulator; a fresh bucket."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    bucket = "ckpt-" + secrets.token_hex(4)
    storage.Client(project="t", credentials=AnonymousCredentials()).create_bucket(bucket)
    return bucket


@pytest.fixture(params=["file", "s3", "gs"])
def store_uri(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A checkpoint root URI on each backend, backed by a real server."""
    if request.param == "file":
        return f"file://{tmp_path / 'bucket'}/run1"
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_env')}/run1"
    return f"gs://{request.getfixturevalue('gcs_env')}/run1"
