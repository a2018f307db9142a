"""A chaos soak: one long job under random failures, end to end (issue #14).

    .venv/bin/python bench/soak.py                 # 20 minutes of chaos, then to the end
    .venv/bin/python bench/soak.py --minutes 3     # a short one

``skyresume serve`` (SQLite, the local launcher: nodes in network namespaces, SeaweedFS
as the S3 checkpoint store) runs a 2 x 2-rank GPT job. For ``--minutes`` a seeded
random schedule injects, one at a time and each only once the job trains again after
the last, a preemption notice, a node kill (SIGKILL of every process), a hung rank
(SIGSTOP) or an agent crash (SIGKILL of the agent alone), on a random node; once, at
the middle, the service itself is restarted (SIGTERM, as a process manager restarts
it; ``--service-kill`` for SIGKILL, a crash) while the nodes train on. Then the job
runs to its end with no more chaos.

Reported: every injection and the incident it became (class, MTTR, steps lost), the
effective training time (productive / wall, the service's own goodput accounting, and
the ratio of the steps' wall time to the same steps uninterrupted), and whether the
final weights are bitwise equal to an uninterrupted run's: the same script, 4 ranks on
one torchrun, no skyresume, no failure (the baseline, measured in the same run). Ends
with one JSON line ``{"bench": "soak", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from orchestrator.demo import DemoService, api_get, api_post, job_state  # noqa: E402

ACTIONS = ("preempt", "kill-node", "hang-rank", "kill-agent")


def train_args(steps: int, final: Path) -> list[str]:
    return ["-m", "training.examples.train_gpt", "--max-steps", str(steps), "--save-final",
            str(final)]  # fmt: skip


def uninterrupted(tmp: Path, steps: int) -> tuple[Path, float]:
    """The same training on one torchrun with 4 ranks, no skyresume: (weights, seconds)."""
    out = tmp / "uninterrupted.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", *train_args(steps, out)],
        env=env, cwd=_ROOT, check=True, timeout=3600, capture_output=True,
    )  # fmt: skip
    return out, time.monotonic() - t0


def spec(home: Path, steps: int, sleep: float, uri: str) -> dict[str, Any]:
    cmd = " ".join(
        [sys.executable, *train_args(steps, home / "final_weights.pt"), "--step-sleep", f"{sleep}"]
    )
    return {
        "name": "soak-gpt",
        "task": {"template": "gpt-cpu", "command": cmd},
        "num_nodes": 2,
        "ranks_per_node": 2,
        "spot": True,
        "checkpoint": {"uri": uri, "every_steps": 25, "keep": 3, "adaptive": False},
        "restarts": {"max_restarts": 200, "heartbeat_timeout_s": 20, "grace_period_s": 60},
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def wait_training(http: Any, job: str, newer_than: int, deadline: float) -> tuple[Any, ...]:
    """Until the job trains on an attempt numbered above ``newer_than`` past its
    validated step (every injected failure is recovered by a new attempt; after a
    service restart, pass the attempt before it); the state."""
    while time.monotonic() < deadline:
        st, n, validated, step = job_state(http, job)
        if st in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return st, n, validated, step
        if st == "RUNNING" and n > newer_than and validated is not None and step >= validated + 5:
            return st, n, validated, step
        time.sleep(1)
    raise TimeoutError("the job did not train again in time")


def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="skyresume-soak-"))
    log(f"state in {home}")
    ref, ref_s = uninterrupted(home, args.steps)
    log(f"uninterrupted baseline: {args.steps} steps in {ref_s:.0f} s (no sleep)")
    svc = DemoService(home, s3=True)
    injected: list[dict[str, Any]] = []
    http: Any = None
    job: str | None = None
    try:
        http = svc.wait_ready()
        job = api_post(http, "/v1/jobs", spec(home, args.steps, args.step_sleep,
                                              str(svc.checkpoint_uri)))["id"]  # fmt: skip
        log(f"job {job}: 2 nodes x 2 ranks, {args.steps} steps, checkpoints in S3")
        t0 = time.monotonic()
        chaos_end = t0 + args.minutes * 60
        hard_end = chaos_end + args.tail_minutes * 60
        restart_at = t0 + args.minutes * 30
        restarted = False
        state = wait_training(http, job, 0, hard_end)
        while time.monotonic() < chaos_end and state[0] == "RUNNING":
            time.sleep(rng.uniform(args.min_gap_s, args.max_gap_s))
            if time.monotonic() >= chaos_end:
                break
            if not restarted and time.monotonic() >= restart_at:
                sig = signal.SIGKILL if args.service_kill else signal.SIGTERM
                log(f"service restart ({signal.Signals(sig).name}) at step {state[3]}")
                t = time.monotonic()
                http = svc.restart(sig)
                injected.append({"action": "service-restart", "signal": sig.name,
                                 "at_step": state[3], "down_s": round(time.monotonic() - t, 1),
                                 "attempt": state[1]})  # fmt: skip
                restarted = True
                state = wait_training(http, job, state[1] - 1, hard_end)
                continue
            action = rng.choice(ACTIONS)
            node = rng.randrange(2)
            body: dict[str, Any] = {"action": action, "node": node}
            if action == "preempt":
                body["in_seconds"] = 30
            before = job_state(http, job)
            r = http.post(f"/v1/jobs/{job}/chaos", json=body)
            if r.status_code >= 400:
                log(f"{action} on node {node} refused ({r.status_code}: {r.text[:120]}); next")
                continue
            log(f"{action} on node {node} at step {before[3]} (attempt {before[1]})")
            injected.append({"action": action, "node": node, "at_step": before[3],
                             "attempt": before[1]})  # fmt: skip
            state = wait_training(http, job, before[1], hard_end)
        log("chaos over: training on to the end")
        while time.monotonic() < hard_end:
            state = job_state(http, job)
            if state[0] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            time.sleep(2)
        wall_s = time.monotonic() - t0
        j = api_get(http, f"/v1/jobs/{job}")
        incidents = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
        goodput = api_get(http, f"/v1/jobs/{job}/goodput")
    finally:
        if job is not None and http is not None:
            try:
                if api_get(http, f"/v1/jobs/{job}")["status"] not in ("SUCCEEDED", "FAILED"):
                    http.post(f"/v1/jobs/{job}/cancel")
                    time.sleep(3)
            except Exception as e:  # the soak failed anyway; the nodes go with svc.stop()
                log(f"could not cancel {job}: {e}")
        svc.stop()
    bitwise, differ = compare(home / "final_weights.pt", ref)
    for inc in incidents:
        what = f"MTTR {inc.get('mttr_s')} s, steps lost {inc.get('steps_lost')}"
        log(f"incident {inc['failure_class']}: {what}, resumed at {inc.get('resumed_step')}")
    return {
        "bench": "soak",
        "seed": args.seed,
        "minutes": args.minutes,
        "steps": args.steps,
        "status": j["status"],
        "injected": injected,
        "injections": len(injected),
        "incidents": len(incidents),
        "incident_classes": sorted({i["failure_class"] for i in incidents}),
        "restarts": j.get("restart_count"),
        "wall_s": round(wall_s, 1),
        "effective_training_fraction": goodput.get("effective_training_fraction"),
        "productive_s": goodput.get("productive_seconds"),
        "failure_s": goodput.get("failure_seconds"),
        "lost_work_s": goodput.get("lost_work_seconds"),
        "steps_lost": sum(int(i.get("steps_lost") or 0) for i in incidents),
        "mttr_s": [i.get("mttr_s") for i in incidents],
        "uninterrupted_s_no_sleep": round(ref_s, 1),
        "bitwise_equal": bitwise,
        "differing_parameters": differ,
        "home": str(home),
    }


def compare(got_path: Path, want_path: Path) -> tuple[bool, list[str]]:
    import torch

    if not got_path.exists():
        return False, ["<no final weights: the job did not finish>"]
    got = torch.load(got_path, weights_only=True)
    want = torch.load(want_path, weights_only=True)
    if got["step"] != want["step"] or got["model"].keys() != want["model"].keys():
        return False, [f"<step {got['step']} vs {want['step']}, or other parameters>"]
    differ = [k for k, v in want["model"].items() if not torch.equal(got["model"][k], v)]
    return not differ, differ


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="how long chaos is injected")
    p.add_argument("--tail-minutes", type=float, default=20.0, help="then, at most, to the end")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--step-sleep", type=float, default=0.25, help="seconds per step (pace)")
    p.add_argument("--min-gap-s", type=float, default=40.0)
    p.add_argument("--max-gap-s", type=float, default=90.0)
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--service-kill", action="store_true", help="SIGKILL the service, not TERM")
    args = p.parse_args()
    out = soak(args)
    print(json.dumps(out, default=str))
    sys.exit(0 if out["status"] == "SUCCEEDED" and out["bitwise_equal"] else 1)


if __name__ == "__main__":
    main()
