"""The Hugging Face Trainer integration on real processes: two torchrun "nodes" of two
gloo ranks each on this machine (each node its own local checkpoint tier and output
directory: no shared disk), checkpoints in S3 (moto). A SIGTERM to one node's ranks
stops all four at the same step, every node uploads the files it holds, rank 0
commits; fresh nodes stage the commit from S3, resume validated on every rank, and
end with the uninterrupted run's weights, bitwise.

Not the netns nodes of the other e2e tests: both nodes share this machine's loopback
(the rendezvous and the object store are the only links between them)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.training.datagrams import Listener

pytestmark = [pytest.mark.long, pytest.mark.e2e]  # e2e: one at a time under xdist

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 6


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SKYRESUME_S3_ENDPOINT_URL": endpoint,
    }
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    ).create_bucket(Bucket="ckpt")  # fmt: skip
    yield env
    server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nodes(
    tmp: Path, name: str, env: dict[str, str], example: str = "hf_trainer", steps: int = MAX_STEPS
) -> list[subprocess.Popen[bytes]]:
    """Two torchrun nodes x two ranks running ``training.integrations.examples.<example>``
    (per-device batch 2: a global batch of 8), each node with a disk of its own."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        disk = tmp / f"{name}-node{node}"
        node_env = {
            **os.environ,
            **env,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "SKYRESUME_RUN_LOCAL_CHECKPOINT_DIR": str(disk / "ckpt"),
        }
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            node_env.pop(k, None)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
            "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
            "--max-restarts=0", "-m", f"training.integrations.examples.{example}",
            "--output-dir", str(disk / "out"), "--max-steps", str(steps),
            "--batch-size", "2",
        ]  # fmt: skip
        log = open(tmp / f"{name}-node{node}.log", "wb")  # noqa: SIM115
        procs.append(
            subprocess.Popen(cmd, env=node_env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        )
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], tmp: Path, name: str) -> list[int]:
    codes = [p.wait(timeout=900) for p in procs]
    for node in (0, 1):
        print((tmp / f"{name}-node{node}.log").read_text()[-3000:])
    return codes


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def test_hf_two_nodes_preempted_resume_from_s3_to_the_same_weights(tmp_path, s3_env, monkeypatch):
    for k, v in s3_env.items():  # this process reads the store too
        monkeypatch.setenv(k, v)
    base = _nodes(tmp_path, "plain", {"SKYRESUME_RUN_CHECKPOINT_URI": ""})
    assert _wait(base, tmp_path, "plain") == [0, 0]
    uninterrupted = _weights(tmp_path / "plain-node0" / "out")

    uri = f"s3://ckpt/{secrets.token_hex(4)}"
    listener = Listener()
    env = {
        **s3_env,
        "SKYRESUME_RUN_CHECKPOINT_URI": uri,
        "SKYRESUME_RUN_CHECKPOINT_EVERY": "2",
        "SKYRESUME_RUN_PROGRESS_ADDR": listener.addr,
    }
    run = _nodes(tmp_path, "run", env)
    deadline = time.monotonic() + 600
    while not any(d["type"] == "progress" and d["step"] >= 3 for d in list(listener.got)):
        assert time.monotonic() < deadline, "no progress"
        assert all(p.poll() is None for p in run), _wait(run, tmp_path, "run")
        time.sleep(0.05)
    run[1].send_signal(signal.SIGTERM)  # node 1's notice; torchrun passes it to its ranks
    _wait(run, tmp_path, "run")
    exits = [d for d in listener.of("exit")]
    assert sorted(d["rank"] for d in exits) == [0, 1, 2, 3]
    assert {d["code"] for d in exits} == {75}, exits  # every rank saved and stopped
    saved = max(d["step"] for d in listener.of("checkpoint"))
    assert saved == max(d["step"] for d in listener.of("progress")), "the notice lost a step"
    ckpt = listener.of("checkpoint")[-1]
    assert ckpt["uploaded_uri"] == f"{uri}/step_{saved}"
    from orchestrator.cloud.storage import list_checkpoints

    # Node 1's RNG files came from node 1's disk: the manifest lists all four ranks'.
    info = {c.step: c for c in list_checkpoints(uri)}[saved]
    assert info.complete

    listener.got.clear()
    resumed = _nodes(tmp_path, "resumed", env)  # fresh disks: staged from S3
    assert _wait(resumed, tmp_path, "resumed") == [0, 0]
    got = listener.close()
    back = [d for d in got if d["type"] == "resumed"]
    assert sorted(d["rank"] for d in back) == [0, 1, 2, 3]
    assert {d["step"] for d in back} == {saved}
    assert len({d["manifest_digest"] for d in back}) == 1  # validated on every rank
    final = _weights(tmp_path / "resumed-node0" / "out")
    assert final.keys() == uninterrupted.keys()
    assert [k for k in final if not final[k].equal(uninterrupted[k])] == []
