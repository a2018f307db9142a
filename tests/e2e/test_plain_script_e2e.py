"""The plain-script contract end to end (issue 27): a DDP script in the style of
PyTorch's ddp-tutorial-series ``multinode.py`` (``training/examples/plain_ddp.py``:
its own snapshot, nothing of skyresume), 2 nodes x 2 ranks under ``skyresume serve``
with the local launcher, a preemption and then a node kill. The job ends SUCCEEDED,
each restart resumes from the script's own snapshot (``checkpoint.own``), no attempt
is stopped while it trains, and the relaunch that runs to its end is the finish.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from orchestrator.demo import DemoService, api_get, api_post

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).resolve().parents[2] / "training" / "examples" / "plain_ddp.py"
EPOCHS = 150


@pytest.fixture
def service(tmp_path):  # type: ignore[no-untyped-def]
    svc = DemoService(tmp_path)
    http = svc.wait_ready()
    yield http
    svc.stop()


def _starts(snap: Path) -> list[int]:
    """The epoch each attempt's ranks started at (the script's own line per start)."""
    path = Path(f"{snap}.starts")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _saved_epoch(snap: Path) -> int:
    import torch

    try:
        return int(torch.load(snap, weights_only=True)["EPOCHS_RUN"])
    except (OSError, RuntimeError, EOFError, KeyError):
        return -1  # not saved yet


def _until(http, job: str, what: str, ok, deadline: float):  # type: ignore[no-untyped-def]
    while time.monotonic() < deadline:
        j = api_get(http, f"/v1/jobs/{job}")
        attempts = api_get(http, f"/v1/jobs/{job}/attempts")["items"]
        if ok(j, attempts):
            return j, attempts
        if j["status"] in ("FAILED", "CANCELLED"):
            raise AssertionError(f"job {j['status']} waiting for {what}: {j['status_reason']}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _submit(http, tmp_path: Path, *, own: bool) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    snap = tmp_path / "shared" / "snapshot.pt"  # storage the nodes share (one machine)
    snap.parent.mkdir()
    command = f"{sys.executable} {SCRIPT} {EPOCHS} 5 --snapshot_path {snap} --epoch_sleep 0.25"
    checkpoint: dict[str, object] = {"uri": f"file://{tmp_path / 'checkpoints'}", "adaptive": False}
    if own:
        checkpoint["own"] = {"path": str(snap), "resume_arg": "--resume_from"}
    spec = {
        "name": "plain-ddp",
        "task": {"template": "gpt-cpu", "command": command},
        "num_nodes": 2,
        "ranks_per_node": 2,
        "checkpoint": checkpoint,
        # 20 s to report a resume step: the script never will, and is noticed then.
        "restarts": {
            "max_restarts": 5,
            "heartbeat_timeout_s": 20,
            "grace_period_s": 30,
            "validate_timeout_s": 20,
        },
    }
    return api_post(http, "/v1/jobs", spec)["id"], snap


def _running(snap: Path, number: int, past: int):  # type: ignore[no-untyped-def]
    """Attempt ``number`` RUNNING, its ranks ``past`` epochs beyond where they started."""

    def ok(j, attempts) -> bool:  # type: ignore[no-untyped-def]
        return (
            j["status"] == "RUNNING"
            and len(attempts) == number
            and len(_starts(snap)) == number
            and _saved_epoch(snap) >= _starts(snap)[-1] + past
        )

    return ok


def _steps(inc) -> dict:  # type: ignore[no-untyped-def]
    return {s["step"]: s for s in inc["steps"]}


def _never_stopped_for_a_report(events) -> None:  # type: ignore[no-untyped-def]
    """Noticed once, in one line; nothing was stopped for a missing report."""
    (plain,) = [e for e in events if e["kind"] == "plain_script"]
    assert "send no progress reports" in plain["message"] and "\n" not in plain["message"]
    kinds = {e["kind"] for e in events}
    assert "stuck" not in kinds and "rank_hang" not in kinds


def test_a_plain_ddp_script_survives_a_preemption_and_a_node_kill_on_its_own_snapshot(
    service, tmp_path
):
    http = service
    job, snap = _submit(http, tmp_path, own=True)
    end = time.monotonic() + 800
    _until(http, job, "attempt 1 training past epoch 20", _running(snap, 1, 20), end)
    api_post(http, f"/v1/jobs/{job}/chaos", {"action": "preempt", "node": 1})
    _until(http, job, "attempt 2 training on", _running(snap, 2, 15), end)
    api_post(http, f"/v1/jobs/{job}/chaos", {"action": "kill-node", "node": 0})
    j, attempts = _until(http, job, "the end", lambda j, a: j["status"] == "SUCCEEDED", end)

    # Each restart resumed from the script's own snapshot, never from scratch, and the
    # relaunch that ran to its end is the finish.
    starts = _starts(snap)
    assert len(starts) == 3 and starts[0] == 0 and 0 < starts[1] <= starts[2], starts
    assert _saved_epoch(snap) == EPOCHS
    assert "every rank of attempt 3 exited 0" in j["status_reason"]
    assert len(attempts) == 3
    _never_stopped_for_a_report(api_get(http, f"/v1/jobs/{job}/events?limit=1000")["items"])

    incidents = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
    assert sorted(i["failure_class"] for i in incidents) == ["node_lost", "preemption_notice"]
    for inc in incidents:
        steps = _steps(inc)
        # The script saves no checkpoint on SIGTERM: no save is claimed.
        assert "saved and stopped" not in (steps["signal"]["detail"] or "")
        assert steps["validate"]["outcome"] == "ok"
        assert f"--resume_from {snap}" in steps["validate"]["detail"]


@pytest.mark.long  # CI runs it as a step of its own (.ci/run): the default run stays under 30 min
def test_without_checkpoint_own_a_plain_script_restarts_from_scratch_and_says_so(service, tmp_path):
    http = service
    job, snap = _submit(http, tmp_path, own=False)
    end = time.monotonic() + 800
    _until(http, job, "attempt 1 training past epoch 20", _running(snap, 1, 20), end)
    api_post(http, f"/v1/jobs/{job}/chaos", {"action": "preempt", "node": 1})
    _until(http, job, "the end", lambda j, a: j["status"] == "SUCCEEDED", end)

    assert _starts(snap) == [0, 0]  # its snapshot was there; nobody passed it
    _never_stopped_for_a_report(api_get(http, f"/v1/jobs/{job}/events?limit=1000")["items"])
    (inc,) = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
    steps = _steps(inc)
    assert "restarting from scratch" in steps["confirm_checkpoint"]["detail"]
    assert "from scratch" in steps["validate"]["detail"]
    # The training attempt 1 did is counted as thrown away.
    assert api_get(http, f"/v1/jobs/{job}/goodput")["lost_work_seconds"] > 0
