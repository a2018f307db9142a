"""Failover of the reconciler between ``skyresume serve`` replicas on PostgreSQL.

    python bench/failover.py                     # 3 replicas, 4 incidents
    python bench/failover.py --replicas 2 --incidents 6 --seed 7

N replicas of ``skyresume serve`` share one PostgreSQL database and one home (the
local launcher's records, as replicas share one cloud account), behind a TCP load
balancer in this process (what a deployment puts in front of them: nodes and the CLI
are given its address, ``SKYRESUME_SERVICE_URL``, and it stops sending to a replica
the harness took out, as a health check would). Nodes share this machine's loopback
(``SKYRESUME_LOCAL_NETWORK=loopback``): no network namespace is made.

One 2-node CPU GPT job runs. For each incident the harness kills a node with the CLI
(``skyresume chaos kill-node``), waits until a protocol step chosen at random has
started, and then takes the current leader out (whoever holds the ``reconciler``
lease row), alternately with SIGKILL (it is started again later) and SIGSTOP (it is
resumed with SIGCONT after the lease's TTL and more, to find its leadership gone). It
reports:

- the time from taking the leader out to another replica holding the lease (the TTL
  is 10 s; a new leader must come within it, plus one reconcile interval);
- never a double launch: the launcher's own claims (one per (job, attempt, try)) and
  every node's agent starts (its ``run.log``): each attempt launched once, each node
  started once, each attempt's nodes registered once;
- every incident completes (the relaunch validated on every rank), every step ended
  ok or skipped.

Ends with one JSON line: ``{"bench": "failover", ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from crashsafe import (  # bench/ is not a package: found on sys.path
    ROOT,
    Service,
    Watch,
    agent_starts,
    agent_wheel,
    cleanup_nodes,
    database,
    free_port,
    launch_keys,
    wait,
)

TTL_S = 10.0  # the Reconciler's lease_s
INTERVAL_S = 0.5  # SKYRESUME_RECONCILE_INTERVAL_S
STEPS = ("detect", "signal", "confirm_checkpoint", "select_replacement", "launch", "stage",
         "validate")  # fmt: skip


class Balancer:
    """A TCP load balancer on loopback: each connection goes to the next replica that
    is in; taking one out closes its open connections (clients reconnect elsewhere)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.backends: dict[int, bool] = {}
        self._conns: dict[int, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def set_in(self, port: int, up: bool) -> None:
        with self._lock:
            self.backends[port] = up
            dropped = [] if up else self._conns.pop(port, [])
        for s in dropped:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            ports = [p for p, up in self.backends.items() if up]
            self._next += 1
            start = self._next
        for k in range(len(ports)):
            port = ports[(start + k) % len(ports)]
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=1.0)
            except OSError:
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns.setdefault(port, []).extend([client, upstream])
            t = threading.Thread(target=self._pipe, args=(upstream, client), daemon=True)
            t.start()
            self._pipe(client, upstream)
            t.join()
            return
        client.close()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:  # a side reset or closed: this connection is over either way
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def leader(w: Watch) -> tuple[str, int] | None:
    rows = w.rows("SELECT holder, epoch FROM leases WHERE name = 'reconciler'")
    return (str(rows[0][0]), int(rows[0][1])) if rows else None


def _expires(w: Watch) -> float:
    """When the reconciler lease runs out (epoch seconds)."""
    from datetime import UTC

    (row,) = w.rows("SELECT expires_at FROM leases WHERE name = 'reconciler'")
    at = row[0] if row[0].tzinfo is not None else row[0].replace(tzinfo=UTC)
    return float(at.timestamp())


def replica_of(holder: str, replicas: list[Service]) -> Service | None:
    """The replica whose process holds the lease (holder = host:pid:object)."""
    try:
        pid = int(holder.split(":")[1])
    except (IndexError, ValueError):
        return None
    return next((r for r in replicas if r.proc is not None and r.proc.pid == pid), None)


def cli(home: Path, url: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
    env.update(SKYRESUME_HOME=str(home), SKYRESUME_SERVICE_URL=url)
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"skyresume {' '.join(args)}: {out.stderr.strip()[-300:]}")
    return out.stdout


def run(
    replicas: int = 3, incidents: int = 4, seed: int = 1, timeout_s: float = 240.0,
    home: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    import tempfile

    rnd = random.Random(seed)
    base = home or Path(tempfile.mkdtemp(prefix="skyresume-failover-"))
    h = base / "home"
    lb = Balancer()
    doc: dict[str, Any] = {"bench": "failover", "replicas": replicas, "seed": seed,
                           "ttl_s": TTL_S, "rounds": [], "problems": []}  # fmt: skip
    with database("postgres", base) as url:
        env = {
            "SKYRESUME_SERVICE_URL": f"http://127.0.0.1:{lb.port}",
            "SKYRESUME_AGENT_PACKAGE": agent_wheel(base),
        }
        svcs = [Service(h, url, env=env) for _ in range(replicas)]
        w = Watch(url)
        try:
            svcs[0].start()
            svcs[0].ready()  # the schema is migrated once, by the first
            lb.set_in(svcs[0].port, True)
            for s in svcs[1:]:
                s.start(SKYRESUME_AUTO_MIGRATE="false")
            for s in svcs[1:]:
                s.ready()
                lb.set_in(s.port, True)
            job = _job(h, lb.port, w, timeout_s)
            doc["job"] = job
            for i in range(incidents):
                doc["rounds"].append(_round(i, job, h, lb, svcs, w, rnd, timeout_s))
            cli(h, f"http://127.0.0.1:{lb.port}", "cancel", job)
            wait("the job cancelled, its nodes released", lambda: _released(w, job), timeout_s)
            _check(doc, h, w, job, incidents)
        except (TimeoutError, RuntimeError) as e:
            doc["problems"].append(f"{type(e).__name__}: {e}")
        finally:
            for s in svcs:
                s.stop()
            w.close()
            lb.close()
            cleanup_nodes(h)
    takeovers = [r["takeover_s"] for r in doc["rounds"] if r.get("takeover_s") is not None]
    doc["takeover_s_max"] = max(takeovers) if takeovers else None
    doc["takeover_s"] = takeovers
    late = [t for t in takeovers if t > TTL_S + 2 * INTERVAL_S]
    if late:
        doc["problems"].append(f"a new leader later than the TTL: {late}")
    after = [r["after_expiry_s"] for r in doc["rounds"] if "after_expiry_s" in r]
    doc["after_expiry_s_max"] = max(after) if after else None
    doc["ok"] = not doc["problems"] and len(doc["rounds"]) == incidents
    return doc


def _job(home: Path, port: int, w: Watch, timeout_s: float) -> str:
    spec = {
        "name": "failover",
        "task": {
            "template": "gpt-cpu",
            "command": f"{sys.executable} -m training.examples.train_gpt --max-steps 100000 "
            "--step-sleep 0.1",
        },
        "num_nodes": 2,
        "ranks_per_node": 1,
        "checkpoint": {"uri": f"file://{home / 'checkpoints'}", "every_steps": 10,
                       "keep": 3, "adaptive": False},
        "restarts": {"max_restarts": 50, "heartbeat_timeout_s": 30, "grace_period_s": 20},
    }  # fmt: skip
    path = home / "job.json"
    path.write_text(json.dumps(spec))
    out = cli(home, f"http://127.0.0.1:{port}", "submit", str(path), "--output", "json")
    job = str(json.loads(out)["id"])
    wait("attempt 1 validated", lambda: w.validated(job, 1), timeout_s)
    return job


def _current(w: Watch, job: str) -> int:
    return max(n for n, _ in w.attempts(job))


def _step_count(w: Watch, job: str, step: str) -> int:
    return int(
        w.rows(
            "SELECT count(*) FROM protocol_steps WHERE job_id = :j AND step = :s", j=job, s=step
        )[0][0]
    )


def _round(
    i: int, job: str, home: Path, lb: Balancer, svcs: list[Service], w: Watch,
    rnd: random.Random, timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    n = _current(w, job)
    ckpt = home / "checkpoints"
    wait(f"attempt {n} validated", lambda: w.validated(job, n), timeout_s)
    wait("a checkpoint", lambda: any(ckpt.glob("step_*/COMMIT*")), timeout_s)
    how = "SIGKILL" if i % 2 == 0 else "SIGSTOP"
    at = rnd.choice(STEPS)
    node = rnd.choice((0, 1))
    r: dict[str, Any] = {"incident": i + 1, "attempt": n, "node": node, "leader_out": how,
                         "at_step": at}  # fmt: skip
    cli(home, f"http://127.0.0.1:{lb.port}", "chaos", "kill-node", job, "--node", str(node))
    wait(f"step {at} of incident {i + 1}", lambda: _step_count(w, job, at) > i, timeout_s, 0.02)
    old = leader(w)
    victim = replica_of(old[0], svcs) if old else None
    if victim is None or old is None:
        raise RuntimeError(f"no replica holds the lease ({old})")
    t0 = time.monotonic()
    lb.set_in(victim.port, False)
    victim.kill(signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP)
    expires = _expires(w)  # the out leader's last renewal, plus the TTL
    got = wait("a new leader", lambda: (x := leader(w)) and x[0] != old[0] and x, TTL_S * 3, 0.05)
    r["takeover_s"] = round(time.monotonic() - t0, 2)
    r["after_expiry_s"] = round(time.time() - expires, 2)
    r["epochs"] = [old[1], got[1]]
    taker = replica_of(got[0], svcs)
    r["new_leader"] = svcs.index(taker) if taker is not None else None
    r["old_leader"] = svcs.index(victim)
    if how == "SIGSTOP":
        # Paused past its lease: resumed, it must find its fence refused and act on
        # nothing it decided before the pause.
        time.sleep(max(0.0, TTL_S + 5 - (time.monotonic() - t0)))
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGCONT)
    else:
        victim.start(SKYRESUME_AUTO_MIGRATE="false")
    wait(f"attempt {n + 1} validated", lambda: w.validated(job, n + 1), timeout_s)
    r["recovered_s"] = round(time.monotonic() - t0, 1)
    victim.ready()
    lb.set_in(victim.port, True)
    return r


def _released(w: Watch, job: str) -> bool:
    if w.status(job) != "CANCELLED":
        return False
    return not w.rows("SELECT number FROM attempts WHERE job_id = :j AND state != 'ended'", j=job)


def _check(doc: dict[str, Any], home: Path, w: Watch, job: str, incidents: int) -> None:
    n = incidents + 1
    keys = launch_keys(home, job)
    doc["launch_keys"] = keys
    if keys != sorted(f"{job}-a{k}" for k in range(1, n + 1)):
        doc["problems"].append(f"launches {keys}: wanted one per attempt 1..{n}")
    starts = agent_starts(home, job)
    doc["agent_starts"] = sum(starts.values())
    twice = {k: v for k, v in starts.items() if v != 1}
    if twice or len(starts) != 2 * n:
        doc["problems"].append(f"agent starts per node {starts}")
    registered = Counter(a for a, _ in w.nodes(job))
    if dict(registered) != {k: 2 for k in range(1, n + 1)}:
        doc["problems"].append(f"nodes registered per attempt {dict(registered)}")
    steps = w.rows("SELECT incident_id, step, outcome FROM protocol_steps WHERE job_id = :j", j=job)
    per: dict[int, dict[str, str]] = {}
    for inc, step, outcome in steps:
        per.setdefault(inc, {})[step] = outcome
    doc["incidents"] = len(per)
    for inc, s in per.items():
        if len(s) != 7 or any(o not in ("ok", "skipped") for o in s.values()):
            doc["problems"].append(f"incident {inc}: steps {s}")
    if len(per) != incidents:
        doc["problems"].append(f"{len(per)} incidents, wanted {incidents}")
    events = w.events(job)
    doc["events"] = dict(Counter(e["kind"] for e in events))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--incidents", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--home", type=Path, default=None)
    a = p.parse_args()
    t0 = time.monotonic()
    doc = run(a.replicas, a.incidents, a.seed, home=a.home)
    doc["seconds"] = round(time.monotonic() - t0)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
