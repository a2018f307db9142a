"""A starved service never declares healthy nodes lost (issue 25).

    .venv/bin/python bench/overload.py                      # quiet, then 1, 0.5, 0.3 cores
    .venv/bin/python bench/overload.py --quotas 0.3 --duration 60 --modes obey,1hz

Per run: ``skyresume serve`` (its own process, SQLite) and a reconciler (a process
of its own, reading SQL as another replica would) run together in one cgroup with a
CFS quota (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``); the quiet run has no
quota. Two real jobs: a big one (``--nodes`` minus 4) and a small one of 4 nodes,
every node registered and beating from ``--procs`` generator processes (asyncio +
aiohttp, one connection per node). ``--kill-at`` seconds into the load, one node of
the small job stops beating: it is the real loss the service must still find.

Generator modes: ``obey`` beats like the agent does (``agent/client.py``): the
period the answer names (jittered +-10 %), and after a 503 or 429 the
``Retry-After`` it names, stretched by up to 50 %; ``1hz`` is a fleet that ignores
both and beats every second (what the issue measured), to show the service in real
overload.

Reported per run: false ``node_lost`` (any node but the killed one) and incidents
(any but the killed node's), whether the killed node was found and how long after
its last accepted beat (its detection time; the quiet run's is the baseline and each
starved run's ratio against it is printed), ``control_plane_degraded`` events,
beats accepted and refused, p99 latency, and the service's CPU.

Isolation, in the same run (``--api-conc`` clients, 0 for none): the API's read
routes (the CLI's and the dashboard's: job list and detail, attempts, the live view)
are called back to back for 8 s before the fleet beats (the API alone), and again
from ``--api-from`` seconds into the load to its end. Reported: the heartbeats' p99
before and after the API load starts, and the API's p99 alone and with the beats,
each as a ratio. Ends with one JSON line ``{"bench": "overload", ...}``. Root is
needed for the cgroup.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import random
import secrets
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from heartbeats import RANKS, free_port, heartbeat_body, proc_cpu_s, start, stop  # noqa: E402

from orchestrator.api.auth import job_token  # noqa: E402

TOKEN = "bench-" + secrets.token_hex(8)
SMALL = 4
CG_V2 = Path("/sys/fs/cgroup")
CG_V1 = Path("/sys/fs/cgroup/cpu")


# --- the cgroup ---------------------------------------------------------------------------


class Quota:
    """A cgroup holding the service's processes at ``cores`` of CPU (None: no limit)."""

    def __init__(self, cores: float | None) -> None:
        self.cores = cores
        self.path: Path | None = None
        self.v2 = (
            "cpu" in (CG_V2 / "cgroup.controllers").read_text().split()
            if (CG_V2 / "cgroup.controllers").exists()
            else False
        )

    def __enter__(self) -> Quota:
        if self.cores is None:
            return self
        name = f"skyresume-overload-{os.getpid()}-{secrets.token_hex(2)}"
        period = 100_000
        quota = int(self.cores * period)
        if self.v2:
            self.path = CG_V2 / name
            self.path.mkdir()
            (self.path / "cpu.max").write_text(f"{quota} {period}")
        else:
            self.path = CG_V1 / name
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        return self

    def add(self, pid: int) -> None:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float | None:
        if self.path is None:
            return None
        for line in (self.path / "cpu.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "throttled_usec":
                return int(v) / 1e6
            if k == "throttled_time":
                return int(v) / 1e9
        return None

    def __exit__(self, *_exc: object) -> None:
        if self.path is None:
            return
        root = CG_V2 if self.v2 else CG_V1
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()


# --- the reconciler process --------------------------------------------------------------


def run_reconciler(url: str, log_path: str) -> None:
    """The reconciler as another replica runs it: SQL only, no launcher to ask (a
    launcher that cannot tell), so silence is the only witness of the killed node."""
    import logging

    from orchestrator.domain.reconcile import LauncherAbilities
    from orchestrator.reconciler.loop import Reconciler
    from orchestrator.store.db import make_engine, make_sessionmaker

    logging.basicConfig(filename=log_path, level=logging.WARNING)

    class Blind:
        abilities = LauncherAbilities()

        def candidates(self, spec: Any, replacement: bool = False) -> list[Any]:
            return []

        def __getattr__(self, name: str) -> Any:
            raise AttributeError(f"the bench's launcher cannot {name}")

    rec = Reconciler(make_sessionmaker(make_engine(url)), Blind(), "http://unused")  # type: ignore[arg-type]
    tick = rec.tick
    ticks = open(log_path + ".ticks", "a", buffering=1)  # noqa: SIM115 (the process's life)

    def timed_tick() -> None:  # each tick's start and length, for the harness
        start = time.time()
        tick()
        ticks.write(f"{start:.3f} {time.time() - start:.3f}\n")

    rec.tick = timed_tick  # type: ignore[method-assign]
    rec.start()
    while True:
        time.sleep(3600)


# --- the fleet ----------------------------------------------------------------------------


def seed(url: str, spec: dict[str, Any], nodes: int, job_id: str) -> None:
    """A running, validated attempt 1 (the reconciler's launch, which it does not run here)."""
    from sqlalchemy import update

    from orchestrator.store.db import make_engine, make_sessionmaker
    from orchestrator.store.models import Attempt, Job

    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as s, s.begin():
            s.add(
                Attempt(
                    job_id=job_id, number=1, cloud="local", region="local",
                    instance_type="cpu", num_nodes=nodes, spot=True,
                    knobs={"ranks_per_node": RANKS}, started_at=datetime.now(UTC),
                    state="running", launcher="local", validated_step=1000,
                )
            )  # fmt: skip
            s.execute(update(Job).where(Job.id == job_id).values(status="RUNNING"))
    finally:
        engine.dispose()


async def register_all(base: str, jobs: list[tuple[str, int]]) -> float:
    """Register every node; the longest ``heartbeat_s`` the answers named."""
    import aiohttp

    from orchestrator import __version__
    from orchestrator.contract import AGENT_PROTOCOL

    sem = asyncio.Semaphore(32)
    told = [1.0]
    async with aiohttp.ClientSession() as http:

        async def one(job_id: str, k: int) -> None:
            body = {
                "node_rank": k, "hostname": f"node{k}", "agent_pid": 100 + k,
                "provider": "aws", "agent_version": __version__, "agent_build": "source",
                "protocol": AGENT_PROTOCOL,
                "ranks": [{"rank": k * RANKS + r, "local_rank": r, "pid": 4000 + r}
                          for r in range(RANKS)],
            }  # fmt: skip
            path = f"{base}/v1/jobs/{job_id}/attempts/1/nodes/node{k}/register"
            headers = {"Authorization": f"Bearer {job_token(TOKEN, job_id, 1)}"}
            text = ""
            for _ in range(40):
                try:
                    async with sem, http.post(path, json=body, headers=headers) as r:
                        if r.status == 200:
                            told.append(float((await r.json()).get("heartbeat_s") or 1.0))
                            return
                        text = f"HTTP {r.status} {(await r.text())[:300]}"
                except aiohttp.ClientError as e:
                    text = repr(e)
                await asyncio.sleep(0.5)
            raise RuntimeError(f"register node{k}: {text}")

        await asyncio.gather(*(one(j, k) for j, n in jobs for k in range(n)))
    return max(told)


def generator(
    base: str, nodes: list[tuple[str, int]], t0: float, cfg: dict[str, Any], q: Any
) -> None:
    import aiohttp

    async def run() -> dict[str, Any]:
        lat: list[tuple[float, float]] = []
        counts = {"accepted": 0, "refused": 0, "errors": 0, "timeouts": 0}
        last_ok: dict[str, float] = {}
        end = t0 + cfg["duration"]
        # urllib's (the agent's): a connection per beat; --keep-alive: one per node.
        conn = aiohttp.TCPConnector(limit=0, force_close=not cfg["keep_alive"])
        timeout = aiohttp.ClientTimeout(total=10.0)  # the agent's
        async with aiohttp.ClientSession(connector=conn) as http:

            async def node(job_id: str, k: int) -> None:
                path = f"{base}/v1/jobs/{job_id}/attempts/1/nodes/node{k}/heartbeat"
                headers = {
                    "Authorization": f"Bearer {job_token(TOKEN, job_id, 1)}",
                    "Content-Type": "application/json",
                }
                killed = job_id == cfg["small"] and k == 0
                obey = cfg["mode"] == "obey"
                period = cfg["period"] if obey else 1.0  # register's heartbeat_s
                await asyncio.sleep(random.uniform(0, period))  # agents start apart
                tick = 0
                while time.time() < end:
                    if killed and time.time() >= t0 + cfg["kill_at"]:
                        return  # the node is gone: no more beats
                    wait = period * (random.uniform(0.9, 1.1) if obey else 1.0)
                    data = json.dumps(heartbeat_body(k, tick))
                    tick += 1
                    sent = time.perf_counter()
                    try:
                        async with http.post(
                            path, data=data, headers=headers, timeout=timeout
                        ) as r:
                            raw = await r.read()
                            if r.status == 200:
                                counts["accepted"] += 1
                                lat.append((time.time(), time.perf_counter() - sent))
                                last_ok[f"{job_id}/node{k}"] = time.time()
                                told = (json.loads(raw) or {}).get("interval_s")
                                if obey and isinstance(told, (int, float)) and told > 1.0:
                                    period = float(told)
                                    wait = period * random.uniform(0.9, 1.1)
                            elif r.status in (429, 503):
                                counts["refused"] += 1
                                ra = float(r.headers.get("Retry-After") or 1.0)
                                if obey:
                                    wait = ra * (1 + random.uniform(0, 0.5))
                            else:
                                counts["errors"] += 1
                    except TimeoutError:
                        counts["timeouts"] += 1
                        sent = time.perf_counter()  # the agent's backoff counts from here
                    except aiohttp.ClientError:
                        counts["errors"] += 1
                        sent = time.perf_counter()
                    await asyncio.sleep(max(0.0, wait - (time.perf_counter() - sent)))

            await asyncio.gather(*(node(j, k) for j, k in nodes))
        return {**counts, "latencies": lat, "last_ok": last_ok}

    q.put(asyncio.run(run()))


def api_load(base: str, paths: list[str], start: float, end: float, conc: int, q: Any) -> None:
    """``conc`` clients, each calling the API's read routes (the CLI's and the
    dashboard's: job list and detail, attempts, the live view) back to back from
    ``start`` to ``end``; their latencies."""
    import aiohttp

    async def run() -> dict[str, Any]:
        lat: list[float] = []
        errors = 0
        headers = {"Authorization": f"Bearer {TOKEN}"}
        timeout = aiohttp.ClientTimeout(total=30.0)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:

            async def client(k: int) -> None:
                nonlocal errors
                await asyncio.sleep(max(0.0, start - time.time()))
                i = k
                while time.time() < end:
                    sent = time.perf_counter()
                    try:
                        async with http.get(base + paths[i % len(paths)]) as r:
                            await r.read()
                            if r.status == 200:
                                lat.append(time.perf_counter() - sent)
                            else:
                                errors += 1
                    except (aiohttp.ClientError, TimeoutError):
                        errors += 1
                    i += 1

            await asyncio.gather(*(client(k) for k in range(conc)))
        return {"latencies": lat, "errors": errors}

    q.put(asyncio.run(run()))


WATCHED = (
    "skyresume_event_loop_lag_seconds",
    "skyresume_accept_queue",
    "skyresume_heartbeats_in_flight",
    "skyresume_heartbeats_unflushed_seconds",
)


def watch_metrics(base: str, end: float, peaks: dict[str, float]) -> None:
    """Scrape ``/metrics`` every 2 s until ``end``: the peak of each back-pressure
    signal, and the refusals by signal at the last scrape (a thread of the harness)."""
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    while time.time() < end:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"{base}/metrics", headers=headers, timeout=10.0).text
            for line in text.splitlines():
                name, _, value = line.rpartition(" ")
                if name in WATCHED:
                    peaks[name] = max(peaks.get(name, 0.0), float(value))
                elif name.startswith("skyresume_heartbeats_refused_total{"):
                    peaks[name.removeprefix("skyresume_heartbeats_")] = float(value)
        time.sleep(2.0)


def p99_ms(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return round(1000 * xs[int(len(xs) * 0.99)], 1) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def events(url: str) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from orchestrator.store.db import make_engine, make_sessionmaker
    from orchestrator.store.models import FailureEvent

    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as s:
            return [
                {
                    "job": e.job_id,
                    "kind": e.kind,
                    "node": e.node_id,
                    "at": (
                        e.occurred_at if e.occurred_at.tzinfo else e.occurred_at.replace(tzinfo=UTC)
                    ).timestamp(),
                    "message": e.message,
                }
                for e in s.scalars(select(FailureEvent).order_by(FailureEvent.id))
            ]
    finally:
        engine.dispose()


def one_run(cores: float | None, mode: str, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    import httpx

    from orchestrator.store import db

    home = Path(tempfile.mkdtemp(prefix=f"ov-{cores}-{mode}-", dir=work))
    url = f"sqlite:///{home / 'skyresume.db'}"
    db.upgrade(url)
    port = free_port()
    env = {
        **os.environ,
        "SKYRESUME_HOME": str(home),
        "SKYRESUME_TOKEN": TOKEN,
        "SKYRESUME_RECONCILE": "false",  # the reconciler is the process below
        "SKYRESUME_DATABASE_URL": url,
        "SKYRESUME_AUTO_MIGRATE": "false",
    }
    with Quota(cores) as quota:
        proc = start(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(port)],
            env,
            port,
            home / "service.log",
        )
        quota.add(proc.pid)
        base = f"http://127.0.0.1:{port}"
        ctx = mp.get_context("fork")
        rec = None
        try:
            jobs: list[tuple[str, int]] = []
            for name, n in (("big", cfg["nodes"] - SMALL), ("small", SMALL)):
                spec = {
                    "name": f"ov-{name}", "num_nodes": n, "ranks_per_node": RANKS,
                    "task": {"template": "gpt-cpu",
                             "command": "python -m training.examples.train_gpt"},
                    "accelerators": ["A100:8"], "spot": True, "clouds": ["aws"],
                    "checkpoint": {"uri": "file:///tmp/skyresume-ov-bench", "every_steps": 50},
                }  # fmt: skip
                r = httpx.post(
                    f"{base}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {TOKEN}"}
                )
                r.raise_for_status()
                jobs.append((r.json()["id"], n))
            for job_id, n in jobs:
                seed(url, {}, n, job_id)
            period = asyncio.run(register_all(base, jobs))
            rec = ctx.Process(target=run_reconciler, args=(url, str(home / "reconciler.log")))
            rec.start()
            quota.add(rec.pid)
            cfg = {**cfg, "small": jobs[1][0], "mode": mode, "period": period}
            paths = [
                "/v1/jobs",
                f"/v1/jobs/{jobs[0][0]}",
                f"/v1/jobs/{jobs[1][0]}/attempts",
                f"/v1/jobs/{jobs[1][0]}/live",
            ]
            aq = ctx.Queue()
            alone = None
            if cfg["api_conc"]:
                # The API alone (the reconciler ticking, no beat): its baseline.
                s0 = time.time()
                a = ctx.Process(
                    target=api_load, args=(base, paths, s0, s0 + 8.0, cfg["api_conc"], aq)
                )
                a.start()
                alone = aq.get()
                a.join()
            q = ctx.Queue()
            t0 = time.time() + 1.0
            api = None
            if cfg["api_conc"]:
                api_from = t0 + cfg["api_from"]
                api = ctx.Process(
                    target=api_load,
                    args=(base, paths, api_from, t0 + cfg["duration"], cfg["api_conc"], aq),
                )
                api.start()
            everyone = [(j, k) for j, n in jobs for k in range(n)]
            gens = [
                ctx.Process(target=generator, args=(base, everyone[p :: cfg["procs"]], t0, cfg, q))
                for p in range(cfg["procs"])
            ]
            for g in gens:
                g.start()
            peaks: dict[str, float] = {}
            watcher = threading.Thread(
                target=watch_metrics, args=(base, t0 + cfg["duration"], peaks), daemon=True
            )
            watcher.start()
            cpu0 = proc_cpu_s(proc.pid) + proc_cpu_s(rec.pid)
            thr0 = quota.throttled_s()
            results = [q.get() for _ in gens]
            cpu1 = proc_cpu_s(proc.pid) + proc_cpu_s(rec.pid)
            thr1 = quota.throttled_s()
            for g in gens:
                g.join()
            with_beats = aq.get() if api is not None else None
            if api is not None:
                api.join()
            time.sleep(2.0)  # the last tick's events
        finally:
            if rec is not None:
                rec.kill()
                rec.join()
            stop(proc)
    evs = events(url)
    ticks = (
        [
            tuple(map(float, line.split()))
            for line in (home / "reconciler.log.ticks").read_text().splitlines()
            if line.strip()
        ]
        if (home / "reconciler.log.ticks").exists()
        else []
    )
    during = [(s, d) for s, d in ticks if t0 <= s <= t0 + cfg["duration"]]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(during)]
    small, killed = jobs[1][0], f"{jobs[1][0]}-a1-node0"
    killed_key = f"{small}/node0"
    last_ok = {k: v for r in results for k, v in r["last_ok"].items()}
    lost = [e for e in evs if e["kind"] == "node_lost"]
    found = [e for e in lost if e["node"] in (killed, "node0") and e["job"] == small]
    false_lost = [e for e in lost if e not in found]
    incidents = [e for e in evs if e["kind"] == "incident"]
    false_inc = [e for e in incidents if e["job"] != small or e["node"] not in (killed, "node0")]
    lat = sorted(x for r in results for _, x in r["latencies"])
    split = t0 + cfg["api_from"]
    hb_quiet_api = [x for r in results for at, x in r["latencies"] if at < split]
    hb_with_api = [x for r in results for at, x in r["latencies"] if at >= split]
    isolation = {}
    if alone is not None and with_beats is not None:
        isolation = {
            "hb_p99_ms_without_api": p99_ms(hb_quiet_api),
            "hb_p99_ms_with_api": p99_ms(hb_with_api),
            "hb_p99_with_api_vs_without": ratio(p99_ms(hb_with_api), p99_ms(hb_quiet_api)),
            "api_p99_ms_alone": p99_ms(alone["latencies"]),
            "api_p99_ms_with_beats": p99_ms(with_beats["latencies"]),
            "api_p99_with_beats_vs_alone": ratio(
                p99_ms(with_beats["latencies"]), p99_ms(alone["latencies"])
            ),
            "api_calls_per_s_alone": round(len(alone["latencies"]) / 8.0, 1),
            "api_calls_per_s_with_beats": round(
                len(with_beats["latencies"]) / (cfg["duration"] - cfg["api_from"]), 1
            ),
            "api_errors": alone["errors"] + with_beats["errors"],
        }
    detection = (
        round(found[0]["at"] - last_ok[killed_key], 1) if found and killed_key in last_ok else None
    )
    return {
        "cores": cores,
        "mode": mode,
        "nodes": cfg["nodes"],
        "false_node_lost": len(false_lost),
        "false_incidents": len(false_inc),
        "killed_found": bool(found),
        "detection_s": detection,
        "control_plane_degraded": sum(1 for e in evs if e["kind"] == "control_plane_degraded"),
        "accepted_per_s": round(sum(r["accepted"] for r in results) / cfg["duration"], 1),
        "refused": sum(r["refused"] for r in results),
        "timeouts": sum(r["timeouts"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 1) if lat else None,
        "service_cpu_s": round(cpu1 - cpu0, 1),
        "throttled_s": round(thr1 - thr0, 1) if thr0 is not None and thr1 is not None else None,
        "period_s": period,
        **isolation,
        "reconciler_ticks": len(during),
        "tick_gap_max_s": round(max(gaps), 1) if gaps else None,
        "tick_s_median": round(sorted(d for _, d in during)[len(during) // 2], 2)
        if during
        else None,
        "peaks": {k.removeprefix("skyresume_"): round(v, 2) for k, v in peaks.items()},
        "examples": [e["message"] for e in false_lost[:2]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--quotas", default="1,0.5,0.3", help="CPU cores of each starved run")
    p.add_argument("--modes", default="obey", help="obey (agents' back-off), 1hz (ignore it)")
    p.add_argument("--duration", type=float, default=75.0, help="seconds of load per run")
    p.add_argument("--kill-at", type=float, default=15.0, help="when one node stops beating")
    p.add_argument("--procs", type=int, default=2, help="generator processes")
    p.add_argument("--keep-alive", action="store_true", help="one connection per node")
    p.add_argument("--api-conc", type=int, default=4, help="API clients (0: none)")
    p.add_argument("--api-from", type=float, default=40.0, help="when the API load starts")
    args = p.parse_args()
    cfg = {
        "api_conc": args.api_conc,
        "api_from": args.api_from,
        "nodes": args.nodes,
        "duration": args.duration,
        "kill_at": args.kill_at,
        "procs": args.procs,
        "keep_alive": args.keep_alive,
    }
    work = Path(tempfile.mkdtemp(prefix="skyresume-overload-"))
    runs = []
    for mode in args.modes.split(","):
        quiet = one_run(None, mode, cfg, work)
        runs.append(quiet)
        print(json.dumps(quiet), flush=True)
        for q in filter(None, args.quotas.split(",")):
            r = one_run(float(q), mode, cfg, work)
            base = quiet["detection_s"]
            r["detection_vs_quiet"] = (
                round(r["detection_s"] / base, 2) if r["detection_s"] and base else None
            )
            runs.append(r)
            print(json.dumps(r), flush=True)
    print(
        json.dumps(
            {
                "bench": "overload",
                "nodes": args.nodes,
                "false_node_lost": sum(r["false_node_lost"] for r in runs),
                "false_incidents": sum(r["false_incidents"] for r in runs),
                "killed_found_every_run": all(r["killed_found"] for r in runs),
                "runs": [{k: v for k, v in r.items() if k != "examples"} for r in runs],
            }
        )
    )


if __name__ == "__main__":
    main()
