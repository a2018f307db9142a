"""Launches are keyed by (job, attempt, try) on the real launchers: a key that is
already claimed is answered with, never started again. No process is started here."""

from __future__ import annotations

from pathlib import Path

from orchestrator.domain.plan import Placement
from orchestrator.domain.spec import TaskSpec
from orchestrator.launchers.base import LaunchPhase, LaunchRequest
from orchestrator.launchers.local import LocalLauncher
from orchestrator.launchers.skypilot import cluster_name_for


def _request(job: str, launch_try: int = 0) -> LaunchRequest:
    return LaunchRequest(
        job_id=job,
        attempt=3,
        placement=Placement("local", "local", "cpu-process", None, 0, 2, True),
        command="python train.py",
        task=TaskSpec(template="gpt-cpu", command="python train.py"),
        launch_try=launch_try,
    )


def test_the_launch_key_is_job_attempt_and_try():
    assert _request("j1").launch_key == "j1-a3"
    assert _request("j1", 2).launch_key == "j1-a3-t2"
    assert cluster_name_for("j1", 3) == "sr-j1-a3"
    assert cluster_name_for("j1", 3, 2) == "sr-j1-a3-t2"


def test_a_claimed_launch_is_adopted_and_nothing_is_started(tmp_path: Path, monkeypatch):
    """Another caller (a leader that stopped inside ``launch``, a service that died
    there) claimed the key: the next caller gets the request's handle and starts no
    provisioner; once the claim is older than its grace with nothing started, the
    request reads as failed (so the next try, a new key, launches)."""
    launcher = LocalLauncher(tmp_path / "nodes", "http://127.0.0.1:9", lambda job, a: "t")
    job_dir = tmp_path / "nodes" / "j1"
    job_dir.mkdir(parents=True)
    (job_dir / "j1-a3.claim").touch()
    handle = launcher.launch(_request("j1"))
    assert (handle.cluster_name, handle.node_ids) == ("j1-a3", ("j1-a3-n0", "j1-a3-n1"))
    assert not (job_dir / "j1-a3.launch.json").exists()  # no provisioner was started
    assert launcher.progress(handle).phase is LaunchPhase.PROVISIONING
    monkeypatch.setattr(LocalLauncher, "CLAIM_GRACE_S", 0.0)
    assert launcher.progress(handle).phase is LaunchPhase.FAILED
    assert launcher.launch_requests("j1") == ["j1-a3"]


def test_a_launch_refused_before_it_was_accepted_leaves_no_claim(tmp_path: Path):
    launcher = LocalLauncher(tmp_path / "nodes", "http://127.0.0.1:9", lambda job, a: "t")
    request = _request("j1")
    bad = LaunchRequest(**{**request.__dict__, "placement": Placement(
        "local", "nowhere", "cpu-process", None, 0, 2, True)})  # fmt: skip
    try:
        launcher.launch(bad)
    except Exception as e:
        assert "no local region" in str(e)
    else:
        raise AssertionError("a region the launcher has not was accepted")
    assert launcher.launch_requests("j1") == []
