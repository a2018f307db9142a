"""The recovery loop through SkyPilot's real provisioner on the emulated AWS.

What ``skyresume demo --launcher skypilot`` and tests/awsemu/test_loop_e2e.py run:
the emulated AWS (moto behind the fault front, instances as hosts, SkyPilot's own API
server on loopback: docs/awsemu.md), a SeaweedFS S3 server on the hosts' bridge as the
checkpoint store, and ``skyresume serve`` with ``SKYRESUME_LAUNCHER=skypilot``, run as
a user runs it: SkyPilot's client environment is the emulator's (its endpoint and
fake credentials, ``skyconf.sky_env``), the public URL is the bridge's gateway (a
private address, so plain http is allowed), and nothing else of the service is
changed. The job is a user's SkyPilot task (``task.skypilot_yaml``), so that its
``envs``/``secrets`` carry the S3 endpoint and keys to the nodes as a user's would;
the launcher wraps it in the gpt-cpu template's setup and run (the agent installed
from the service's wheel, ``pip --no-index --no-deps``).

Root only (namespaces, sshd), and the node template must be prepared
(``scripts/awsemu-prepare``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: moto's built-in AMI: the emulated catalog maps every ``skypilot:*`` image to it,
#: and the launcher refuses a task that names no image (SkyPilot's has no torch).
EMULATED_AMI = "ami-785db401"
#: Nodes reach the wheel cache of the node template (no internet on the bridge).
NODE_WHEELS = "$HOME/.skyresume-awsemu/wheels"


class LoopError(RuntimeError):
    pass


def task_yaml(
    *, s3_endpoint: str, keys: tuple[str, str], steps: int, instance_type: str = "m6i.large",
    train_args: str = "--step-sleep 0.2",
) -> str:
    """The user's SkyPilot task: CPU spot nodes on AWS, the S3 store's endpoint and
    keys for the node's checkpoint client, boto3 installed from the node's own wheel
    cache (the image has torch, not boto3), and the GPT run (``train_args``: more of
    ``train_gpt``'s arguments)."""
    import yaml

    doc = {
        "resources": {"infra": "aws", "instance_type": instance_type, "use_spot": True},
        "envs": {"SKYRESUME_S3_ENDPOINT_URL": s3_endpoint, "AWS_DEFAULT_REGION": "us-east-1"},
        "secrets": {"AWS_ACCESS_KEY_ID": keys[0], "AWS_SECRET_ACCESS_KEY": keys[1]},
        "setup": (
            f'python3 -m pip install --quiet --no-index --find-links "{NODE_WHEELS}" boto3\n'
        ),
        "run": f"python3 -m training.examples.train_gpt --max-steps {steps} {train_args}\n",
    }
    return yaml.safe_dump(doc, sort_keys=False)


def job_spec(task_path: Path, checkpoint_uri: str) -> dict[str, Any]:
    return {
        "name": "sky-gpt",
        "task": {"skypilot_yaml": str(task_path)},
        "num_nodes": 2,
        "ranks_per_node": 1,
        "spot": True,
        "checkpoint": {"uri": checkpoint_uri, "every_steps": 10, "keep": 3, "adaptive": False},
        "restarts": {"max_restarts": 5, "heartbeat_timeout_s": 30, "grace_period_s": 60},
    }


class SkyLoop:
    """The emulator, the S3 server and the service; ``close`` stops all three and
    gives back every instance left."""

    def __init__(self, home: Path, *, log: Any = None, env: dict[str, str] | None = None) -> None:
        """``env``: more ``SKYRESUME_*`` settings for the service (e.g. the grouping)."""
        from orchestrator.awsemu import emulator, skyconf

        extra = env
        from orchestrator.cloud.seaweed import start as seaweed
        from orchestrator.launchers.local import free_port

        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.proc: subprocess.Popen[bytes] | None = None
        self.s3: Any = None
        self.emu = emulator.start(home / "emu", with_hosts=True, with_sky=True)
        try:
            assert self.emu.pool is not None
            self.gateway = self.emu.pool.gateway
            self.keys = (f"loop-{os.getpid()}", os.urandom(16).hex())
            self.s3 = seaweed(host=self.gateway, port=free_port(), data_dir=home / "s3",
                              bucket="checkpoints", access_key=self.keys[0],
                              secret_key=self.keys[1])  # fmt: skip
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            base = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
            env = skyconf.sky_env(self.emu.home, base)
            env.update(
                SKYRESUME_HOME=str(home / "service"),
                SKYRESUME_HOST="0.0.0.0",
                SKYRESUME_PORT=str(self.port),
                SKYRESUME_PUBLIC_URL=f"http://{self.gateway}:{self.port}",
                SKYRESUME_LAUNCHER="skypilot",
                SKYRESUME_RECONCILE="true",
                SKYRESUME_SKYPILOT_IMAGE_ID=EMULATED_AMI,
                SKYRESUME_SKYPILOT_YAML_DIR=str(home),  # where submit writes task.yaml
                SKYRESUME_PIP_ARGS="--no-index",
                # The service's own reads of checkpoints (CONFIRM): SeaweedFS, not moto.
                SKYRESUME_S3_ENDPOINT_URL=self.s3.endpoint_url,
                AWS_ACCESS_KEY_ID=self.keys[0],
                AWS_SECRET_ACCESS_KEY=self.keys[1],
            )
            env.update(extra or {})
            self.env = env
            self.service_log = open(home / "service.log", "ab")  # noqa: SIM115 - close()
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve"],
                                         env=env, stdout=self.service_log,
                                         stderr=subprocess.STDOUT)  # fmt: skip
            self.http = self._wait_ready()
        except BaseException:
            self.close()
            raise

    @property
    def checkpoint_uri(self) -> str:
        return f"s3://{self.s3.bucket}/sky-gpt"

    def _wait_ready(self, timeout_s: float = 90) -> Any:
        import httpx

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise LoopError(f"the service exited ({self.proc.returncode}); "
                                f"see {self.home / 'service.log'}")  # fmt: skip
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    token = (self.home / "service" / "token").read_text().strip()
                    return httpx.Client(base_url=self.url, timeout=30,
                                        headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            time.sleep(0.3)
        raise LoopError(f"the service did not become ready in {timeout_s:.0f} s")

    def submit(self, steps: int) -> str:
        # Where the service reads task files from (SKYRESUME_SKYPILOT_YAML_DIR, unset:
        # <SKYRESUME_HOME>/tasks); a file elsewhere is refused (422).
        path = self.home / "service" / "tasks" / "task.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(task_yaml(s3_endpoint=self.s3.endpoint_url, keys=self.keys,
                                  steps=steps))  # fmt: skip
        r = self.http.post("/v1/jobs", json=job_spec(path, self.checkpoint_uri))
        if r.status_code >= 400:
            raise LoopError(f"submit: HTTP {r.status_code}: {r.text[:500]}")
        return str(r.json()["id"])

    def get(self, path: str) -> Any:
        import httpx

        # A read the service could not answer in 30 s (on SQLite the reconciler's
        # transaction holds the write lock while a SkyPilot call is bounded at 30 s)
        # is asked again a few times: the loop watches, it must not end on one stall.
        for left in range(3, -1, -1):
            try:
                r = self.http.get(path)
                break
            except httpx.TimeoutException:
                if not left:
                    raise LoopError(f"GET {path}: the service did not answer in 4 tries") from None
                self.log(f"  GET {path} timed out; asking again")
        if r.status_code >= 400:
            raise LoopError(f"GET {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def instances(self, *, cluster: str | None = None) -> list[dict[str, Any]]:
        """Pending or running instances in every emulated region (of ``cluster``)."""
        out = []
        for region in self.emu.regions:
            ec2 = self.emu.boto3_client("ec2", region)
            found = ec2.describe_instances(
                Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
            )
            for r in found["Reservations"]:
                for i in r["Instances"]:
                    tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
                    # SkyPilot's name on the cloud is the cluster's plus a user hash.
                    if cluster is None or any(str(v).startswith(cluster) for v in tags.values()):
                        out.append({**i, "region": region, "tags": tags})
        return out

    def sky_status(self) -> list[str]:
        """Cluster names ``sky status`` lists (SkyPilot's own CLI, its API server)."""
        sky = str(Path(sys.executable).parent / "sky")
        env = {k: v for k, v in self.env.items() if not k.startswith("SKYRESUME_")}
        p = subprocess.run([sky, "status", "--refresh"], env=env, cwd=env["HOME"],
                           capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)  # fmt: skip
        names = []
        for line in p.stdout.splitlines():
            word = line.split()[0] if line.split() else ""
            if word.startswith("sr-"):
                names.append(word)
        return names

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None
        self.emu.stop()
        with contextlib.suppress(Exception):
            self.service_log.close()


def job_state(loop: Any, job: str) -> tuple[str, int, int | None, int, int]:
    """(status, newest attempt, its validated step, highest rank step, nodes with a
    heartbeat in it)."""
    st = loop.get(f"/v1/jobs/{job}")["status"]
    atts = loop.get(f"/v1/jobs/{job}/attempts")["items"]
    if not atts:
        return st, 0, None, -1, 0
    a = atts[-1]
    steps = [r.get("step") for n in a["nodes"] for r in n["ranks"] if r.get("step") is not None]
    beating = sum(1 for n in a["nodes"] if n.get("last_heartbeat_at"))
    return st, a["number"], a["validated_step"], max(steps, default=-1), beating


def wait_for(loop: Any, job: str, what: str, until: Any, timeout_s: float) -> tuple[Any, ...]:
    end = time.monotonic() + timeout_s
    shown = None
    while time.monotonic() < end:
        s = job_state(loop, job)
        if s != shown:
            loop.log(f"  {s[0]:12} attempt {s[1]}  validated at {s[2]}  step {s[3]}  "
                     f"nodes beating {s[4]}")  # fmt: skip
            shown = s
        if until(*s):
            return s
        if s[0] in ("FAILED", "CANCELLED", "SUCCEEDED"):
            raise LoopError(f"job {job} ended {s[0]} while waiting for {what}: "
                            f"{loop.get(f'/v1/jobs/{job}').get('status_reason')}")  # fmt: skip
        time.sleep(0.5)
    raise LoopError(f"timed out after {timeout_s:.0f} s waiting for {what}")


#: The faults :func:`run_loop` can inject, in the order it injects them (one job's
#: life): ``capacity`` before the submit (the planner's first region refuses
#: RunInstances), then ``transport`` (a rank's collective breaks: a restart in place),
#: ``notice`` (a spot interruption notice on a worker), ``terminate`` (a worker's
#: instance gone with no notice); the job then succeeds, or with ``cancel`` is
#: cancelled.
FAULTS = ("capacity", "transport", "notice", "terminate", "cancel")
#: The region the planner places the m6i.large spot job in first (its spot price ties
#: us-west-2's, and the planner ranks it first; the capacity fault checks it did).
FIRST_REGION = "us-east-1"


def sky_requests(loop: SkyLoop) -> list[dict[str, Any]]:
    """Every request SkyPilot's API server holds (name, cluster, status, created_at),
    asked of it with SkyPilot's own SDK in a process of its own (the emulator's client
    environment)."""
    env = {k: v for k, v in loop.env.items() if not k.startswith("SKYRESUME_")}
    code = (
        "import json, sky\n"
        "rs = sky.api_status(all_status=True)\n"
        "print(json.dumps([{'name': r.name, 'cluster': r.cluster_name, 'status': str(r.status),"
        " 'created_at': r.created_at} for r in rs]))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=env["HOME"],
                       capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    if p.returncode != 0:
        raise LoopError(f"sky.api_status: {p.stderr.strip()[-500:]}")
    return list(json.loads(p.stdout.strip().splitlines()[-1]))


def _launches(requests: list[dict[str, Any]], since: float) -> dict[str, int]:
    """How many sky.launch / sky.exec requests were made after ``since`` (epoch s)."""
    out = {"sky.launch": 0, "sky.exec": 0}
    for r in requests:
        if r["name"] in out and float(r["created_at"]) >= since:
            out[r["name"]] += 1
    return out


def _attempt(loop: SkyLoop, job: str, number: int) -> dict[str, Any]:
    atts = loop.get(f"/v1/jobs/{job}/attempts")["items"]
    return next(a for a in atts if a["number"] == number)


def _worker(loop: SkyLoop, job: str) -> str:
    """The instance id of the job's newest worker (SkyPilot's non-head node): that of
    the cluster running the current attempt. Neither the cluster's name (a restart in
    place keeps an older attempt's cluster, a fallback launch is ``-t1``) nor the
    attempt's hosts (SkyPilot's handle has none at submit) says which, but the newest
    launch does: an older cluster's instances were launched before it."""
    mine = [i for i in loop.instances(cluster=f"sr-{job}-")
            if i["tags"].get("ray-node-type") == "worker"]  # fmt: skip
    if not mine:
        raise LoopError(f"no worker instance of {job} is running")
    return str(max(mine, key=lambda i: i["LaunchTime"])["InstanceId"])


def run_loop(
    home: Path,
    *,
    steps: int = 150,
    window_s: float = 120.0,
    faults: tuple[str, ...] = ("notice",),
    log: Any = None,
) -> dict[str, Any]:
    """Issue 19's loop: launch, then each of ``faults`` (see FAULTS) with its
    recovery, in FAULTS' order; the figures, as a dict (also ``home/figures.json``).
    Raises LoopError naming what did not happen."""
    from orchestrator.awsemu.front import CapacityRule

    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
    figures: dict[str, Any] = {"faults": [f for f in FAULTS if f in faults]}
    loop = SkyLoop(home, log=log)

    def resumed_after(job: str, number: int, what: str) -> tuple[Any, ...]:
        return wait_for(loop, job, what,
                        lambda st, n, v, step, b: n > number and v is not None and step > v,
                        1200)  # fmt: skip

    def trained_on(job: str, what: str) -> tuple[Any, ...]:
        return wait_for(loop, job, what,
                        lambda st, n, v, step, b: v is not None and step >= v + 10,
                        600)  # fmt: skip

    try:
        front = loop.emu.front
        assert front is not None
        if "capacity" in faults:
            loop.log(f"capacity: RunInstances of m6i.large refused in {FIRST_REGION}")
            front.add_capacity_rule(CapacityRule(region=FIRST_REGION, instance_type="m6i.large"))
        t0 = time.monotonic()
        job = loop.submit(steps)
        figures["job"] = job
        loop.log(f"submitted {job}: 2 nodes x 1 CPU rank through SkyPilot")
        wait_for(loop, job, "both nodes registered", lambda st, n, v, step, b: b >= 2, 900)
        figures["launch_to_registered_s"] = round(time.monotonic() - t0, 1)
        s = wait_for(loop, job, "training past step 20",
                     lambda st, n, v, step, b: v is not None and step >= 20, 600)  # fmt: skip
        figures["launch_to_step20_s"] = round(time.monotonic() - t0, 1)
        first = _attempt(loop, job, s[1])
        figures["first_region"] = first["region"]
        if "capacity" in faults:
            events = loop.get(f"/v1/jobs/{job}/events?limit=500")["items"]
            figures["refused_at_launch"] = [
                {"region": e["details"].get("region"), "capacity": e["details"].get("capacity"),
                 "message": e["message"]}
                for e in events if e["kind"] == "launch_failed"
            ]  # fmt: skip
            figures["capacity_refusals"] = front.snapshot()["counts"]
            front.clear_capacity()
        if "transport" in faults:
            since = time.time()
            before_ids = sorted(i["InstanceId"] for i in loop.instances(cluster=f"sr-{job}-"))
            loop.log("transport: rank 0 of node 0 fails its collective (chaos transport)")
            r = loop.http.post(f"/v1/jobs/{job}/chaos",
                               json={"action": "transport", "node": 0, "rank": 0})  # fmt: skip
            if r.status_code >= 400:
                raise LoopError(f"chaos transport: HTTP {r.status_code}: {r.text[:300]}")
            before = s[1]
            s = resumed_after(job, before, "a validated resume after the transport error")
            after = _attempt(loop, job, s[1])
            figures["transport"] = {
                "attempt": after["number"], "launch_verb": after["launch_verb"],
                "in_place": after["in_place"], "instances_before": before_ids,
                "instances_after": sorted(i["InstanceId"]
                                          for i in loop.instances(cluster=f"sr-{job}-")),
                "sky_requests": _launches(sky_requests(loop), since),
            }  # fmt: skip
        if "notice" in faults:
            if "transport" in faults:
                s = trained_on(job, "training on after the restart")
            victim = _worker(loop, job)
            loop.log(f"spot interruption notice on {victim} ({window_s:.0f} s window)")
            front.preempt(victim, window_s)
            s = resumed_after(job, s[1], "a validated resume after the preemption")
        if "terminate" in faults:
            # An instance gone with no notice (EC2 TerminateInstances): its agent's
            # heartbeats stop, and the service finds the node lost.
            s = trained_on(job, "training on after the resume")
            victim = _worker(loop, job)
            loop.log(f"instance {victim} terminated without a notice")
            front.terminate(victim)
            s = resumed_after(job, s[1], "a validated resume after the termination")
        if "cancel" in faults:
            s = wait_for(loop, job, "training on before the cancel",
                         lambda st, n, v, step, b: v is not None and step >= v + 5,
                         600)  # fmt: skip
            loop.log(f"cancel {job}")
            r = loop.http.post(f"/v1/jobs/{job}/cancel")
            if r.status_code >= 400:
                raise LoopError(f"cancel: HTTP {r.status_code}: {r.text[:300]}")
            wait_for(loop, job, "cancelled", lambda st, n, v, step, b: st == "CANCELLED", 120)
        else:
            wait_for(loop, job, "the end", lambda st, n, v, step, b: st == "SUCCEEDED", 900)
        figures["status"] = loop.get(f"/v1/jobs/{job}")["status"]
        figures["total_s"] = round(time.monotonic() - t0, 1)
        figures["incidents"] = loop.get(f"/v1/jobs/{job}/incidents")["items"]
        figures["attempts"] = loop.get(f"/v1/jobs/{job}/attempts")["items"]
        # The service tears an ended job's clusters down (sky.down, confirmed); the
        # emulator is this loop's alone, so any instance left is the job's.
        t1 = time.monotonic()
        end = t1 + 600
        while loop.instances() and time.monotonic() < end:
            time.sleep(2)
        figures["teardown_s"] = round(time.monotonic() - t1, 1)
        figures["instances_left"] = [i["InstanceId"] for i in loop.instances()]
        figures["sky_clusters_left"] = loop.sky_status()
        figures["sky_requests"] = _launches(sky_requests(loop), 0)
        return figures
    finally:
        (home / "figures.json").write_text(json.dumps(figures, indent=2, default=str))
        loop.close()


def loop_problems(figures: dict[str, Any]) -> list[str]:
    """What a :func:`run_loop` with every fault (FAULTS) shows went wrong; [] when
    nothing did. The demo prints these; tests/awsemu/test_loop_e2e.py asserts them
    one by one."""
    problems = []
    incs = figures["incidents"]
    classes = [i["failure_class"] for i in incs]
    if classes != ["nccl_transport", "preemption_notice", "node_lost"]:
        problems.append(f"expected nccl_transport, preemption_notice, node_lost; got {classes}")
    if figures.get("first_region") == FIRST_REGION:
        problems.append(f"the first attempt ran in {FIRST_REGION}, which had no capacity")
    if not any(r["capacity"] and r["region"] == FIRST_REGION
               for r in figures.get("refused_at_launch", [])):  # fmt: skip
        problems.append(f"no launch refused for capacity in {FIRST_REGION}")
    tr = figures.get("transport") or {}
    if not (tr.get("in_place") and tr.get("instances_before") == tr.get("instances_after")):
        problems.append(f"the transport error did not restart in place: {tr}")
    if tr.get("sky_requests", {}).get("sky.launch", 1) != 0:
        problems.append(f"the restart in place asked SkyPilot for a launch: {tr}")
    for i in incs:
        v = next((s for s in i["steps"] if s["step"] == "validate"), None)
        if v is None or v["outcome"] != "ok":
            problems.append(f"incident {i['id']} ({i['failure_class']}) did not validate")
    notice = next((i for i in incs if i["failure_class"] == "preemption_notice"), None)
    if notice is not None and notice["steps_lost"]:
        problems.append(f"the preemption lost {notice['steps_lost']} steps")
    if figures.get("status") != "CANCELLED":
        problems.append(f"the job ended {figures.get('status')}, not CANCELLED")
    if figures["instances_left"] or figures["sky_clusters_left"]:
        problems.append(f"left behind: {figures['instances_left']} {figures['sky_clusters_left']}")
    return problems


def run_demo(home: Path | None = None, steps: int = 150) -> int:
    """``skyresume demo --launcher skypilot``: :func:`run_loop`, then the incident
    table; 0 only when the job succeeded, the resume was validated and no step lost."""
    import tempfile

    from orchestrator.demo import console
    from orchestrator.incident_report import incident_table

    if os.geteuid() != 0:
        console.print("[red]demo failed:[/red] the emulated AWS's hosts need root")
        return 1
    home = Path(home) if home else Path(tempfile.mkdtemp(prefix="skyresume-skydemo-"))
    console.print(f"[bold]skyresume demo --launcher skypilot[/bold]: state in {home}")
    try:
        figures = run_loop(home, steps=max(steps, 5000), faults=FAULTS, log=console.print)
    except (LoopError, OSError, RuntimeError) as e:
        console.print(f"[red]demo failed:[/red] {e}")
        console.print(f"logs: {home / 'service.log'}, {home / 'emu'}")
        return 1
    incs = figures["incidents"]
    console.print(incident_table(incs))
    console.print(f"launch request to both nodes registered: {figures['launch_to_registered_s']} s")
    problems = loop_problems(figures)
    for p in problems:
        console.print(f"[red]check failed:[/red] {p}")
    if not problems:
        console.print(
            "[green]demo passed[/green]: through SkyPilot, every fault recovered, nothing left"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    out = run_loop(Path(sys.argv[1]), steps=2000, faults=FAULTS)
    print(json.dumps(out, indent=2, default=str))
