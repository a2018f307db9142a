"""One cluster per attempt (a) vs one single-node cluster per node (b), through
SkyPilot's real AWS provisioner on the emulated AWS, both in one run (issue 19 item 4).

    flock /tmp/skyresume-awsemu.lock .venv/bin/python bench/skypilot_grouping.py

Root only (namespaces, sshd); the node template must be prepared
(``scripts/awsemu-prepare``). For each grouping (``SKYRESUME_SKYPILOT_GROUPING`` =
``attempt``, then ``node``), on an emulator of its own (orchestrator/demo_skypilot.py's
``SkyLoop``: ``skyresume serve`` with the SkyPilot launcher, checkpoints on ``s3://``):

1. a 2-node x 1-rank CPU GPT job launches and trains past step 30;
2. **node loss**: node 1's instance is terminated without a notice (EC2
   TerminateInstances through the fault front). Measured: the incident's MTTR (the
   service's own ``mttr_s``: detection to a validated resume), the wall time from the
   termination to the validated resume, whether the survivor's instance is the same
   one afterwards and its agent's pid (``~/skyresume/agent.pid`` on the host's disk)
   before the loss, after the loss (before the relaunch) and after the resume, and
   the SkyPilot SDK calls the service made from the termination to the resume
   (``SKYRESUME_SKYPILOT_CALL_LOG``: every call the launcher makes, counted by
   ``skypilot_grouping.CountingSDK``; no estimate);
3. **a crash mid-recovery**: node 0's instance is terminated, and once the service
   has recorded the relaunch's request it is SIGKILLed. After 60 s (the requests
   already with SkyPilot's API server run on) the instances pending or running in
   moto and the clusters ``sky status --refresh`` lists are counted.

The ratios are (b)/(a). Ends with one JSON line ``{"bench": "skypilot-grouping", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.awsemu import skyconf  # noqa: E402
from orchestrator.demo_skypilot import SkyLoop, wait_for  # noqa: E402
from orchestrator.launchers.skypilot_grouping import (  # noqa: E402
    node_cluster_name,
    read_call_log,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rank_instance(loop: SkyLoop, grouping: str, job: str, rank: int, timeout_s: float = 300) -> str:
    """The running instance of node ``rank`` (whichever attempt launched it), once
    exactly the job's two instances run (an old one may still be going down)."""
    base = node_cluster_name(job, 1, 0, 0).removesuffix("-a1-n0")
    if grouping == "node":
        pat = re.compile(rf"^{re.escape(base)}-a\d+(-t\d+)?-n{rank}(-|$)")
    else:
        pat = re.compile(rf"^{re.escape(base)}-a\d+(-t\d+)?(-|$)")
    kind = "head" if rank == 0 else "worker"
    end = time.monotonic() + timeout_s
    found: list[dict[str, Any]] = []
    while time.monotonic() < end:
        running = loop.instances()
        found = [
            i for i in running
            if any(pat.match(str(v)) for v in i["tags"].values())
            and (grouping == "node" or i["tags"].get("ray-node-type") == kind)
        ]  # fmt: skip
        if len(running) == 2 and len(found) == 1:
            return str(found[0]["InstanceId"])
        time.sleep(2)
    raise RuntimeError(f"no single running instance of node {rank}: {len(found)} found")


def agent_pid(loop: SkyLoop, iid: str) -> str | None:
    """The agent pid the host's run section wrote (its own PID namespace)."""
    assert loop.emu.pool is not None
    for p in (loop.emu.pool.dir / iid).glob("home/upper/skyresume/agent.pid"):
        return p.read_text().strip() or None
    return None


def running_ids(loop: SkyLoop) -> set[str]:
    return {str(i["InstanceId"]) for i in loop.instances()}


def incidents(loop: SkyLoop, job: str) -> list[dict[str, Any]]:
    return list(loop.get(f"/v1/jobs/{job}/incidents")["items"])


def incident(
    loop: SkyLoop, grouping: str, job: str, first: int, calls: Path, *, notice: bool
) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """Node 1 lost (a spot notice with AWS's 2-minute window, or terminated without
    one); what it cost, once the job resumed validated on a new attempt."""
    survivor = rank_instance(loop, grouping, job, 0)
    victim = rank_instance(loop, grouping, job, 1)
    pid_before = agent_pid(loop, survivor)
    how = "spot notice on" if notice else "terminating"
    log(f"{grouping}: {how} node 1 ({victim}); survivor {survivor} agent {pid_before}")
    n_before = len(incidents(loop, job))
    wall0, t_kill = time.time(), time.monotonic()
    assert loop.emu.front is not None
    if notice:
        loop.emu.front.preempt(victim, 120.0)
    else:
        loop.emu.front.terminate(victim)
    # The survivor's agent once the loss is seen, before a relaunch reaches it.
    pid_after_loss = None
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if len(incidents(loop, job)) > n_before:
            pid_after_loss = agent_pid(loop, survivor)
            break
        time.sleep(0.5)
    s = wait_for(loop, job, "a validated resume",
                 lambda st, n, v, step, b: n > first and v is not None and step > v,
                 1200)  # fmt: skip
    kill_to_resumed = round(time.monotonic() - t_kill, 1)
    wall1 = time.time()
    inc = incidents(loop, job)[-1]
    sky_calls = read_call_log(calls, wall0, wall1)
    out = {
        "failure_class": inc.get("failure_class"),
        "mttr_s": inc.get("mttr_s", inc.get("mttr_seconds")),
        "steps": inc.get("step_seconds")
        or {x["step"]: x.get("seconds", x.get("duration_s")) for x in inc.get("steps", [])},
        "steps_lost": inc.get("steps_lost"),
        "kill_to_resumed_s": kill_to_resumed,
        "survivor": survivor,
        "survivor_instance_kept": survivor in running_ids(loop),
        "survivor_agent_pid": [pid_before, pid_after_loss, agent_pid(loop, survivor)],
        "sky_calls": sky_calls,
        "sky_calls_total": sum(sky_calls.values()),
    }
    log(f"{grouping}: {inc.get('failure_class')} {json.dumps(out)}")
    return out, s


def one_grouping(home: Path, grouping: str, steps: int) -> dict[str, Any]:
    calls = home / "sky-calls.jsonl"
    orig = skyconf.sky_env

    def sky_env(emu_home: Any, base: Any = None) -> dict[str, str]:
        env = dict(orig(emu_home, base))
        env["SKYRESUME_SKYPILOT_GROUPING"] = grouping
        env["SKYRESUME_SKYPILOT_CALL_LOG"] = str(calls)
        env["SKYRESUME_SKYPILOT_YAML_DIR"] = str(home)  # where SkyLoop writes the task
        return env

    skyconf.sky_env = sky_env
    out: dict[str, Any] = {"grouping": grouping}
    loop = SkyLoop(home, log=log)
    plain_get = loop.get

    def get(path: str) -> Any:
        # The service answers slowly when the machine is loaded (its SQLite is held
        # while the reconciler calls SkyPilot): a read that timed out is read again.
        for _ in range(10):
            try:
                return plain_get(path)
            except httpx.TimeoutException:
                log(f"GET {path} timed out; again")
        return plain_get(path)

    loop.get = get  # type: ignore[method-assign]
    try:
        t0 = time.monotonic()
        job = loop.submit(steps)
        out["job"] = job
        log(f"{grouping}: submitted {job}")
        wait_for(loop, job, "both nodes registered", lambda st, n, v, step, b: b >= 2, 900)
        out["launch_to_registered_s"] = round(time.monotonic() - t0, 1)
        s = wait_for(loop, job, "training past step 30",
                     lambda st, n, v, step, b: v is not None and step >= 30, 600)  # fmt: skip
        out["preemption"], s = incident(loop, grouping, job, s[1], calls, notice=True)
        s = wait_for(loop, job, "training on after the resume",
                     lambda st, n, v, step, b: v is not None and step >= v + 10, 600)  # fmt: skip
        out["node_loss"], s = incident(loop, grouping, job, s[1], calls, notice=False)
        out["kill_to_resumed_s"] = out["node_loss"]["kill_to_resumed_s"]
        survivor = out["node_loss"]["survivor"]
        # A crash mid-recovery: node 0 of the running attempt lost, the service killed
        # once it recorded the relaunch's request.
        ids_now = running_ids(loop)
        target = next((iid for iid in ids_now if iid == survivor), None)
        if target is None:  # node 0 of a new cluster
            target = rank_instance(loop, grouping, job, 0)
        assert loop.emu.front is not None
        log(f"{grouping}: terminating {target}, then SIGKILL of the service mid-recovery")
        loop.emu.front.terminate(target)
        kill2 = time.time()
        end = time.monotonic() + 600
        crashed_at = None
        while time.monotonic() < end:
            # Mid-recovery: the moment the service has submitted the relaunch.
            new = read_call_log(calls, kill2)
            if new.get("sky.launch") or new.get("sky.exec"):
                assert loop.proc is not None
                loop.proc.kill()
                loop.proc.wait()
                crashed_at = time.monotonic()
                out["crash_after_calls"] = new
                break
            time.sleep(0.2)
        if crashed_at is None:
            raise RuntimeError("the relaunch was never requested")
        time.sleep(60)
        left = loop.instances()
        out["after_crash"] = {
            "instances": len(left),
            "sky_clusters": loop.sky_status(),
        }
        out["after_crash"]["clusters"] = len(out["after_crash"]["sky_clusters"])
        log(f"{grouping}: after the crash {json.dumps(out['after_crash'])}")
        return out
    finally:
        skyconf.sky_env = orig
        (home / "figures.json").write_text(json.dumps(out, indent=2, default=str))
        loop.close()


def ratio(b: Any, a: Any) -> float | None:
    try:
        return round(float(b) / float(a), 3)
    except (TypeError, ValueError, ZeroDivisionError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--only", choices=("attempt", "node"), default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("the emulated AWS's hosts need root", file=sys.stderr)
        return 1
    # Stoppable however it was started (a background job ignores SIGINT): either
    # signal unwinds through SkyLoop.close(), which gives every instance back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    home = args.home or Path(tempfile.mkdtemp(prefix="skyresume-grouping-"))
    res: dict[str, Any] = {}
    for grouping in ("attempt", "node"):
        if args.only and grouping != args.only:
            continue
        res[grouping] = one_grouping(home / grouping, grouping, args.steps)
    doc: dict[str, Any] = {"bench": "skypilot-grouping", **res}
    if "attempt" in res and "node" in res:
        a, b = res["attempt"], res["node"]
        doc["ratios_b_over_a"] = {
            "node_loss_mttr": ratio(b["node_loss"]["mttr_s"], a["node_loss"]["mttr_s"]),
            "preemption_mttr": ratio(b["preemption"]["mttr_s"], a["preemption"]["mttr_s"]),
            "preemption_sky_calls": ratio(
                b["preemption"]["sky_calls_total"], a["preemption"]["sky_calls_total"]
            ),
            "kill_to_resumed": ratio(b["kill_to_resumed_s"], a["kill_to_resumed_s"]),
            "sky_calls_per_incident": ratio(
                b["node_loss"]["sky_calls_total"], a["node_loss"]["sky_calls_total"]
            ),
            "launch_to_registered": ratio(b["launch_to_registered_s"], a["launch_to_registered_s"]),
        }
    print(json.dumps(doc, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
