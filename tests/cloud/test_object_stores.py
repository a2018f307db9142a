"""Each ObjectStore against its real server (moto S3, gcp-storage-emulator, a directory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.cloud.storage import (
    NotFoundError,
    StorageError,
    download_ranges,
    file_sha256,
    store_for_uri,
)


def test_store_round_trips_bytes_files_and_listing(store_uri: str, tmp_path: Path) -> None:
    store, prefix = store_for_uri(store_uri)
    assert prefix in ("run1", "")
    base = f"{prefix}/" if prefix else ""
    store.put_bytes(base + "a/x.bin", b"hello")
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    store.put_file(str(src), base + "a/y.bin")
    assert store.get_bytes(base + "a/x.bin") == b"hello"
    out = tmp_path / "out" / "y.bin"
    store.get_file(base + "a/y.bin", str(out))
    assert out.read_bytes() == src.read_bytes()
    listed = {(o.key, o.size) for o in store.list(base + "a/")}
    assert listed == {(base + "a/x.bin", 5), (base + "a/y.bin", 300_000)}
    assert store.exists(base + "a/x.bin")
    store.delete(base + "a/x.bin")
    assert not store.exists(base + "a/x.bin")
    store.delete(base + "a/x.bin")  # deleting twice is fine


def test_ranged_reads_return_exactly_the_range(store_uri: str) -> None:
    store, prefix = store_for_uri(store_uri)
    key = f"{prefix}/r.bin" if prefix else "r.bin"
    data = bytes(range(256)) * 40
    store.put_bytes(key, data)
    assert store.get_range(key, 0, 10) == data[:10]
    assert store.get_range(key, 1000, 513) == data[1000:1513]
    assert store.get_range(key, len(data) - 5, 5) == data[-5:]


def test_parallel_ranged_download_reassembles_the_object(store_uri: str, tmp_path: Path) -> None:
    store, prefix = store_for_uri(store_uri)
    key = f"{prefix}/big.bin" if prefix else "big.bin"
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(1_000_003))
    store.put_file(str(src), key)
    dest = tmp_path / "dl" / "big.bin"
    download_ranges(store, [(key, str(dest), 1_000_003)], workers=4, part_size=100_000)
    assert file_sha256(str(dest)) == file_sha256(str(src))


def test_missing_object_is_a_not_found_error_naming_it(store_uri: str) -> None:
    store, prefix = store_for_uri(store_uri)
    with pytest.raises(NotFoundError, match=r"nope\.bin"):
        store.get_bytes(f"{prefix}/nope.bin")


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_missing_bucket_is_a_clear_error(scheme: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("s3_env" if scheme == "s3" else "gcs_env")
    store, _ = store_for_uri(f"{scheme}://no-such-bucket-here/x")
    with pytest.raises(NotFoundError, match="no-such-bucket-here"):
        store.list("x/")


@pytest.mark.parametrize(
    ("uri", "complaint"),
    [
        ("ftp://host/x", "unsupported scheme"),
        ("s3://Bad_Bucket!/x", "not a valid bucket name"),
        ("gs://a/x", "not a valid bucket name"),
        ("s3://good-bucket/../etc", "'..'"),
        ("file://host/path", "absolute"),
        ("relative/path", "unsupported scheme"),
    ],
    ids=["scheme", "s3-bucket-chars", "gs-bucket-short", "dotdot", "file-host", "relative"],
)
def test_malformed_uri_is_refused_with_the_reason(uri: str, complaint: str) -> None:
    with pytest.raises(StorageError, match=complaint):
        store_for_uri(uri)


def test_s3_endpoint_comes_from_the_skyresume_setting(s3_env: str, moto_endpoint: str) -> None:
    store, _ = store_for_uri(f"s3://{s3_env}/p")
    assert store.endpoint_url == moto_endpoint  # type: ignore[attr-defined]
