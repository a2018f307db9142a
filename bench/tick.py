"""The reconciler's tick at 2,048 nodes, before and after a change, in one run (issue 25).

    .venv/bin/python bench/tick.py --before e43bc61              # the working tree vs e43bc61
    .venv/bin/python bench/tick.py --before e43bc61 --after HEAD --backends sqlite,postgres

A store like ``bench/overload.py``'s: two running, validated jobs (``--nodes`` minus 4,
and 4), every node registered with an agent's heartbeat body of 8 ranks. A
reconciler (a launcher that can tell nothing, as in that bench) ticks ``--ticks``
times; before each tick ``--changed`` nodes beat (their progress and time written,
as the service's flush does): at 2,048 nodes agents are told to beat every 8 s
(``domain.silence.heartbeat_interval_s``), so a tick about 1 s after the last finds
about 256 nodes changed; ``--changed 2048`` is every node. Measured per tick: wall
and CPU seconds (the process's: SQLite runs in it; PostgreSQL's server does not),
and the CPU in the tick's parts (the intake sample, the snapshot, ``decide``).

``--before``/``--after`` are git revisions (``after`` defaults to the working tree);
each is extracted with ``git archive`` into a temporary directory and measured in a
process of its own, alternately (``--rounds`` each), on the same machine in the same
run. Ends with one JSON line ``{"bench": "tick", ...}``: medians and the ratios
before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN = os.environ.get(
    "SKYRESUME_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
RANKS = 8
SMALL = 4


def heartbeat_body(node_rank: int, tick: int) -> dict[str, Any]:
    """What an agent with 8 training ranks sends (``bench/heartbeats.py``'s body)."""
    step = 1000 + tick
    return {
        "state": "running",
        "ranks": [
            {
                "rank": node_rank * RANKS + k, "local_rank": k, "pid": 4000 + k, "alive": True,
                "step": step, "step_time": 0.412 + k * 0.001, "loss": 2.3456 - tick * 1e-4,
                "grad_norm": 1.234, "report_age_s": 0.3,
                "resumed": {"step": 1000, "manifest_digest": "ab" * 32},
                "exit_code": None, "signal": None,
            }
            for k in range(RANKS)
        ],
        "last_checkpoint": {
            "step": 1000, "path": f"/local/ckpt/step_1000/node{node_rank}",
            "uploaded_uri": "s3://bucket/job/step_1000",
        },
        "acked_command": 3,
    }  # fmt: skip


# --- one measurement (a process of its own, importing the tree under test) ---------------


def build(url: str, nodes: int, now: datetime) -> tuple[Any, Any, list[tuple[str, int]]]:
    from sqlalchemy import insert, update

    from orchestrator.domain.spec import JobSpec
    from orchestrator.store import agents, db, repo
    from orchestrator.store.models import Attempt, Job, Node

    db.upgrade(url)
    engine = db.make_engine(url)
    sm = db.make_sessionmaker(engine)
    jobs = []
    with sm.begin() as s:
        for name, n in (("big", nodes - SMALL), ("small", SMALL)):
            spec = JobSpec.model_validate({
                "name": f"tick-{name}", "num_nodes": n, "ranks_per_node": RANKS,
                "task": {"template": "gpt-cpu", "command": "python -m training.examples.train_gpt"},
                "accelerators": ["A100:8"], "spot": True, "clouds": ["aws"],
                "checkpoint": {"uri": "file:///tmp/skyresume-tick-bench", "every_steps": 50},
            })  # fmt: skip
            job = repo.create_job(s, spec, now=now)
            s.add(
                Attempt(
                    job_id=job.id, number=1, cloud="local", region="local",
                    instance_type="cpu", num_nodes=n, spot=True,
                    knobs={"ranks_per_node": RANKS}, started_at=now,
                    state="running", launcher="local", validated_step=1000,
                )
            )  # fmt: skip
            s.execute(update(Job).where(Job.id == job.id).values(status="RUNNING"))
            registered = {"ranks": [], "hostname": "h", "agent_pid": 1, "provider": "aws",
                          "client_ip": "127.0.0.1"}  # fmt: skip
            s.execute(
                insert(Node),
                [
                    dict(
                        job_id=job.id, attempt=1, node_id=f"node{k}", node_rank=k,
                        address=f"node{k}", state="running", last_heartbeat_at=now,
                        progress=agents.merge_progress(registered, heartbeat_body(k, 0), 3),
                        registered_at=now,
                    )
                    for k in range(n)
                ],
            )  # fmt: skip
            jobs.append((job.id, n))
    return engine, sm, jobs


def beat(sm: Any, jobs: list[tuple[str, int]], first: int, count: int, tick: int) -> int:
    """``count`` nodes (round robin from ``first``) beat now, written as a flush does."""
    from sqlalchemy import bindparam, update

    from orchestrator.store import agents
    from orchestrator.store.models import Node

    everyone = [(j, k) for j, n in jobs for k in range(n)]
    at = datetime.now(UTC)
    registered = {"ranks": [], "hostname": "h", "agent_pid": 1, "provider": "aws",
                  "client_ip": "127.0.0.1"}  # fmt: skip
    params = []
    for i in range(count):
        job_id, k = everyone[(first + i) % len(everyone)]
        params.append({
            "b_job": job_id, "b_node": f"node{k}", "b_at": at,
            "b_progress": agents.merge_progress(registered, heartbeat_body(k, tick), 3),
        })  # fmt: skip
    if params:
        stmt = (
            update(Node.__table__)
            .where(Node.__table__.c.job_id == bindparam("b_job"))
            .where(Node.__table__.c.node_id == bindparam("b_node"))
            .values(last_heartbeat_at=bindparam("b_at"), progress=bindparam("b_progress"))
        )
        with sm.begin() as s:
            s.connection().execute(stmt, params)
    return (first + count) % len(everyone)


def measure(url: str, nodes: int, ticks: int, changed: int) -> dict[str, Any]:
    """Tick the reconciler ``ticks`` times; each tick's seconds and its parts' CPU."""
    from orchestrator.domain import reconcile as rc
    from orchestrator.reconciler import loop
    from orchestrator.store import intake, repo

    engine, sm, jobs = build(url, nodes, datetime.now(UTC) - timedelta(seconds=1))

    class Blind:
        abilities = rc.LauncherAbilities()
        name = "blind"

        def candidates(self, spec: Any, replacement: bool = False) -> list[Any]:
            return []

        def __getattr__(self, name: str) -> Any:
            raise AttributeError(f"the bench's launcher cannot {name}")

    parts = {"intake": 0.0, "snapshot": 0.0, "decide": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                parts[name] += time.process_time() - t

        return run

    # The tick's parts, timed where the loop calls them (the same functions).
    loop.gather_snapshot = timed("snapshot", loop.gather_snapshot)  # type: ignore[assignment]
    loop.rc.decide = timed("decide", rc.decide)  # type: ignore[attr-defined]
    intake.IntakeLog.sample = timed("intake", intake.IntakeLog.sample)  # type: ignore[method-assign]
    rec = loop.Reconciler(sm, Blind(), "http://unused")  # type: ignore[arg-type]
    rec.heard_since = repo.utcnow() - timedelta(seconds=1)
    assert rec.acquire_lease()
    cursor = 0
    for w in range(2):  # warm: the first tick reads everything
        cursor = beat(sm, jobs, cursor, changed, w + 1)
        rec.tick()
    walls, cpus = [], []
    per_tick: dict[str, list[float]] = {k: [] for k in parts}
    for t in range(ticks):
        cursor = beat(sm, jobs, cursor, changed, t + 3)
        before = dict(parts)
        w0, c0 = time.perf_counter(), time.process_time()
        rec.tick()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        for k in parts:
            per_tick[k].append(parts[k] - before[k])
    engine.dispose()
    med = statistics.median
    return {
        "tick_wall_s": round(med(walls), 4),
        "tick_cpu_s": round(med(cpus), 4),
        **{f"{k}_cpu_s": round(med(v), 4) for k, v in per_tick.items()},
    }


# --- the harness --------------------------------------------------------------------------


def tree(rev: str | None, work: Path) -> Path:
    """The source tree at ``rev`` (None: the working tree, as it is)."""
    if rev is None:
        return ROOT
    out = work / f"tree-{rev.replace('/', '_')}"
    if not out.exists():
        out.mkdir()
        data = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", rev],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        with tempfile.TemporaryFile() as f:
            f.write(data)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(out, filter="data")
    return out


def database(backend: str, work: Path) -> tuple[str, Any]:
    """A fresh database URL on ``backend``, and how to drop it."""
    if backend == "sqlite":
        path = work / f"tick-{secrets.token_hex(4)}.db"
        return f"sqlite:///{path}", lambda: None
    import psycopg

    name = "skyresume_tick_" + secrets.token_hex(4)

    def admin(sql: str) -> None:
        with psycopg.connect(PG_ADMIN, autocommit=True) as c:
            c.execute(sql)

    admin(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    return url, lambda: admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def one(src: Path, backend: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    url, drop = database(backend, work)
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--measure", url, "--nodes", str(args.nodes),
             "--ticks", str(args.ticks), "--changed", str(args.changed)],
            check=True, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(src)}, cwd=str(src),
        ).stdout  # fmt: skip
    finally:
        drop()
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--ticks", type=int, default=15)
    p.add_argument("--changed", type=int, default=256, help="nodes that beat before each tick")
    p.add_argument("--before", required=False, help="git revision measured as before")
    p.add_argument(
        "--after", default=None, help="git revision measured as after (default: the working tree)"
    )
    p.add_argument("--backends", default="sqlite", help="sqlite,postgres")
    p.add_argument("--rounds", type=int, default=2, help="alternate measurements of each side")
    p.add_argument("--measure", metavar="URL", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        sys.path.insert(0, os.getcwd())
        print(json.dumps(measure(args.measure, args.nodes, args.ticks, args.changed)))
        return
    work = Path(tempfile.mkdtemp(prefix="skyresume-tick-"))
    sides = {"after": tree(args.after, work)}
    if args.before:
        sides = {"before": tree(args.before, work), **sides}
    results: dict[str, Any] = {}
    for backend in args.backends.split(","):
        got: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
        for _ in range(args.rounds):
            for side, src in sides.items():
                got[side].append(one(src, backend, args, work))
                print(json.dumps({"backend": backend, "side": side, **got[side][-1]}), flush=True)
        row: dict[str, Any] = {}
        for side, runs in got.items():
            row[side] = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
        if "before" in row:
            row["ratio_before_vs_after"] = {
                k: round(row["before"][k] / row["after"][k], 2)
                for k in row["after"]
                if row["after"][k] > 0
            }
        results[backend] = row
    print(
        json.dumps(
            {
                "bench": "tick",
                "nodes": args.nodes,
                "changed_per_tick": args.changed,
                "ticks": args.ticks,
                "before": args.before,
                "after": args.after or "working tree",
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
