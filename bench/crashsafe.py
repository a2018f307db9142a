"""Crash safety of the restart protocol: ``skyresume serve`` SIGKILLed at each step.

    python bench/crashsafe.py                         # every kill point, SQLite and PG
    python bench/crashsafe.py --db sqlite --points signal,launch-accepted

One service (one replica, the local launcher, nodes on shared loopback:
``SKYRESUME_LOCAL_NETWORK=loopback``, so no network namespace is made) runs a 2-node
CPU GPT job per kill point. Once the job trains, node 1 gets a spot notice; the
harness watches the database (``failure_events``, ``protocol_steps``, ``attempts``)
and SIGKILLs the service the moment the target point is reached, then starts it again
on the same home and database:

- ``detect``: the notice was recorded (the incident may not be open yet);
- ``signal``, ``confirm_checkpoint``, ``select_replacement``, ``launch``, ``stage``,
  ``validate``: that step's row exists (started; some steps start and end in one tick);
- ``provisioning``: the relaunch's request was accepted and recorded, nodes not up
  (a provisioning delay of ``--provision-s`` keeps it there);
- ``launch-accepted``: inside the launch: the launcher accepted the request and the
  service died before recording it (the service kills itself there:
  ``SKYRESUME_CRASH_AT=launch-accepted@2``, a failpoint in the reconciler).

Each incident must then complete with exactly one relaunch: one new attempt, its
nodes launched once (the launcher's own launch claims, one per (job, attempt, try)),
every node of it registered once, every step of the incident ended ok, the job
SUCCEEDED; and no event lost or duplicated: every event committed before the kill is
still there, and the once-per-fact events (the notice, the incident, each node's exit,
each node's staging, launch failures, lost nodes) appear once each.

Ends with one JSON line: ``{"bench": "crashsafe", "results": [...], "ok": ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = ("signal", "confirm_checkpoint", "select_replacement", "launch", "stage", "validate")
POINTS = ("detect", *STEPS, "provisioning", "launch-accepted")
PG_BASE = os.environ.get("SKYRESUME_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
#: Events that record one fact each: two of them for the same (kind, node, attempt)
#: is a duplicate.
ONCE = ("preemption_notice", "incident", "node_exit", "staged", "node_lost", "launch_failed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def database(kind: str, home: Path):  # type: ignore[no-untyped-def]
    """A fresh database: a file under ``home``, or a PostgreSQL database of its own."""
    if kind == "sqlite":
        yield f"sqlite:///{home / 'state.db'}"
        return
    import psycopg

    name = "skyresume_h_" + secrets.token_hex(4)
    with psycopg.connect(PG_BASE, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_BASE.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(PG_BASE, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Service:
    """``skyresume serve`` on a fixed home, port and database, started as often as
    asked (the nodes know its port: a restart must come back on the same one)."""

    def __init__(
        self, home: Path, db_url: str, *, port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.home, self.db_url = home, db_url
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, **extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
        env.update(
            SKYRESUME_HOME=str(self.home),
            SKYRESUME_PORT=str(self.port),
            SKYRESUME_HOST="127.0.0.1",
            SKYRESUME_DATABASE_URL=self.db_url,
            SKYRESUME_AUTO_MIGRATE="true",
            SKYRESUME_RECONCILE="true",
            SKYRESUME_LAUNCHER="local",
            SKYRESUME_LOCAL_NETWORK="loopback",
        )
        env.update(self.env)
        env.update(extra)
        self.home.mkdir(parents=True, exist_ok=True)
        log = open(self.home / f"service-{self.port}.log", "ab")  # noqa: SIM115 - the child's
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cli", "serve"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            )  # fmt: skip
        finally:
            log.close()
        self.starts += 1

    def ready(self, timeout_s: float = 90) -> Any:
        import httpx

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"the service exited; see {self.home}/service-{self.port}.log")
            with contextlib.suppress(httpx.HTTPError, OSError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    token = (self.home / "token").read_text().strip()
                    return httpx.Client(
                        base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
                    )
            time.sleep(0.2)
        raise RuntimeError(f"the service was not ready in {timeout_s:.0f} s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped one cannot exit
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def agent_wheel(base: Path) -> str:
    """The agent wheel every node of the run installs, built once. Left to itself each
    service builds its wheel from the checkout, and a checkout edited while a run goes
    on (several engineers share one here) gave a restarted service a wheel whose
    sha256 no longer matched the one it had pinned: a relaunch's setup failed three
    times and the job with it. An operator-chosen package (``SKYRESUME_AGENT_PACKAGE``)
    is what a deployment would pin anyway."""
    from orchestrator.package import WheelCache

    return str(WheelCache(base / "dist").wheel().path)


def job_spec(ckpt: Path, steps: int) -> dict[str, Any]:
    cmd = f"{sys.executable} -m training.examples.train_gpt --max-steps {steps} --step-sleep 0.1"
    return {
        "name": "crashsafe",
        "task": {"template": "gpt-cpu", "command": cmd},
        "num_nodes": 2,
        "ranks_per_node": 1,
        "spot": True,
        "checkpoint": {
            "uri": f"file://{ckpt}",
            "every_steps": 10,
            "keep": 3,
            "adaptive": False,
        },
        # The heartbeat timeout outlasts a service restart: the nodes' silence while
        # it is down is the service's, not theirs.
        "restarts": {"max_restarts": 3, "heartbeat_timeout_s": 60, "grace_period_s": 30},
    }


class Watch:
    """Read-only view of the service's database for one job."""

    def __init__(self, db_url: str) -> None:
        from orchestrator.store import db

        self.engine = db.make_engine(db_url)

    def close(self) -> None:
        self.engine.dispose()

    def rows(self, sql: str, **params: Any) -> list[Any]:
        from sqlalchemy import text

        for _ in range(50):  # the service may hold SQLite's write lock for a moment
            try:
                with self.engine.connect() as c:
                    return list(c.execute(text(sql), params))
            except Exception as e:  # "database is locked", a dropped connection
                last = e
                time.sleep(0.05)
        raise RuntimeError(f"cannot read the database: {last}")

    def events(self, job: str) -> list[dict[str, Any]]:
        out = []
        for r in self.rows(
            "SELECT id, kind, node_id, details, idempotency_key FROM failure_events "
            "WHERE job_id = :j ORDER BY id",
            j=job,
        ):
            details = r[3] if isinstance(r[3], dict) else json.loads(r[3] or "{}")
            out.append({"id": r[0], "kind": r[1], "node_id": r[2], "details": details, "key": r[4]})
        return out

    def steps(self, job: str) -> dict[str, tuple[bool, str | None]]:
        """step -> (finished, outcome) of the job's incidents' rows."""
        return {
            r[0]: (r[1] is not None, r[2])
            for r in self.rows(
                "SELECT step, finished_at, outcome FROM protocol_steps WHERE job_id = :j",
                j=job,
            )
        }

    def attempts(self, job: str) -> list[tuple[int, Any]]:
        out = []
        for r in self.rows(
            "SELECT number, handle FROM attempts WHERE job_id = :j ORDER BY number", j=job
        ):
            h = r[1] if isinstance(r[1], dict) or r[1] is None else json.loads(r[1])
            out.append((r[0], h))
        return out

    def status(self, job: str) -> str:
        (row,) = self.rows("SELECT status FROM jobs WHERE id = :j", j=job)
        return str(row[0])

    def nodes(self, job: str) -> list[tuple[int, str]]:
        return [
            (r[0], r[1])
            for r in self.rows("SELECT attempt, node_id FROM nodes WHERE job_id = :j", j=job)
        ]

    def validated(self, job: str, number: int) -> bool:
        rows = self.rows(
            "SELECT validated_step FROM attempts WHERE job_id = :j AND number = :n", j=job, n=number
        )
        return bool(rows) and rows[0][0] is not None


def reached(w: Watch, job: str, point: str) -> bool:
    if point == "detect":
        return any(e["kind"] == "preemption_notice" for e in w.events(job))
    if point in STEPS:
        return point in w.steps(job)
    if point == "provisioning":
        return any(n == 2 and h and not h.get("up_at") for n, h in w.attempts(job))
    raise ValueError(point)


@dataclass
class KillResult:
    db: str
    point: str
    job: str = ""
    ok: bool = False
    killed_at: str = ""
    """What the database said when the service was killed."""
    attempts: list[int] = field(default_factory=list)
    launch_keys: list[str] = field(default_factory=list)
    registered: dict[str, int] = field(default_factory=dict)
    agent_starts: dict[str, int] = field(default_factory=dict)
    """node id -> agents started on it: 1 each, or a node was launched twice."""
    steps: dict[str, str | None] = field(default_factory=dict)
    duplicates: list[str] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    status: str = ""
    recovery_s: float = 0.0
    """Kill -> the relaunch validated on every rank (restart included)."""
    problems: list[str] = field(default_factory=list)


def wait(what: str, until: Any, timeout_s: float, poll_s: float = 0.2) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = until()
        if got:
            return got
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def launch_keys(home: Path, job: str) -> list[str]:
    """The launcher's own record of every launch it started (one claim per key)."""
    return sorted(p.stem for p in (home / "local-nodes" / job).glob("*.claim"))


def agent_starts(home: Path, job: str) -> dict[str, int]:
    """node id -> how many times an agent started on that node (the banner line each
    agent logs first, in the node's ``run.log``, which every start appends to)."""
    out = {}
    for log in (home / "local-nodes" / job).glob("*/logs/run.log"):
        lines = log.read_text(errors="replace").splitlines()
        out[log.parent.parent.name] = sum(
            1 for x in lines if "INFO skyresume " in x and "(build " in x
        )
    return out


def check_events(before: list[dict[str, Any]], after: list[dict[str, Any]], r: KillResult) -> None:
    ids = {e["id"] for e in after}
    r.lost = [e["id"] for e in before if e["id"] not in ids]
    seen = Counter(
        (e["kind"], e["node_id"], e["details"].get("attempt") if e["kind"] != "staged" else None)
        for e in after
        if e["kind"] in ONCE
    )
    r.duplicates = [f"{k[0]} {k[1] or ''} a{k[2]}".strip() for k, n in seen.items() if n > 1]
    kinds = Counter(e["kind"] for e in after)
    want = {"preemption_notice": 1, "incident": 1}
    r.missing = [k for k, n in want.items() if kinds[k] != n]
    for node in (f"{r.job}-a1-n0", f"{r.job}-a1-n1"):
        if not any(e["kind"] == "node_exit" and e["node_id"] == node for e in after):
            r.missing.append(f"node_exit {node}")
    for node in (f"{r.job}-a2-n0", f"{r.job}-a2-n1"):
        if not any(e["kind"] == "staged" and e["node_id"] == node for e in after):
            r.missing.append(f"staged {node}")
    for k in ("node_lost", "launch_failed"):
        if kinds[k]:
            r.problems.append(f"{kinds[k]} {k} event(s)")


def run_point(
    svc: Service, w: Watch, db: str, point: str, steps: int, timeout_s: float
) -> KillResult:
    """One job on the (running) service, one kill at ``point``, one restart."""
    import httpx

    r = KillResult(db, point)
    if point == "launch-accepted":
        # The failpoint is armed in a service started with it, before the job's nodes
        # exist (they are told where the service's metadata simulator is at launch).
        svc.stop()
        svc.start(SKYRESUME_CRASH_AT="launch-accepted@2")
    try:
        http = svc.ready()
        ckpts = svc.home / "checkpoints" / f"{point}-{svc.starts}"
        r.job = job = str(http.post("/v1/jobs", json=job_spec(ckpts, steps)).json()["id"])
        wait("attempt 1 validated", lambda: w.validated(job, 1), timeout_s)
        wait("a checkpoint", lambda: any(ckpts.glob("step_*/COMMIT*")), timeout_s)
        got = http.post(f"/v1/jobs/{job}/chaos", json={"action": "preempt", "node": 1})
        got.raise_for_status()
        if point == "launch-accepted":
            wait("the failpoint", lambda: not svc.alive(), timeout_s, poll_s=0.05)
        else:
            wait(point, lambda: reached(w, job, point), timeout_s, poll_s=0.02)
            svc.kill()
        t_kill = time.monotonic()
        state = w.steps(job)
        r.killed_at = ", ".join(
            f"{s}:{'ended ' + str(o) if done else 'started'}" for s, (done, o) in state.items()
        ) + "; attempts " + ",".join(
            f"{n}{'(handle)' if h else ''}" for n, h in w.attempts(job)
        )  # fmt: skip
        before = w.events(job)
        svc.start()
        http = svc.ready()
        wait("the relaunch validated", lambda: w.validated(job, 2), timeout_s)
        r.recovery_s = round(time.monotonic() - t_kill, 1)
        wait("the end", lambda: w.status(job) in ("SUCCEEDED", "FAILED", "CANCELLED"), timeout_s)
        time.sleep(1.0)  # the release of the last attempt commits after the status
        r.status = w.status(job)
        r.attempts = [n for n, _ in w.attempts(job)]
        r.launch_keys = launch_keys(svc.home, job)
        r.registered = dict(Counter(f"a{a}" for a, _ in w.nodes(job)))
        r.agent_starts = agent_starts(svc.home, job)
        r.steps = {s: o for s, (_, o) in w.steps(job).items()}
        check_events(before, w.events(job), r)
    except (TimeoutError, RuntimeError, httpx.HTTPError) as e:
        r.problems.append(f"{type(e).__name__}: {e}")
        if not svc.alive():
            svc.start()
    if r.status != "SUCCEEDED":
        r.problems.append(f"job {r.status or 'unfinished'}")
    if r.attempts != [1, 2]:
        r.problems.append(f"attempts {r.attempts}, wanted [1, 2]")
    if r.launch_keys != [f"{r.job}-a1", f"{r.job}-a2"]:
        r.problems.append(f"launches {r.launch_keys}, wanted one per attempt")
    if sorted(r.agent_starts.values()) != [1, 1, 1, 1]:
        r.problems.append(f"agent starts per node {r.agent_starts}")
    if r.registered != {"a1": 2, "a2": 2}:
        r.problems.append(f"nodes registered {r.registered}")
    bad = {s: o for s, o in r.steps.items() if o not in ("ok", "skipped")}
    if bad or len(r.steps) != 7:
        r.problems.append(f"steps {r.steps}")
    r.problems += [f"duplicate {d}" for d in r.duplicates]
    r.problems += [f"lost event {i}" for i in r.lost] + [f"missing {m}" for m in r.missing]
    r.ok = not r.problems
    return r


def run(
    dbs: list[str], points: list[str], *, steps: int = 60, provision_s: float = 3.0,
    timeout_s: float = 240.0, home: Path | None = None,
) -> list[KillResult]:  # fmt: skip
    import tempfile

    base = home or Path(tempfile.mkdtemp(prefix="skyresume-crashsafe-"))
    results = []
    for kind in dbs:
        h = base / kind
        with database(kind, h) as url:
            env = {
                "SKYRESUME_LOCAL_PROVISION_DELAY_S": f"{provision_s:g}",
                "SKYRESUME_AGENT_PACKAGE": agent_wheel(base),
            }
            svc = Service(h, url, env=env)
            svc.start()
            w = Watch(url)
            try:
                for point in points:
                    r = run_point(svc, w, kind, point, steps, timeout_s)
                    print(json.dumps({"kill": asdict(r)}), flush=True)
                    results.append(r)
            finally:
                svc.stop()
                w.close()
                cleanup_nodes(h)
    return results


def cleanup_nodes(home: Path) -> None:
    """Kill whatever nodes of this home still run (the harness's own processes only:
    found by the launcher's mark under this home's jobs)."""
    from orchestrator.launchers.local import marked_pids

    root = home / "local-nodes"
    if not root.is_dir():
        return
    markers = {}
    for job in (p for p in root.iterdir() if p.is_dir()):
        for node in (p for p in job.iterdir() if p.is_dir() and p.name.startswith(job.name)):
            markers[f"SKYRESUME_LOCAL_NODE={job.name}/{node.name}".encode()] = node.name
    for pids in marked_pids(markers).values():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default="sqlite,postgres", help="sqlite, postgres or both")
    p.add_argument("--points", default=",".join(POINTS), help=f"of {', '.join(POINTS)}")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--provision-s", type=float, default=3.0)
    p.add_argument("--home", type=Path, default=None)
    a = p.parse_args()
    points = [x for x in a.points.split(",") if x]
    unknown = set(points) - set(POINTS)
    if unknown:
        p.error(f"unknown kill points: {', '.join(sorted(unknown))}")
    t0 = time.monotonic()
    results = run(a.db.split(","), points, steps=a.steps, provision_s=a.provision_s, home=a.home)
    doc = {
        "bench": "crashsafe",
        "ok": all(r.ok for r in results),
        "passed": sum(r.ok for r in results),
        "runs": len(results),
        "seconds": round(time.monotonic() - t0),
        "results": [
            {
                k: v
                for k, v in asdict(r).items()
                if k in ("db", "point", "ok", "recovery_s", "problems")
            }
            for r in results
        ],
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
