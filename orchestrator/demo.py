"""``skyresume demo``: the whole recovery loop on this machine, on embedded defaults,
on the path a cloud takes.

It starts ``skyresume serve`` (SQLite, local launcher, reconciler on) in a fresh
state directory and a real S3 server (SeaweedFS) as the checkpoint store. Each node
is a host of its own (a network namespace with its own IP and its provider's
metadata endpoint at the real link-local address; where namespaces cannot be made,
the nodes share loopback and the demo says so), provisioned by the same SkyPilot
task a cloud runs: its setup installs the agent from the service's own wheel, its
run starts the agent. It submits a 2-node x 2-rank CPU GPT job (gloo) that
checkpoints to ``s3://``, then:

1. a spot preemption notice on node 1: the ranks save, the healthy node 0 stays
   provisioned and one replacement joins it (no step lost);
2. node 0 killed outright (every process, SIGKILL): resumed from the last periodic
   checkpoint, staged from S3 by each new node itself;
3. node 1's link taken down (a real partition; with namespaces only): its heartbeats
   stop, it is replaced, and nothing it could still write is resumed.

The service recovers from each on its own; the demo only watches, prints the
incident table and checks the outcome: it exits 0 only when training finished and
every resume was validated on every rank (and the preemption lost no step).

``skyresume demo --elastic`` (orchestrator/demo_elastic.py) runs an elastic job on
this service instead; ``--launcher skypilot`` (orchestrator/demo_skypilot.py) goes
through SkyPilot on the emulated AWS.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from orchestrator.incident_report import incident_table

# Wide enough for the incident table even when stderr is not a terminal.
console = Console(stderr=True, width=max(Console(stderr=True).width, 120))


class DemoError(RuntimeError):
    pass


#: A model profile for the demo's GPT the memory planner can step down (1 layer, a
#: global batch of 8 over 4 ranks): what the OOM chaos runs re-plan.
TINY_MODEL: dict[str, Any] = {
    "parameters": 200_000,
    "layers": 1,
    "hidden_size": 64,
    "heads": 2,
    "seq_len": 32,
    "global_batch": 8,
    "micro_batch": 2,
    "dtype": "fp32",
}


def job_spec(home: Path, steps: int, checkpoint_uri: str | None = None) -> dict[str, Any]:
    cmd = (
        f"{sys.executable} -m training.examples.train_gpt --max-steps {steps} "
        f"--step-sleep 0.1 --save-final {home / 'final_weights.pt'}"
    )
    return {
        "name": "demo-gpt",
        "task": {"template": "gpt-cpu", "command": cmd},
        "num_nodes": 2,
        "ranks_per_node": 2,
        "spot": True,
        # Every 10 steps, fixed: the advisor would stretch it to hours for 4 CPU ranks
        # (MTBF at Llama 3's rate), and the demo wants to show steps lost on a kill.
        "checkpoint": {
            "uri": checkpoint_uri or f"file://{home / 'checkpoints'}",
            "every_steps": 10,
            "keep": 3,
            "adaptive": False,
        },
        "restarts": {"max_restarts": 5, "heartbeat_timeout_s": 20, "grace_period_s": 60},
    }


def node_gateway(home: Path) -> tuple[str, str]:
    """(the address nodes reach this machine at, how nodes are hosts here) for a service
    with this home: the bridge's gateway with namespaces, else loopback."""
    import ipaddress

    from orchestrator.server import local_bridge, local_network
    from orchestrator.settings import Settings

    settings = Settings(home=home, launcher="local")
    mode, why = local_network(settings)
    if mode != "netns":
        return "127.0.0.1", why
    return str(ipaddress.ip_network(local_bridge(settings)[1])[1]), why


class DemoService:
    def __init__(
        self,
        home: Path,
        env: dict[str, str] | None = None,
        *,
        s3: bool = False,
        port: int | None = None,
    ) -> None:
        """``env``: more ``SKYRESUME_*`` settings for the service (e.g. its regions).
        ``s3``: a SeaweedFS S3 server is the checkpoint store (``checkpoint_uri``),
        listening where the nodes reach this machine."""
        from orchestrator.launchers.local import free_port

        self.home = home
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gateway, self.network = node_gateway(home)
        self.s3: Any = None
        self._s3_port = free_port() if s3 else 0
        self._s3_keys = (f"demo-{os.getpid()}", os.urandom(16).hex())
        proc_env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
        if s3:
            # The service reads checkpoints (CONFIRM) and hands nodes the same endpoint
            # and keys as task secrets; the server itself starts once the bridge is up.
            proc_env.update(
                SKYRESUME_S3_ENDPOINT_URL=f"http://{self.gateway}:{self._s3_port}",
                AWS_ACCESS_KEY_ID=self._s3_keys[0],
                AWS_SECRET_ACCESS_KEY=self._s3_keys[1],
                AWS_DEFAULT_REGION="us-east-1",
            )
        proc_env.update(env or {})
        proc_env.update(
            SKYRESUME_HOME=str(home),
            SKYRESUME_PORT=str(self.port),
            SKYRESUME_RECONCILE="true",
            SKYRESUME_LAUNCHER="local",
        )
        self._proc_env = proc_env
        self.log = open(home / "service.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = self._serve()

    def _serve(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve"],
            env=self._proc_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def restart(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> Any:
        """Stop the service process alone (``sig``: SIGTERM as a process manager's
        restart, SIGKILL as a crash) and start it again on the same home, port and
        settings; the nodes and the S3 server keep running. Returns the new client."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = self._serve()
        return self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 60) -> Any:
        import httpx

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise DemoError(f"the service exited ({self.proc.returncode}); see service.log")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    self._start_s3()
                    token = (self.home / "token").read_text().strip()
                    return httpx.Client(
                        base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
                    )
            time.sleep(0.2)
        raise DemoError(f"the service did not become ready in {timeout_s:.0f} s")

    @property
    def checkpoint_uri(self) -> str | None:
        return f"s3://{self.s3.bucket}/demo-gpt" if self.s3 is not None else None

    def _start_s3(self) -> None:
        if not self._s3_port or self.s3 is not None:
            return
        from orchestrator.cloud.seaweed import SeaweedError, start

        try:
            self.s3 = start(
                host=self.gateway, port=self._s3_port, data_dir=self.home / "s3",
                bucket="checkpoints", access_key=self._s3_keys[0], secret_key=self._s3_keys[1],
            )  # fmt: skip
        except SeaweedError as e:
            raise DemoError(f"the S3 server (SeaweedFS) did not start: {e}") from None

    def stop(self) -> None:
        """Stop the service, then give back every node it left running (the service
        itself leaves them, as a cloud's VMs outlive the control plane) and the S3
        server."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        release_local_nodes(
            self.home,
            bridge=self._proc_env.get("SKYRESUME_LOCAL_BRIDGE", ""),
            subnet=self._proc_env.get("SKYRESUME_LOCAL_SUBNET", ""),
        )
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None
        self.log.close()


def release_local_nodes(home: Path, *, bridge: str = "", subnet: str = "") -> int:
    """Every process and host the local launcher of a service on ``home`` left behind,
    given back (launchers.local.release_everything); how many processes were killed."""
    from orchestrator.launchers.local import release_everything
    from orchestrator.server import local_bridge, local_network
    from orchestrator.settings import Settings

    root = home / "local-nodes"
    if not root.is_dir():
        return 0
    settings = Settings(home=home, launcher="local", local_bridge=bridge, local_subnet=subnet)
    fabric = None
    if (root / "fabric").is_dir() and local_network(settings)[0] == "netns":
        from orchestrator.launchers.netns import Fabric

        bridge, subnet = local_bridge(settings)
        fabric = Fabric(root / "fabric", bridge=bridge, subnet=subnet)
    return release_everything(root, fabric)


def api_get(http: Any, path: str) -> Any:
    r = http.get(path)
    if r.status_code >= 400:
        raise DemoError(f"GET {path}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def api_post(http: Any, path: str, body: dict[str, Any]) -> Any:
    r = http.post(path, json=body)
    if r.status_code >= 400:
        raise DemoError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def job_state(http: Any, job: str) -> tuple[str, int, int | None, int]:
    """(status, newest attempt, its validated step, its highest rank step)."""
    st = api_get(http, f"/v1/jobs/{job}")["status"]
    atts = api_get(http, f"/v1/jobs/{job}/attempts")["items"]
    if not atts:
        return st, 0, None, -1
    a = atts[-1]
    steps = [r.get("step") for n in a["nodes"] for r in n["ranks"] if r.get("step") is not None]
    return st, a["number"], a["validated_step"], max(steps, default=-1)


def wait_for(http: Any, job: str, what: str, until: Any, deadline: float) -> tuple[Any, ...]:
    shown = None
    while time.monotonic() < deadline:
        s = job_state(http, job)
        if s != shown:
            status, n, validated, step = s
            console.print(
                f"  [dim]{status:12} attempt {n}  validated at {validated}  step {step}[/dim]"
            )
            shown = s
        if s[0] in ("FAILED", "CANCELLED") or (s[0] == "SUCCEEDED" and what != "the end"):
            return s
        if until(*s):
            return s
        time.sleep(0.5)
    raise DemoError(f"timed out waiting for {what}")


def run_demo(home: Path | None = None, steps: int = 120, timeout_s: float = 900.0) -> int:
    home = Path(home) if home else Path(tempfile.mkdtemp(prefix="skyresume-demo-"))
    home.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    console.print(f"[bold]skyresume demo[/bold]: state in {home}")
    svc = DemoService(home, s3=True)
    job = None
    http = None
    try:
        http = svc.wait_ready()
        announce(svc)
        if svc.gateway == "127.0.0.1":
            console.print("[yellow]no network namespaces: the partition step is skipped[/yellow]")
        console.print(f"checkpoints: {svc.checkpoint_uri} (SeaweedFS S3 at {svc.s3.endpoint_url})")
        job = api_post(http, "/v1/jobs", job_spec(home, steps, svc.checkpoint_uri))["id"]
        console.print(f"submitted job {job}: 2 nodes x 2 CPU ranks (gloo), {steps} steps")

        console.print("[bold]1.[/bold] waiting for training to pass step 30")
        s = wait_for(
            http, job, "step 30", lambda st, n, v, step: v is not None and step >= 30, deadline
        )
        if s[0] != "RUNNING":
            raise DemoError(f"job is {s[0]} before the first failure")
        console.print("[bold]2.[/bold] spot preemption notice (AWS format) on node 1")
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "preempt", "node": 1})
        first = s[1]
        s = wait_for(
            http,
            job,
            "recovery from the preemption",
            lambda st, n, v, step: n > first and v is not None and step >= v + 25,
            deadline,
        )
        if s[0] != "RUNNING":
            raise DemoError(f"job is {s[0]} after the preemption")
        console.print("[bold]3.[/bold] node 0 killed without notice (every process, SIGKILL)")
        api_post(http, f"/v1/jobs/{job}/chaos", {"action": "kill-node", "node": 0})
        second = s[1]
        s = wait_for(
            http,
            job,
            "recovery from the node loss",
            lambda st, n, v, step: n > second and v is not None,
            deadline,
        )
        if svc.gateway != "127.0.0.1":
            s = wait_for(
                http, job, "training on", lambda st, n, v, step: v is not None and step >= v + 10,
                deadline,
            )  # fmt: skip
            console.print("[bold]4.[/bold] node 1's link taken down (a network partition)")
            api_post(http, f"/v1/jobs/{job}/chaos", {"action": "partition", "node": 1})
            third = s[1]
            s = wait_for(
                http, job, "recovery from the partition",
                lambda st, n, v, step: n > third and v is not None, deadline,
            )  # fmt: skip
        console.print("[bold]5.[/bold] training on to the end")
        s = wait_for(http, job, "the end", lambda st, n, v, step: st == "SUCCEEDED", deadline)
        return _report(http, job, svc, home, incident_table)
    except DemoError as e:
        return demo_failed(e, http, job, home)
    finally:
        wind_down(svc, http, job)


def announce(svc: DemoService) -> None:
    console.print(f"service up at {svc.url} (SQLite, local launcher, reconciler on)")
    console.print(f"nodes: {svc.network}")


def demo_failed(e: DemoError, http: Any, job: str | None, home: Path) -> int:
    """Say why, with the incidents so far and where the logs are; the exit status."""
    console.print(f"[red]demo failed:[/red] {e}")
    if http is not None and job is not None:
        with contextlib.suppress(Exception):
            console.print(incident_table(api_get(http, f"/v1/jobs/{job}/incidents")["items"]))
    console.print(f"logs: {home / 'service.log'}, {home / 'local-nodes'}")
    return 1


def wind_down(svc: DemoService, http: Any, job: str | None) -> None:
    """Cancel the job unless it ended, then stop the service and give back its nodes."""
    if http is not None and job is not None:
        with contextlib.suppress(Exception):
            if api_get(http, f"/v1/jobs/{job}")["status"] not in ("SUCCEEDED", "FAILED"):
                http.post(f"/v1/jobs/{job}/cancel")
                time.sleep(3)  # the reconciler tears the nodes down
    svc.stop()


def incident_step(incident: dict[str, Any], step: str) -> dict[str, Any] | None:
    """One protocol step of an incident (``GET .../incidents``), None before it started."""
    return next((s for s in incident["steps"] if s["step"] == step), None)


def step_detail(incident: dict[str, Any], step: str) -> str:
    return str((incident_step(incident, step) or {}).get("detail") or "")


def _select(incident: dict[str, Any]) -> str:
    return step_detail(incident, "select_replacement")


def _report(http: Any, job: str, svc: DemoService, home: Path, incident_table: Any) -> int:
    j = api_get(http, f"/v1/jobs/{job}")
    incs = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
    console.print(incident_table(incs))
    problems = []
    if j["status"] != "SUCCEEDED":
        problems.append(f"job ended {j['status']}: {j.get('status_reason')}")
    classes = [i["failure_class"] for i in incs]
    want = ["preemption_notice", "node_lost"] + (
        ["node_lost"] if svc.gateway != "127.0.0.1" else []
    )
    if classes[: len(want)] != want:
        problems.append(f"expected {', '.join(want)}, got {classes}")
    if svc.gateway != "127.0.0.1" and incs and "keep the 1 healthy node" not in _select(incs[0]):
        problems.append(f"the preemption did not keep the healthy node: {_select(incs[0])}")
    for i in incs:
        v = next((s for s in i["steps"] if s["step"] == "validate"), None)
        if v is None or v["outcome"] != "ok":
            problems.append(f"incident {i['id']} ({i['failure_class']}) did not validate")
    if incs and incs[0]["failure_class"] == "preemption_notice" and incs[0]["steps_lost"] != 0:
        problems.append(f"the preemption lost {incs[0]['steps_lost']} steps (expected 0)")
    for i in incs:
        console.print(
            f"  incident {i['id']} {i['failure_class']}: resumed at step {i['resumed_step']}, "
            f"{i['steps_lost']} steps lost, recovered in {i['mttr_s'] or 0:.1f} s"
        )
    console.print(f"final status: {j['status']} ({j.get('status_reason')})")
    console.print(
        f"dashboard: SKYRESUME_HOME={home} skyresume serve --port {svc.port}, "
        f"then open {svc.url}/dashboard"
    )
    if problems:
        for p in problems:
            console.print(f"[red]check failed:[/red] {p}")
        return 1
    console.print("[green]demo passed[/green]: training finished with validated resumes")
    return 0
