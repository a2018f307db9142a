"""Preemption-notice fan-out: notice appears -> SIGTERM received by every rank.

    python bench/fanout.py                      # 64 nodes x 8 ranks (the issue's size)
    python bench/fanout.py --nodes 4 --ranks 2  # a quick run

One metadata simulator serves every node. Each node is a real ``skyresume-agent``
(direct launcher) with light stdlib rank processes that note the wall-clock time
their SIGTERM handler runs and send it to this script over UDP. Once every rank is
up, a notice is set for every node at a known time; latency = the rank's SIGTERM
time - the time its node's notice was set. Only the fan-out is measured, not the
(slow, on 2 cores) start of hundreds of processes.

Two ways, same fleet size, same run:

* ``local_first`` (skyresume): the agent polls metadata every ``--poll-s`` and
  SIGTERMs its ranks the moment it reads a notice, then reports it.
* ``service_round_trip`` (the baseline): the same agents, but on a notice they only
  report it (``--notice-action report``) and act on the command the service sends
  back: report -> ``skyresume serve`` (SQLite) -> a relay standing in for the
  reconciler (polling events every 100 ms, faster than the real one) enqueues
  ``checkpoint_and_stop`` -> the agent's command long-poll -> SIGTERM.

Target (issue #5): p99 <= one poll interval + 250 ms. Ends with one JSON line
``{"bench": "fanout", ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.cloud.simulator import MetadataSimulator  # noqa: E402

#: The rank: ready on start, then the time its SIGTERM handler runs. ``-S`` keeps the
#: start light (no site packages): 512 of these must start on 2 cores.
RANK_CODE = r"""
import os, signal, socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
host, port = os.environ["FANOUT_COLLECTOR"].rsplit(":", 1)
dest = (host, int(port))
tag = os.environ["SKYRESUME_RUN_NODE_ID"] + " " + os.environ["RANK"]
def term(signum, frame):
    t = time.time()
    s.sendto(("term %s %r" % (tag, t)).encode(), dest)
    os._exit(75)
signal.signal(signal.SIGTERM, term)
s.sendto(("ready %s" % tag).encode(), dest)
while True:
    signal.pause()
"""


@dataclass
class Collector:
    """UDP sink for the ranks' ready/term datagrams."""

    ready: set[tuple[str, int]] = field(default_factory=set)
    term: dict[tuple[str, int], float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.stopped = False
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def addr(self) -> str:
        host, port = self.sock.getsockname()
        return f"{host}:{port}"

    def _run(self) -> None:
        while not self.stopped:
            try:
                data = self.sock.recv(512).decode()
            except TimeoutError:
                continue
            parts = data.split()
            with self.lock:
                if parts[0] == "ready":
                    self.ready.add((parts[1], int(parts[2])))
                elif parts[0] == "term":
                    self.term[(parts[1], int(parts[2]))] = float(parts[3])

    def wait(self, what: str, count: int, n: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                have = len(self.ready if what == "ready" else self.term)
            if have >= n * count:
                return True
            time.sleep(0.05)
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """``skyresume serve`` on SQLite (reconciler off: the relay below plays its part)."""

    def __init__(self, home: Path, db_url: str | None) -> None:
        import httpx

        from orchestrator.store import db

        self.home = home
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "SKYRESUME_HOME": str(home), "SKYRESUME_PORT": str(port)}
        env["SKYRESUME_RECONCILE"] = "0"
        env.pop("SKYRESUME_TOKEN", None)
        home.mkdir(parents=True)
        self.db_url = db_url or f"sqlite:///{home / 'skyresume.db'}"
        env["SKYRESUME_DATABASE_URL"] = self.db_url
        db.upgrade(self.db_url)
        self.log = (home / "serve.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise SystemExit("error: skyresume serve did not become ready in 60 s")
        self.token = (home / "token").read_text().strip()
        from orchestrator.store.db import make_engine, make_sessionmaker

        self.engine = make_engine(self.db_url)
        self.sessionmaker = make_sessionmaker(self.engine)

    def new_job(self, name: str) -> str:
        """A job and its running attempt 1, written as the service and reconciler would."""
        from orchestrator.domain.spec import validate_job_spec
        from orchestrator.store import repo
        from orchestrator.store.models import Attempt

        spec = {
            "name": name,
            "task": {"template": "gpt-cpu", "command": "python -m training.examples.train_gpt"},
            "num_nodes": 1,
            "accelerators": [],
            "checkpoint": {"uri": "file:///tmp/skyresume-fanout"},
        }
        with self.sessionmaker() as s, s.begin():
            job = repo.create_job(s, validate_job_spec(spec))
            s.add(
                Attempt(
                    job_id=job.id, number=1, cloud="local", region="local", instance_type="cpu",
                    num_nodes=1, spot=True, knobs={}, started_at=datetime.now(UTC),
                    state="running", launcher="bench",
                )
            )  # fmt: skip
            return job.id

    def relay(self, stop: threading.Event) -> None:
        """What the reconciler does with a notice: checkpoint_and_stop for the attempt."""
        from sqlalchemy import select

        from orchestrator.store import agents
        from orchestrator.store.models import FailureEvent

        last = 0
        while not stop.is_set():
            with self.sessionmaker() as s, s.begin():
                q = select(FailureEvent).where(
                    FailureEvent.id > last, FailureEvent.kind == "preemption_notice"
                )
                for ev in s.scalars(q.order_by(FailureEvent.id)):
                    last = ev.id
                    agents.enqueue_command(
                        s, ev.job_id, 1, "checkpoint_and_stop", {"reason": "notice", "grace_s": 30}
                    )
            stop.wait(0.1)

    def close(self) -> None:
        self.proc.kill()  # no graceful wait on 64 open long-polls
        self.proc.wait()
        self.engine.dispose()
        self.log.close()


def run_fleet(
    mode: str,
    nodes: int,
    ranks: int,
    poll_s: float,
    provider: str,
    workdir: Path,
    db_url: str | None = None,
) -> dict[str, object]:
    sim = MetadataSimulator().start()
    coll = Collector()
    service = Service(workdir / f"{mode}-svc", db_url) if mode == "service_round_trip" else None
    relay_stop = threading.Event()
    agents_: list[subprocess.Popen[bytes]] = []
    names = [f"{mode[:5]}-n{i}" for i in range(nodes)]
    try:
        jobs = [service.new_job(f"fanout-{i}") for i in range(nodes)] if service else []
        if service:
            from orchestrator.api.auth import job_token

            threading.Thread(target=service.relay, args=(relay_stop,), daemon=True).start()
        t_start = time.monotonic()
        for i, node in enumerate(names):
            env = {
                **os.environ,
                "FANOUT_COLLECTOR": coll.addr,
                "SKYRESUME_AGENT_LOG_LEVEL": "WARNING",
            }
            argv = [
                sys.executable, "-m", "orchestrator.agent", "--attempt", "1",
                "--node-id", node, "--nproc-per-node", str(ranks), "--launcher", "direct",
                "--local-dir", str(workdir / mode / node), "--provider", provider,
                "--metadata-url", sim.node_url(node), "--poll-s", str(poll_s), "--grace-s", "30",
            ]  # fmt: skip
            if service:
                env["SKYRESUME_AGENT_TOKEN"] = job_token(service.token, jobs[i], 1)
                argv += [
                    "--service-url",
                    service.url,
                    "--job-id",
                    jobs[i],
                    "--notice-action",
                    "report",
                ]
            else:
                argv += ["--job-id", "fanout"]
            argv += ["--", sys.executable, "-S", "-c", RANK_CODE]
            log = (workdir / f"{node}.log").open("w")
            # Each node its own process group (agent + direct ranks): killed as one.
            agents_.append(
                subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
            )
        if not coll.wait("ready", ranks, nodes, timeout=600):
            raise SystemExit(f"error: only {len(coll.ready)} of {nodes * ranks} ranks came up")
        started_s = time.monotonic() - t_start
        time.sleep(2 * poll_s + 1.0)  # every poller in its steady rhythm
        set_at: dict[str, float] = {}
        for node in names:
            set_at[node] = time.time()
            sim.schedule_notice(
                node, provider, "terminate" if provider == "aws" else "preempt", 120
            )
        done = coll.wait("term", ranks, nodes, timeout=120)
        lat = sorted(t - set_at[node] for (node, _), t in coll.term.items())
        by_node: dict[str, list[float]] = {}
        for (node, _), t in coll.term.items():
            by_node.setdefault(node, []).append(t)
        spread = sorted(max(ts) - min(ts) for ts in by_node.values() if len(ts) == ranks)
        end = time.monotonic() + 60
        for p in agents_:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, end - time.monotonic()))
        result: dict[str, object] = {
            "received": len(lat),
            "expected": nodes * ranks,
            "complete": done,
            "start_s": round(started_s, 1),
            "p50_s": round(quantile(lat, 0.50), 3),
            "p99_s": round(quantile(lat, 0.99), 3),
            "max_s": round(lat[-1], 3) if lat else None,
            "node_spread_p99_ms": round(1000 * quantile(spread, 0.99), 1),
        }
        print(f"{mode}: {json.dumps(result)}", file=sys.stderr, flush=True)
        return result
    finally:
        relay_stop.set()
        for p in agents_:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        coll.stopped = True
        sim.stop()
        if service:
            service.close()


PG_BASE = os.environ.get("SKYRESUME_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@contextlib.contextmanager
def postgres_database(wanted: str) -> Iterator[str | None]:
    """A fresh PostgreSQL database for the service (dropped after), or None for SQLite.

    64 nodes heartbeating once a second are 64 writes/s: PostgreSQL's job in
    production; SQLite on 2 busy cores stalls on its single writer lock."""
    if wanted == "sqlite":
        yield None
        return
    import secrets

    try:
        import psycopg

        name = "skyresume_fanout_" + secrets.token_hex(4)
        with psycopg.connect(PG_BASE, autocommit=True, connect_timeout=5) as c:
            c.execute(f'CREATE DATABASE "{name}"')
    except Exception as e:
        if wanted == "postgres":
            raise SystemExit(f"error: PostgreSQL unreachable at {PG_BASE}: {e}") from None
        print(f"PostgreSQL unreachable ({e}); the service uses SQLite", file=sys.stderr)
        yield None
        return
    try:
        yield f"{PG_BASE.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(PG_BASE, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=1000, method="inclusive")[round(q * 1000) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=8, help="rank processes per node")
    ap.add_argument("--poll-s", type=float, default=1.0, help="the agents' metadata poll interval")
    ap.add_argument("--provider", default="aws", choices=["aws", "azure"])
    ap.add_argument("--no-baseline", action="store_true", help="skip the service round trip")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument(
        "--db",
        default="auto",
        choices=["auto", "postgres", "sqlite"],
        help="the baseline service's database (auto: PostgreSQL at 127.0.0.1:5432 if up)",
    )
    a = ap.parse_args()
    if a.nodes < 1 or a.ranks < 1 or a.poll_s <= 0:
        ap.error("--nodes and --ranks must be >= 1 and --poll-s > 0")
    work = Path(tempfile.mkdtemp(prefix="skyresume-fanout-"))
    try:
        local = run_fleet("local_first", a.nodes, a.ranks, a.poll_s, a.provider, work)
        base = None
        if not a.no_baseline:
            with postgres_database(a.db) as db_url:
                base = run_fleet(
                    "service_round_trip", a.nodes, a.ranks, a.poll_s, a.provider, work, db_url
                )
                base["db"] = "postgresql" if db_url else "sqlite"
    finally:
        if a.keep:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    target = a.poll_s + 0.25
    print(
        f"notice -> SIGTERM received, {a.nodes} nodes x {a.ranks} ranks,"
        f" poll {a.poll_s} s ({a.provider})"
    )
    rows = [("local_first (skyresume)", local)] + ([("service_round_trip", base)] if base else [])
    for name, r in rows:
        print(
            f"  {name:26s} p50 {r['p50_s']:.3f} s  p99 {r['p99_s']:.3f} s  max {r['max_s']:.3f} s"
            f"  spread within a node p99 {r['node_spread_p99_ms']} ms"
            f"  ({r['received']}/{r['expected']} ranks; fleet start {r['start_s']} s)"
        )
    meets = bool(local["complete"]) and float(local["p99_s"]) <= target  # type: ignore[arg-type]
    print(f"  target p99 <= poll + 0.25 s = {target:.2f} s: {'met' if meets else 'NOT met'}")
    out: dict[str, object] = {
        "bench": "fanout",
        "nodes": a.nodes,
        "ranks_per_node": a.ranks,
        "poll_s": a.poll_s,
        "provider": a.provider,
        "p50_s": local["p50_s"],
        "p99_s": local["p99_s"],
        "max_s": local["max_s"],
        "node_spread_p99_ms": local["node_spread_p99_ms"],
        "complete": local["complete"],
        "target_p99_s": target,
        "meets_target": meets,
        "ratio_p99_to_target": round(float(local["p99_s"]) / target, 3),  # type: ignore[arg-type]
    }
    if base:
        out |= {
            "baseline": "service_round_trip",
            "baseline_p50_s": base["p50_s"],
            "baseline_p99_s": base["p99_s"],
            "baseline_complete": base["complete"],
            "baseline_db": base["db"],
            "ratio_p99_to_baseline": round(float(local["p99_s"]) / float(base["p99_s"]), 3),  # type: ignore[arg-type]
        }
    print(json.dumps(out))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
