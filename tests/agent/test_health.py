"""The node's health checks before training (orchestrator/agent/health.py).

nvidia-smi is faked by a script on PATH that prints what real broken nodes print (the
texts are from public issue threads: a GPU fallen off the bus, a driver that does
not answer); this machine has no GPU.
"""

from __future__ import annotations

import os
import re
import time
from email.utils import formatdate
from pathlib import Path

import pytest
from conftest import free_port

from orchestrator.agent import health as hc

S = hc.CheckStatus

H100_LIST = (
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-67a571b1-79ee-1016-8ea3-c1fff3f1c1d2)\n"
    "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-3e34e62f-d88e-f448-415e-be2cbf2c6178)\n"
)


def fake_smi(tmp_path: Path, list_out: str, list_code: int = 0, query_out: str = "0, 0\n1, 0\n"):
    """An ``nvidia-smi`` that answers ``-L`` and ``--query-gpu`` like the real one."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    (d / "list.txt").write_text(list_out)
    (d / "query.txt").write_text(query_out)
    smi = d / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-L" ]; then cat "{d}/list.txt"; exit {list_code}; fi\n'
        f'cat "{d}/query.txt"\n'
    )
    smi.chmod(0o755)
    return str(smi)


def test_no_gpus_declared_is_a_recorded_skip_not_a_pass():
    r = hc.check_gpus(0)
    assert r.status is S.SKIP
    assert r.detail.startswith("no GPUs on this node: the placement declares none")


def test_healthy_gpus_pass(tmp_path):
    r = hc.check_gpus(2, smi=fake_smi(tmp_path, H100_LIST))
    assert r.status is S.PASS and r.data == {"expected": 2, "visible": 2}


@pytest.mark.parametrize(
    ("list_out", "code", "query", "why"),
    [
        pytest.param(
            "Unable to determine the device handle for GPU0000:0B:00.0: Unknown Error\n",
            0,
            "",
            "Unable to determine the device handle",
            id="gpu-off-the-bus-exit-0",
        ),
        pytest.param(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.\n",
            9,
            "",
            "exit code 9",
            id="driver-down",
        ),
        pytest.param(
            H100_LIST.splitlines()[0] + "\n",
            0,
            "0, 0\n",
            "1 GPU(s) visible, 2 expected",
            id="one-missing",
        ),
        pytest.param(
            H100_LIST, 0, "0, 0\n1, 3\n", "uncorrected ECC errors since boot (GPU 1: 3)", id="ecc"
        ),
    ],
)
def test_a_broken_gpu_fails_the_check_with_what_nvidia_smi_said(
    tmp_path, list_out, code, query, why
):
    r = hc.check_gpus(2, smi=fake_smi(tmp_path, list_out, code, query))
    assert r.status is S.FAIL
    assert why in r.detail


def test_gpus_expected_but_no_nvidia_smi_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    r = hc.check_gpus(8)
    assert r.status is S.FAIL and "nvidia-smi is not installed" in r.detail


def test_a_fake_nvidia_smi_on_path_is_the_one_used(tmp_path, monkeypatch):
    fake_smi(tmp_path, "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert hc.check_gpus(1).status is S.FAIL


def test_disk_below_the_estimate_fails_and_above_passes(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    missing = tmp_path / "not" / "yet" / "checkpoints"  # measured at its nearest parent
    ok = hc.check_disk(missing, min_free_bytes=1 << 20)
    assert ok.status is S.PASS and ok.data["path"] == str(tmp_path)
    bad = hc.check_disk(missing, min_free_bytes=free * 2)
    assert bad.status is S.FAIL and "the checkpoint tier needs" in bad.detail
    assert bad.data["free_bytes"] < bad.data["min_free_bytes"]


def test_a_reachable_file_store_passes_and_an_absent_uri_is_skipped(tmp_path):
    (tmp_path / "ck" / "step_5").mkdir(parents=True)
    (tmp_path / "ck" / "step_5" / "COMMIT").write_text("x")
    r = hc.check_store(f"file://{tmp_path / 'ck'}")
    assert r.status is S.PASS and "listed 1 object(s)" in r.detail
    fresh = hc.check_store(f"file://{tmp_path / 'new'}")
    assert fresh.status is S.PASS and "does not exist yet" in fresh.detail
    assert hc.check_store(None).status is S.SKIP


def test_a_file_store_under_a_regular_file_fails(tmp_path):
    (tmp_path / "f").write_text("not a directory")
    r = hc.check_store(f"file://{tmp_path / 'f' / 'ck'}")
    assert r.status is S.FAIL and "not a writable directory" in r.detail


def test_an_s3_store_nobody_answers_for_fails_within_the_timeout(monkeypatch):
    pytest.importorskip("boto3")
    monkeypatch.setenv("SKYRESUME_S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    t0 = time.monotonic()
    r = hc.check_store("s3://ckpt-bucket/job1", timeout_s=3)
    assert time.monotonic() - t0 < 6
    assert r.status is S.FAIL and r.detail.startswith("s3://ckpt-bucket/job1: ")


@pytest.mark.parametrize(
    ("offset_s", "status"),
    [
        pytest.param(0, S.PASS, id="in-sync"),
        pytest.param(45, S.PASS, id="45s-within-limit"),
        pytest.param(-120, S.FAIL, id="node-2min-ahead"),
        pytest.param(300, S.FAIL, id="node-5min-behind"),
    ],
)
def test_clock_against_the_service_date_header(offset_s, status):
    now = time.time()
    # The service's clock is offset_s ahead of ours.
    date = formatdate(now + offset_s, usegmt=True)
    r = hc.check_clock(date, local_sent=now - 0.05, local_received=now, max_skew_s=60)
    assert r.status is status, r.detail
    if status is S.FAIL:
        side = "behind" if offset_s > 0 else "ahead of"
        assert f"s {side} the service's (limit 60 s)" in r.detail


def test_a_slow_answer_is_not_a_skewed_clock():
    sent = time.time()
    # The service stamped its Date right after our request; the answer took 90 s.
    date = formatdate(sent + 0.5, usegmt=True)
    r = hc.check_clock(date, local_sent=sent, local_received=sent + 90, max_skew_s=60)
    assert r.status is S.PASS


def test_no_date_is_unknown_never_a_pass():
    r = hc.check_clock(None, local_sent=None, local_received=None)
    assert r.status is S.UNKNOWN
    assert (
        hc.check_clock(None, local_sent=None, local_received=None, have_service=False).status
        is S.SKIP
    )
    bad = hc.check_clock("yesterday-ish", local_sent=1.0, local_received=2.0)
    assert bad.status is S.UNKNOWN


def test_run_checks_reports_every_check_and_fails_on_any_failure(tmp_path):
    spec = hc.HealthSpec(
        expect_gpus=0, checkpoint_dir=tmp_path / "ck", min_free_disk_bytes=1 << 20,
        checkpoint_uri=f"file://{tmp_path / 'store'}",
    )  # fmt: skip
    now = time.time()
    good = hc.run_checks(
        spec, service=hc.ServiceDate(formatdate(now, usegmt=True), now, now), have_service=True
    )
    assert [(r.name, r.status) for r in good] == [
        ("gpus", S.SKIP), ("disk", S.PASS), ("checkpoint_store", S.PASS), ("clock", S.PASS),
    ]  # fmt: skip
    assert hc.failed(good) == [] and hc.summary(good) == "all checks passed (3 pass, 1 skip)"
    skewed = hc.ServiceDate(formatdate(now - 3600, usegmt=True), now, now)
    bad = hc.run_checks(spec, service=skewed, have_service=True)
    assert [r.name for r in hc.failed(bad)] == ["clock"]
    # The header's one-second resolution and the 1 s allowance: 3599-3600 s.
    m = re.match(r"clock: the node's clock is (\d+) s ahead of the service's", hc.summary(bad))
    assert m and 3598 <= int(m.group(1)) <= 3600, hc.summary(bad)


def test_a_store_that_accepts_but_never_answers_fails_at_the_timeout(monkeypatch):
    pytest.importorskip("boto3")
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)  # connections queue in the backlog; nothing ever answers
        monkeypatch.setenv("SKYRESUME_S3_ENDPOINT_URL", f"http://127.0.0.1:{srv.getsockname()[1]}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
        t0 = time.monotonic()
        r = hc.check_store("s3://ckpt-bucket/job1", timeout_s=2)
        took = time.monotonic() - t0
    assert 2 <= took < 4
    assert (
        r.status is S.FAIL and r.detail == "s3://ckpt-bucket/job1: no answer to a list call in 2 s"
    )


# --- the agent's flags for the checks ------------------------------------------------

BASE_ARGV = ["--job-id", "j", "--attempt", "1", "--node-id", "n0", "--local-dir", "/tmp/x"]


def test_health_flags_default_from_the_run_environment_and_flags_win(monkeypatch):
    from orchestrator.agent.main import parse_args

    cfg = parse_args([*BASE_ARGV, "--", "python", "t.py"])
    assert (cfg.health_checks, cfg.expect_gpus, cfg.min_free_disk_gb) == (True, 0, 1.0)
    monkeypatch.setenv(hc.EXPECT_GPUS_ENV, "8")
    monkeypatch.setenv(hc.MIN_FREE_DISK_GB_ENV, "250")
    monkeypatch.setenv(hc.HEALTH_CHECKS_ENV, "off")
    cfg = parse_args([*BASE_ARGV, "--", "python", "t.py"])
    assert (cfg.health_checks, cfg.expect_gpus, cfg.min_free_disk_gb) == (False, 8, 250.0)
    cfg = parse_args([*BASE_ARGV, "--expect-gpus", "4", "--health-checks", "on", "--", "x"])
    assert (cfg.health_checks, cfg.expect_gpus) == (True, 4)


@pytest.mark.parametrize(
    ("flags", "msg"),
    [
        (["--expect-gpus", "-1"], "--expect-gpus must be >= 0"),
        (["--min-free-disk-gb", "nan"], "--min-free-disk-gb must be >= 0"),
        (["--max-clock-skew-s", "0"], "--max-clock-skew-s must be a positive number"),
    ],
)
def test_bad_health_flags_are_refused_by_name(flags, msg):
    from orchestrator.agent.main import UsageError, parse_args

    with pytest.raises(UsageError, match=msg):
        parse_args([*BASE_ARGV, *flags, "--", "python", "t.py"])


# --- all-reduce bandwidth across nodes (a real 2-process gloo all-reduce) ----------------


def _pair(min_gbps: float, *, mib: float = 8.0) -> list[hc.CheckResult]:
    import sys
    import threading

    port = free_port()
    out: dict[int, hc.CheckResult] = {}

    def node(rank: int) -> None:
        spec = hc.AllreduceSpec(min_gbps, rank, 2, "127.0.0.1", port, mib=mib, join_timeout_s=60)
        out[rank] = hc.check_allreduce(spec, python=sys.executable)

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return [out[0], out[1]]


@pytest.mark.slow
def test_allreduce_bandwidth_is_measured_across_two_processes_against_the_threshold():
    ok = _pair(0.001)
    assert [r.status for r in ok] == [S.PASS, S.PASS], [r.detail for r in ok]
    assert ok[0].data["backend"] == "gloo" and ok[0].data["bytes"] == 8 * 2**20
    # Both see the group's figure: the slowest rank's time.
    assert ok[0].data["busbw_gbps_slowest"] == ok[1].data["busbw_gbps_slowest"] > 0
    slow = _pair(1e6)  # a petabyte per second: no link is that fast
    assert [r.status for r in slow] == [S.FAIL, S.FAIL]
    assert "under the job's 1e+06 GB/s" in slow[0].detail


def test_allreduce_check_applies_only_with_a_threshold_and_peers():
    import sys

    spec = hc.AllreduceSpec(0.0, 0, 2, "127.0.0.1", 1)
    assert hc.check_allreduce(spec, python=sys.executable).status is S.SKIP
    one = hc.AllreduceSpec(5.0, 0, 1, "127.0.0.1", 1)
    assert hc.check_allreduce(one, python=sys.executable).detail == "one node: no link to measure"


@pytest.mark.slow
def test_a_peer_that_never_joins_makes_the_bandwidth_unknown_not_failed():
    import sys

    spec = hc.AllreduceSpec(1.0, 0, 2, "127.0.0.1", free_port(), join_timeout_s=3)
    r = hc.check_allreduce(spec, python=sys.executable)
    assert r.status is S.UNKNOWN and "1/2 clients joined" in r.detail
