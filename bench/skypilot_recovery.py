"""MTTR through SkyPilot on the emulated AWS against the local provisioner, one run.

    python bench/skypilot_recovery.py [--home DIR] [--window 120]   # ~15 min, root

The same job both ways: 2 nodes x 1 CPU GPT rank (gloo), spot, checkpoints every 10
steps to ``s3://`` in SeaweedFS, 0.2 s a step, a 30 s heartbeat timeout, a 60 s grace;
on each, a spot interruption notice (``--window`` s) on the worker node, then, once
recovered and trained 10 steps on, a node lost with no notice, then a cancel.

1. **local** (the baseline): ``skyresume serve`` with the local provisioner on the
   cloud path (each node a network-namespace host, the agent installed by the node's
   setup from the service's wheel); the notice is ``chaos preempt`` (AWS's format on
   the node's own metadata endpoint), the loss ``chaos kill-node`` (every process of
   the node SIGKILLed: its heartbeats stop).
2. **skypilot**: ``skyresume serve`` with ``SKYRESUME_LAUNCHER=skypilot`` against
   SkyPilot 0.14.1's own API server and AWS provisioner on the emulated AWS
   (orchestrator/demo_skypilot.py, docs/awsemu.md); the notice is the fault front's
   spot interruption on the worker's instance, the loss ``TerminateInstances`` on it.

For each: job submitted -> both nodes registered (heartbeating), each incident's MTTR
(failure -> every rank validated at the resume step) by protocol step, steps lost, and
SkyPilot / local ratios. The phases take the shared locks themselves, one at a time
(``/tmp/skyresume-e2e.lock`` for the local hosts, ``/tmp/skyresume-awsemu.lock`` for
the emulator): do not wrap this in ``flock``. Ends with one JSON line
``{"bench": "skypilot_recovery", ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator import demo_skypilot as sky_loop  # noqa: E402
from orchestrator.demo import DemoService, api_post  # noqa: E402
from orchestrator.demo import job_spec as local_job_spec  # noqa: E402

STEPS = ("detect", "signal", "confirm_checkpoint", "select_replacement", "launch", "stage",
         "validate")  # fmt: skip
CLASSES = ("preemption_notice", "node_lost")


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _Local:
    """What demo_skypilot's wait_for/job_state read (``get``, ``log``) over a local
    service's client."""

    def __init__(self, http: Any) -> None:
        self.http = http

    def get(self, path: str) -> Any:
        r = self.http.get(path)
        if r.status_code >= 400:
            raise sky_loop.LoopError(f"GET {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def log(self, m: str) -> None:
        print(m, file=sys.stderr, flush=True)


def run_local(home: Path, *, window_s: float, steps: int = 5000) -> dict[str, Any]:
    home.mkdir(parents=True, exist_ok=True)
    svc = DemoService(home, s3=True)
    try:
        http = svc.wait_ready(300)  # a loaded machine: serve takes a while to import
        spec = local_job_spec(home, steps, svc.checkpoint_uri)
        spec["ranks_per_node"] = 1
        spec["task"]["command"] = spec["task"]["command"].replace(
            "--step-sleep 0.1", "--step-sleep 0.2"
        )
        spec["restarts"].update(heartbeat_timeout_s=30, grace_period_s=60)
        t0 = time.monotonic()
        job = api_post(http, "/v1/jobs", spec)["id"]
        loop = _Local(http)
        wait = sky_loop.wait_for
        wait(loop, job, "both nodes registered", lambda st, n, v, step, b: b >= 2, 600)
        registered = round(time.monotonic() - t0, 1)
        s = wait(loop, job, "step 20", lambda st, n, v, step, b: v is not None and step >= 20, 600)
        notice = {"action": "preempt", "node": 1, "provider": "aws", "in_seconds": window_s}
        api_post(http, f"/v1/jobs/{job}/chaos", notice)
        first = s[1]
        s = wait(loop, job, "resumed after the notice",
                 lambda st, n, v, step, b: n > first and v is not None and step >= v + 10,
                 900)  # fmt: skip
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "kill-node", "node": 1})
        second = s[1]
        wait(loop, job, "resumed after the node loss",
             lambda st, n, v, step, b: n > second and v is not None and step > v, 900)  # fmt: skip
        incidents = loop.get(f"/v1/jobs/{job}/incidents")["items"]
        http.post(f"/v1/jobs/{job}/cancel")
        time.sleep(3)  # the reconciler gives the nodes back
        return {"launch_to_registered_s": registered, "incidents": incidents}
    finally:
        svc.stop()


def by_step(incident: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for s in incident["steps"]:
        if s["step"] in STEPS and s["seconds"] is not None:
            out[s["step"]] = round(float(s["seconds"]), 2)
    return out


def summary(incidents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for cls in CLASSES:
        inc = next((i for i in incidents if i["failure_class"] == cls), None)
        if inc is None:
            raise SystemExit(f"no {cls} incident: {[i['failure_class'] for i in incidents]}")
        out[cls] = {
            "mttr_s": round(inc["mttr_s"], 2) if inc["mttr_s"] is not None else None,
            "steps_lost": inc["steps_lost"],
            "launch_verb": inc["launch_verb"],
            "by_step_s": by_step(inc),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--window", type=float, default=120.0, help="the notice's window (s)")
    args = ap.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="skyresume-skybench-"))
    print(f"state in {home}", file=sys.stderr)

    with locked("/tmp/skyresume-e2e.lock"):
        t = time.monotonic()
        local = run_local(home / "local", window_s=args.window)
        local_wall = round(time.monotonic() - t, 1)
    with locked("/tmp/skyresume-awsemu.lock"):
        t = time.monotonic()
        sky = sky_loop.run_loop(home / "sky", steps=5000, window_s=args.window,
                                faults=("notice", "terminate", "cancel"))  # fmt: skip
        sky_wall = round(time.monotonic() - t, 1)

    ls, ss = summary(local["incidents"]), summary(sky["incidents"])
    print(f"\n{'':28}{'skypilot':>10}{'local':>10}{'ratio':>8}")
    row = "{:28}{:>10}{:>10}{:>8}"
    reg = (sky["launch_to_registered_s"], local["launch_to_registered_s"])
    print(row.format("submit -> nodes registered", *reg, str(_ratio(*reg))))
    ratios: dict[str, Any] = {"launch_to_registered": _ratio(*reg)}
    for cls in CLASSES:
        m = (ss[cls]["mttr_s"], ls[cls]["mttr_s"])
        print(row.format(f"{cls} MTTR", str(m[0]), str(m[1]), str(_ratio(*m))))
        ratios[f"{cls}_mttr"] = _ratio(*m)
        for step in STEPS:
            v = (ss[cls]["by_step_s"].get(step), ls[cls]["by_step_s"].get(step))
            print(row.format(f"  {step}", str(v[0]), str(v[1]), str(_ratio(*v))))
        print(row.format("  steps lost", str(ss[cls]["steps_lost"]), str(ls[cls]["steps_lost"]),
                         ""))  # fmt: skip
    print(json.dumps({
        "bench": "skypilot_recovery",
        "skypilot": {"launch_to_registered_s": reg[0], **ss,
                     "teardown_s": sky.get("teardown_s"),
                     "instances_left": len(sky.get("instances_left", [])),
                     "sky_clusters_left": len(sky.get("sky_clusters_left", [])),
                     "wall_s": sky_wall},
        "local": {"launch_to_registered_s": reg[1], **ls, "wall_s": local_wall},
        "ratio_skypilot_vs_local": ratios,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
