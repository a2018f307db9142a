"""Heartbeats at scale: N simulated agents, one heartbeat a second each, against the
real service, and against a bare FastAPI endpoint taking the same body.

    .venv/bin/python bench/heartbeats.py                          # 256, 1024, 2048 nodes, 60 s
    .venv/bin/python bench/heartbeats.py --nodes 2048 --duration 20 --backends postgres

Per (target, N): the service is ``skyresume serve`` in a process of its own (uvicorn
as serve runs it; reconciler off: this measures the agents' side), with a real job,
a real attempt row and N registered nodes; the bare endpoint is one FastAPI route
with the same path and the same ``HeartbeatIn`` body, run by uvicorn the same way.
The load is ``--procs`` generator processes of asyncio + aiohttp, one keep-alive
connection per node, each node beating on its own phase of the second (like agents
started at different times) and never two requests at once (like the agent's loop).

Reported: accepted/s, p50/p99 latency of accepted beats, errors and client timeouts
(``--client-timeout``, the agent's 10 s), service CPU seconds per accepted beat (the
server process's utime+stime from /proc, so the generator's own CPU does not count),
the generator's CPU, and how many nodes ever went longer than ``--hb-timeout`` (the
spec's 30 s default) without an accepted beat: each one a false node_lost. The
ratio is the service's CPU per beat over the bare endpoint's, same N, same run.
Ends with one JSON line ``{"bench": "heartbeats", ...}``.

The machine is 2 shared cores: service and generator compete for them, and
absolute numbers drift between runs; the ratio is the stable figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import resource
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.api.auth import job_token  # noqa: E402
from orchestrator.api.routes_agents import HeartbeatIn  # noqa: E402  (the bare route's body)

TOKEN = "bench-" + secrets.token_hex(8)
PG_BASE = os.environ.get("SKYRESUME_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RANKS = 8
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_threads_cpu_s(pid: int) -> dict[int, float]:
    """utime + stime of each thread of a process (the main thread's id is the pid)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def agent_token(job_id: str) -> str:
    """What the nodes of attempt 1 carry; the bootstrap token for a service older than
    agent tokens (``--operator-token``)."""
    return TOKEN if ARGS.operator_token else job_token(TOKEN, job_id, 1)


def heartbeat_body(node_rank: int, tick: int) -> dict[str, Any]:
    """What an agent with 8 training ranks sends (``HeartbeatIn``, agent/main.py)."""
    step = 1000 + tick
    return {
        "state": "running",
        "ranks": [
            {
                "rank": node_rank * RANKS + k,
                "local_rank": k,
                "pid": 4000 + k,
                "alive": True,
                "step": step,
                "step_time": 0.412 + k * 0.001,
                "loss": 2.3456 - tick * 1e-4,
                "grad_norm": 1.234,
                "report_age_s": 0.3,
                "resumed": {"step": 1000, "manifest_digest": "ab" * 32},
                "exit_code": None,
                "signal": None,
            }
            for k in range(RANKS)
        ],
        "last_checkpoint": {
            "step": 1000,
            "path": f"/local/ckpt/step_1000/node{node_rank}",
            "uploaded_uri": "s3://bucket/job/step_1000",
        },
        "acked_command": 3,
    }


# --- the bare endpoint ------------------------------------------------------------------


def serve_bare(port: int) -> None:
    """One FastAPI route taking the same body, run by uvicorn as ``serve`` runs ours."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/jobs/{job_id}/attempts/{attempt}/nodes/{node_id}/heartbeat")
    async def heartbeat(
        job_id: str, attempt: int, node_id: str, body: HeartbeatIn
    ) -> dict[str, Any]:
        return {}

    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).run()


# --- the service ------------------------------------------------------------------------


@contextlib.contextmanager
def database(backend: str, home: Path) -> Iterator[str]:
    from orchestrator.store import db

    if backend == "sqlite":
        url = f"sqlite:///{home / 'skyresume.db'}"
        db.upgrade(url)
        yield url
        return
    import psycopg

    name = "skyresume_bench_" + secrets.token_hex(4)
    with psycopg.connect(PG_BASE, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{PG_BASE.rsplit('/', 1)[0]}/{name}"
    try:
        db.upgrade(url)
        yield url
    finally:
        with psycopg.connect(PG_BASE, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start(
    cmd: list[str], env: dict[str, str], port: int, log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    import httpx

    out = log.open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code in (200, 404):
                return proc
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd[:3]} did not come up: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def add_attempt(url: str, job_id: str, nodes: int) -> None:
    """The attempt row the reconciler writes when it launches (it is off here)."""
    from orchestrator.store.db import make_engine, make_sessionmaker
    from orchestrator.store.models import Attempt

    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as s, s.begin():
            s.add(
                Attempt(
                    job_id=job_id, number=1, cloud="local", region="local",
                    instance_type="cpu", num_nodes=nodes, spot=True,
                    knobs={"ranks_per_node": RANKS}, started_at=datetime.now(UTC),
                    state="running", launcher="local",
                )
            )  # fmt: skip
    finally:
        engine.dispose()


async def register_all(base: str, job_id: str, nodes: int) -> None:
    import aiohttp

    from orchestrator import __version__
    from orchestrator.contract import AGENT_PROTOCOL

    sem = asyncio.Semaphore(32)
    headers = {"Authorization": f"Bearer {agent_token(job_id)}"}
    async with aiohttp.ClientSession(headers=headers) as http:

        async def one(k: int) -> None:
            body = {
                "node_rank": k, "hostname": f"node{k}", "agent_pid": 100 + k,
                "provider": "aws", "agent_version": __version__, "agent_build": "source",
                "protocol": AGENT_PROTOCOL,
                "ranks": [{"rank": k * RANKS + r, "local_rank": r, "pid": 4000 + r}
                          for r in range(RANKS)],
            }  # fmt: skip
            path = f"{base}/v1/jobs/{job_id}/attempts/1/nodes/node{k}/register"
            for _ in range(20):
                async with sem, http.post(path, json=body) as r:
                    if r.status == 200:
                        return
                    text = await r.text()
                await asyncio.sleep(0.5)
            raise RuntimeError(f"register node{k}: HTTP {r.status} {text[:300]}")

        await asyncio.gather(*(one(k) for k in range(nodes)))


# --- the load ---------------------------------------------------------------------------


def generator(
    base: str, job_id: str, ranks: list[int], total: int, t0: float, cfg: dict[str, Any], q: Any
) -> None:
    """One generator process: its share of the nodes, one task (and connection) each."""
    import aiohttp

    async def run() -> dict[str, Any]:
        lat: list[float] = []
        counts = {"sent": 0, "accepted": 0, "errors": 0, "timeouts": 0}
        codes: dict[str, int] = {}
        gaps: list[float] = []
        end = t0 + cfg["duration"]
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=cfg["client_timeout"])
        # What an agent carries: its attempt's token (no query to check, auth.job_token).
        token = agent_token(job_id)
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession(connector=conn, headers=headers) as http:

            async def node(k: int) -> None:
                path = f"{base}/v1/jobs/{job_id}/attempts/1/nodes/node{k}/heartbeat"
                last_ok = t0
                worst = 0.0
                tick = 0
                next_at = t0 + k / total  # each node on its own phase of the second
                while True:
                    now = time.time()
                    if next_at > now:
                        await asyncio.sleep(next_at - now)
                    if time.time() >= end:
                        break
                    data = json.dumps(heartbeat_body(k, tick))
                    tick += 1
                    counts["sent"] += 1
                    sent = time.perf_counter()
                    try:
                        async with http.post(path, data=data, timeout=timeout) as r:
                            await r.read()
                            status = r.status
                    except TimeoutError:
                        counts["timeouts"] += 1
                        status = -1
                    except aiohttp.ClientError as e:
                        counts["errors"] += 1
                        codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1
                        status = -2
                    took = time.perf_counter() - sent
                    if status == 200:
                        counts["accepted"] += 1
                        lat.append(took)
                        at = time.time()
                        worst = max(worst, at - last_ok)
                        last_ok = at
                    elif status > 0:
                        counts["errors"] += 1
                        codes[str(status)] = codes.get(str(status), 0) + 1
                    # the next beat one period after this one was due, never two at once
                    next_at += 1.0
                    while next_at < time.time() - 1.0:
                        next_at += 1.0
                gaps.append(max(worst, end - last_ok))

            await asyncio.gather(*(node(k) for k in ranks))
        return {**counts, "codes": codes, "latencies": lat, "gaps": gaps}

    before = resource.getrusage(resource.RUSAGE_SELF)
    out = asyncio.run(run())
    after = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    q.put(out)


def load(base: str, job_id: str, nodes: int, pid: int, cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = max(1, min(cfg["procs"], nodes))
    t0 = time.time() + 1.0  # every generator is up before the first beat
    workers = [
        ctx.Process(
            target=generator,
            args=(base, job_id, list(range(p, nodes, procs)), nodes, t0, cfg, q),
        )
        for p in range(procs)
    ]
    for w in workers:
        w.start()
    time.sleep(max(0.0, t0 - time.time()))
    cpu0, threads0 = proc_cpu_s(pid), proc_threads_cpu_s(pid)
    results = [q.get() for _ in workers]
    cpu1, threads1 = proc_cpu_s(pid), proc_threads_cpu_s(pid)
    loop_cpu = threads1.get(pid, 0.0) - threads0.get(pid, 0.0)
    for w in workers:
        w.join()
    lat = sorted(x for r in results for x in r["latencies"])
    gaps = [g for r in results for g in r["gaps"]]
    accepted = sum(r["accepted"] for r in results)
    codes: dict[str, int] = {}
    for r in results:
        for c, n in r["codes"].items():
            codes[c] = codes.get(c, 0) + n
    service_cpu = cpu1 - cpu0
    return {
        "nodes": nodes,
        "sent": sum(r["sent"] for r in results),
        "accepted": accepted,
        "accepted_per_s": round(accepted / cfg["duration"], 1),
        "offered_per_s": nodes,
        "p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
        "p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1) if lat else None,
        "errors": sum(r["errors"] for r in results),
        "timeouts": sum(r["timeouts"] for r in results),
        "codes": codes,
        "service_cpu_s": round(service_cpu, 2),
        "service_cpu_ms_per_beat": round(1000 * service_cpu / accepted, 3) if accepted else None,
        "event_loop_cpu_s": round(loop_cpu, 2),
        "other_threads_cpu_s": round(service_cpu - loop_cpu, 2),
        "generator_cpu_s": round(sum(r["cpu_s"] for r in results), 2),
        "max_gap_s": round(max(gaps), 2) if gaps else None,
        "nodes_past_timeout": sum(1 for g in gaps if g > cfg["hb_timeout"]),
    }


def run_bare(nodes: int, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-bare", str(port)]
    proc = start(cmd, {**os.environ}, port, work / f"bare-{nodes}.log")
    try:
        return load(f"http://127.0.0.1:{port}", "j-bare", nodes, proc.pid, cfg)
    finally:
        stop(proc)


def run_service(backend: str, nodes: int, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    import httpx

    home = Path(tempfile.mkdtemp(prefix=f"{backend}-{nodes}-", dir=work))
    with database(backend, home) as url:
        port = free_port()
        env = {
            **os.environ,
            "SKYRESUME_HOME": str(home),
            "SKYRESUME_TOKEN": TOKEN,
            "SKYRESUME_RECONCILE": "false",
            "SKYRESUME_DATABASE_URL": url,
            "SKYRESUME_AUTO_MIGRATE": "false",  # migrated above (an older tree may not know it)
        }
        cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(port)]
        if ARGS.service_src:  # another tree's service (an older commit, `git archive`d)
            env["PYTHONPATH"] = str(ARGS.service_src)
        proc = start(cmd, env, port, home / "service.log", cwd=ARGS.service_src or ROOT)
        base = f"http://127.0.0.1:{port}"
        try:
            spec = {
                "name": "hb-bench", "num_nodes": nodes, "ranks_per_node": RANKS,
                "task": {"template": "gpt-cpu", "command": "python -m training.examples.train_gpt"},
                "accelerators": ["A100:8"], "spot": True, "clouds": ["aws"],
                "checkpoint": {"uri": "file:///tmp/skyresume-hb-bench", "every_steps": 50},
            }  # fmt: skip
            r = httpx.post(
                f"{base}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            r.raise_for_status()
            job_id = r.json()["id"]
            add_attempt(url, job_id, nodes)
            t = time.monotonic()
            asyncio.run(register_all(base, job_id, nodes))
            registered_s = time.monotonic() - t
            out = load(base, job_id, nodes, proc.pid, cfg)
            out["register_s"] = round(registered_s, 1)
            return out
        finally:
            stop(proc)


def breakdown(rounds: int = 7, requests: int = 500) -> dict[str, float]:
    """CPU ms per heartbeat through the ASGI app in this process (no network, no
    uvicorn): the service, the service without its ``@app.middleware("http")``
    layers (Starlette's BaseHTTPMiddleware), and the bare endpoint. Best of
    ``rounds``: what the app itself costs, apart from HTTP parsing and the load."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from starlette.middleware.base import BaseHTTPMiddleware

    from orchestrator import __version__
    from orchestrator.app import create_app
    from orchestrator.contract import AGENT_PROTOCOL
    from orchestrator.settings import Settings

    home = Path(tempfile.mkdtemp(prefix="hb-breakdown-"))
    url = f"sqlite:///{home / 'skyresume.db'}"
    from orchestrator.store import db

    db.upgrade(url)
    app = create_app(Settings(home=home, database_url=url, token=TOKEN))
    client = TestClient(app)
    client.headers["Authorization"] = f"Bearer {TOKEN}"
    spec = {
        "name": "hb-breakdown", "num_nodes": 1, "ranks_per_node": RANKS,
        "task": {"template": "gpt-cpu", "command": "python -m training.examples.train_gpt"},
        "accelerators": ["A100:8"], "spot": True, "clouds": ["aws"],
        "checkpoint": {"uri": "file:///tmp/skyresume-hb-bench", "every_steps": 50},
    }  # fmt: skip
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    add_attempt(url, job_id, 1)
    reg = {"node_rank": 0, "ranks": [], "agent_version": __version__, "protocol": AGENT_PROTOCOL}
    r = client.post(f"/v1/jobs/{job_id}/attempts/1/nodes/node0/register", json=reg)
    r.raise_for_status()
    app.state.liveness.hold()
    body = json.dumps(heartbeat_body(0, 1)).encode()
    path = f"/v1/jobs/{job_id}/attempts/1/nodes/node0/heartbeat"
    headers = [
        (b"host", b"bench"),
        (b"authorization", f"Bearer {job_token(TOKEN, job_id, 1)}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }  # fmt: skip

    def cost(target: Any) -> float:
        statuses: list[int] = []

        async def one() -> None:
            sent = False

            async def receive() -> dict[str, Any]:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.sleep(3600)
                return {"type": "http.disconnect"}

            async def send(m: dict[str, Any]) -> None:
                if m["type"] == "http.response.start":
                    statuses.append(m["status"])

            await target(dict(scope), receive, send)

        async def many(n: int) -> None:
            for _ in range(n):
                await one()

        asyncio.run(many(50))
        best = float("inf")
        for _ in range(rounds):
            t = time.process_time()
            asyncio.run(many(requests))
            best = min(best, time.process_time() - t)
        assert set(statuses) == {200}, set(statuses)
        app.state.liveness.flush()
        return round(1000 * best / requests, 3)

    bare = FastAPI()

    @bare.post("/v1/jobs/{job_id}/attempts/{attempt}/nodes/{node_id}/heartbeat")
    async def heartbeat(
        job_id: str, attempt: int, node_id: str, body: HeartbeatIn
    ) -> dict[str, Any]:
        return {}

    out = {"service_ms": cost(app), "bare_ms": cost(bare)}
    app.user_middleware = [m for m in app.user_middleware if m.cls is not BaseHTTPMiddleware]  # type: ignore[comparison-overlap]
    app.middleware_stack = None  # rebuilt without them on the next call
    out["service_without_http_middleware_ms"] = cost(app)
    client.close()
    app.state.engine.dispose()
    return out


def line(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name:>9} {r['nodes']:>5} nodes: {r['accepted_per_s']:>7.1f}/s accepted "
        f"(offered {r['offered_per_s']}), p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
        f"errors {r['errors']} {r['codes'] or ''}, timeouts {r['timeouts']}, "
        f"service {r['service_cpu_ms_per_beat']} ms CPU/beat (event loop "
        f"{r['event_loop_cpu_s']} s, other threads {r['other_threads_cpu_s']} s), generator CPU "
        f"{r['generator_cpu_s']} s, max gap {r['max_gap_s']} s, "
        f"{r['nodes_past_timeout']} nodes past {int(ARGS.hb_timeout)} s"
    )


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", default="256,1024,2048", help="comma-separated fleet sizes")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per run")
    p.add_argument("--backends", default="sqlite,postgres")
    p.add_argument("--procs", type=int, default=2, help="load generator processes")
    p.add_argument("--client-timeout", type=float, default=10.0, help="the agent's: 10 s")
    p.add_argument("--hb-timeout", type=float, default=30.0, help="the spec's default: 30 s")
    p.add_argument("--no-bare", action="store_true", help="skip the bare endpoint")
    p.add_argument(
        "--breakdown-only", action="store_true", help="only the in-process CPU breakdown"
    )
    p.add_argument("--service-src", type=Path, help="run the service from this source tree")
    p.add_argument("--operator-token", action="store_true", help="beat with the bootstrap token")
    p.add_argument("--serve-bare", type=int, help=argparse.SUPPRESS)
    ARGS = p.parse_args()
    if ARGS.serve_bare:
        serve_bare(ARGS.serve_bare)
        return
    cfg = {
        "duration": ARGS.duration,
        "procs": ARGS.procs,
        "client_timeout": ARGS.client_timeout,
        "hb_timeout": ARGS.hb_timeout,
    }
    split = breakdown()
    print(
        f"in-process CPU per heartbeat (best of 7 x 500): service {split['service_ms']} ms, "
        f"without its @app.middleware('http') layer "
        f"{split['service_without_http_middleware_ms']} ms, bare {split['bare_ms']} ms",
        flush=True,
    )
    if ARGS.breakdown_only:
        print(json.dumps({"bench": "heartbeats", "breakdown": split}))
        return
    sizes = [int(n) for n in ARGS.nodes.split(",")]
    backends = [b for b in ARGS.backends.split(",") if b]
    runs: dict[str, dict[str, Any]] = {}
    work = Path(tempfile.mkdtemp(prefix="skyresume-hb-bench-"))
    print(
        f"load {os.getloadavg()}, {os.cpu_count()} cores, {ARGS.duration:g} s per run", flush=True
    )
    for n in sizes:
        if not ARGS.no_bare:
            r = run_bare(n, cfg, work)
            runs[f"bare-{n}"] = r
            print(line("bare", r), flush=True)
        for b in backends:
            r = run_service(b, n, cfg, work)
            bare = runs.get(f"bare-{n}")
            if bare and bare["service_cpu_ms_per_beat"] and r["service_cpu_ms_per_beat"]:
                r["cpu_per_beat_over_bare"] = round(
                    r["service_cpu_ms_per_beat"] / bare["service_cpu_ms_per_beat"], 2
                )
            runs[f"{b}-{n}"] = r
            print(
                line(b, r) + f", x{r.get('cpu_per_beat_over_bare')} the bare CPU/beat", flush=True
            )
    biggest = max(sizes)
    ratios = [runs[f"{b}-{biggest}"].get("cpu_per_beat_over_bare") for b in backends]
    summary = {
        "bench": "heartbeats",
        "duration_s": ARGS.duration,
        "procs": ARGS.procs,
        "runs": {
            k: {x: v for x, v in r.items() if x not in ("codes",)} | {"codes": r["codes"]}
            for k, r in runs.items()
        },
        "breakdown": split,
        "ratio": max((x for x in ratios if x is not None), default=None),
    }
    print(json.dumps(summary))


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
