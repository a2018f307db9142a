"""Back-pressure on the heartbeat route: under load, a beat is answered at once.

Issue 25: at 2,048 nodes on a busy machine the service fell 9.5 s behind (p99) and
3,030 beats timed out on the clients' side; each of those had cost the service a
whole request before the client gave up. A late answer helps nobody: the agent has
already sent the next beat.

The service is **behind** when any of these says so (:meth:`Pressure.behind`):

* :class:`LoopLag`: how late the event loop runs its callbacks (a task that sleeps
  50 ms and notes how much longer it took). Every request waits that long.
* The **accept queue** of the listening sockets (Linux ``TCP_INFO`` on a listening
  socket: ``tcpi_unacked`` is the connections the kernel holds that the service has
  not accepted yet). Measured at 2,048 nodes under a CFS quota (BENCHMARKS.md): the
  loop's lag stayed under 0.5 s while beats waited 10 s there, unseen by the loop.
  It is read by a thread of its own every ``ACCEPT_PROBE_S`` and its peak over the
  last ``ACCEPT_PEAK_S`` is used: asyncio accepts every waiting connection at once
  when the loop gets to them, so a queue read as a beat arrives is always short.
* Heartbeats **in flight** inside the app (admitted, not yet answered): the
  heartbeat path's own backlog.
* The **flush** (``LiveHeartbeats.unflushed_s``): beats waiting longer than
  ``MAX_UNFLUSHED_S`` for their batched commit. SQL is what other replicas'
  reconcilers read; measured at 2,048 nodes under a 0.3-core quota, a reconciler
  reading SQL saw 954 healthy nodes past the timeout at once.

While it is behind, :class:`HeartbeatAdmission` (ASGI, outermost) answers ``POST
.../heartbeat`` 503 with ``Retry-After`` (whole seconds, RFC 9110) and the interval in
the body, before the body is read, routed or validated, **unless the node needs the
beat**: one this replica has not heard from in half its period is admitted, so
shedding takes the extra beats (a fleet beating faster than told) and never starves
one node of being heard while its peers are (``domain.silence`` would then read it,
rightly, as a node gone quiet amid a hearing fleet). Admitted beats are told the
longest period allowed (a third of the timeout), so a fleet that obeys beats less.
An agent waits ``Retry-After``, with jitter, and does not count the refused beat as a
failure of its own (``agent/client.py``).

:func:`interval_for` is the period every heartbeat and register answer carries: it
grows with the fleet (``silence.heartbeat_interval_s``), so 2,048 nodes send about
256 beats/s, a fixed share of one core, and stays a third of the timeout at most.

The thread work of the heartbeat path (a cache miss loads the job) runs on a limiter
of its own (:data:`HEARTBEAT_THREADS`), so the API's sync routes, which share
anyio's default pool, cannot take every thread it needs, nor it theirs.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

import anyio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Receive, Scope, Send

from orchestrator.domain import silence as sl

#: Event-loop lag over which beats are refused (a beat answered this late is stale).
MAX_LAG_S = 0.5
#: How often the lag is measured.
LAG_PROBE_S = 0.05
#: Worker threads of the heartbeat path's cache loads (none shared with other routes).
HEARTBEAT_THREADS = 4
#: Connections waiting to be accepted over which the service is behind.
MAX_ACCEPT_QUEUE = 64
#: Heartbeats inside the app at once over which the service is behind.
MAX_IN_FLIGHT = 128
#: Seconds beats may wait for their batched commit (flushes run every second).
MAX_UNFLUSHED_S = 5.0
#: How often the probe thread reads the accept queue (one getsockopt per socket).
ACCEPT_PROBE_S = 0.02
#: The accept queue's peak over this long is what counts.
ACCEPT_PEAK_S = 1.0
#: A node heard within this share of its period is refused while the service is
#: behind; one heard longer ago is admitted (it needs the beat).
NEEDS_BEAT_SHARE = 0.5


class LoopLag:
    """The event loop's lateness, measured by a task of its own (started on first use)."""

    def __init__(self, probe_s: float = LAG_PROBE_S) -> None:
        self.probe_s = probe_s
        self.lag_s = 0.0
        """The newest measurement, seconds (a probe still waiting counts as it waits)."""
        self._since = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._since = time.monotonic()
            self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            start = time.monotonic()
            self._since = start
            await asyncio.sleep(self.probe_s)
            self.lag_s = max(0.0, time.monotonic() - start - self.probe_s)

    @property
    def current_s(self) -> float:
        """The lag now: the last probe's, or longer when the probe itself is late."""
        waiting = time.monotonic() - self._since - self.probe_s
        return max(self.lag_s, waiting)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def accept_queue(sockets: Iterable[socket.socket]) -> int | None:
    """Connections the kernel holds for these listening sockets, not yet accepted
    (Linux ``TCP_INFO``: ``tcpi_unacked`` of a listening socket); None when no socket
    could be read (another kernel, a closed socket): unknown, never zero."""
    total, read = 0, False
    for sock in sockets:
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        except (OSError, AttributeError):
            continue
        if len(info) >= 32:
            total += struct.unpack_from("=24xI", info)[0]
            read = True
    return total if read else None


def node_of(path: str) -> tuple[str, str] | None:
    """(job id, node id) of ``/v1/jobs/{job}/attempts/{n}/nodes/{node}/heartbeat``."""
    parts = path.split("/")
    if len(parts) == 9 and parts[1:3] == ["v1", "jobs"] and parts[6] == "nodes":
        return parts[3], parts[7]
    return None


class Pressure:
    """One app's heartbeat back-pressure: whether it is behind, and what it refused."""

    def __init__(
        self,
        fleet_nodes: Callable[[], int],
        *,
        max_lag_s: float | None = None,
        heard_age_s: Callable[[str, str], float | None] | None = None,
        unflushed_s: Callable[[], float] | None = None,
    ) -> None:
        self.lag = LoopLag()
        self.fleet_nodes = fleet_nodes
        """The fleet's live nodes as this replica knows them."""
        self.heard_age_s = heard_age_s
        """Seconds since this replica accepted a beat from (job, node), None if never.
        None itself (a bare middleware): every beat is refused while behind."""
        self.unflushed_s = unflushed_s
        """How long beats have waited for their commit (None: not watched)."""
        self.max_unflushed_s = MAX_UNFLUSHED_S
        self.max_lag_s = max_lag_s
        """None: never refuse (an app embedded in a test or a tool, whose loop is not
        the service's); ``serve`` arms it (:meth:`arm`)."""
        self.max_accept_queue = MAX_ACCEPT_QUEUE
        self.max_in_flight = MAX_IN_FLIGHT
        self.sockets: tuple[socket.socket, ...] = ()
        """The listening sockets whose accept queue is watched (``serve``'s)."""
        self.in_flight = 0
        """Heartbeats admitted and not answered yet."""
        self.refused = 0
        """Beats answered 503 (``/metrics``)."""
        self.refused_by: dict[str, int] = {
            "lag": 0,
            "accept_queue": 0,
            "in_flight": 0,
            "flush": 0,
        }
        """Refused beats by what said the service was behind (``/metrics``)."""
        self._queue: int | None = None
        self._peaks: list[tuple[float, int]] = []
        self._probe: threading.Thread | None = None
        self._stop = threading.Event()

    def arm(
        self,
        max_lag_s: float = MAX_LAG_S,
        *,
        sockets: Iterable[socket.socket] = (),
        max_accept_queue: int = MAX_ACCEPT_QUEUE,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_unflushed_s: float = MAX_UNFLUSHED_S,
    ) -> None:
        """Refuse beats while the service is behind (``serve``)."""
        self.max_lag_s = max_lag_s
        self.max_unflushed_s = max_unflushed_s
        self.sockets = tuple(sockets)
        self.max_accept_queue = max_accept_queue
        self.max_in_flight = max_in_flight
        if self.sockets and self._probe is None:
            self._stop.clear()
            self._probe = threading.Thread(
                target=self._watch_accept_queue, name="accept-queue-probe", daemon=True
            )
            self._probe.start()

    def disarm(self) -> None:
        """Stop the accept-queue probe (``serve``'s shutdown; tests)."""
        self._stop.set()
        if self._probe is not None:
            self._probe.join()
            self._probe = None

    def _watch_accept_queue(self) -> None:
        while not self._stop.wait(ACCEPT_PROBE_S):
            self.note_accept_queue(accept_queue(self.sockets))

    def note_accept_queue(self, queue: int | None, now: float | None = None) -> None:
        """One reading of the accept queue (the probe's; tests call it)."""
        now = time.monotonic() if now is None else now
        self._queue = queue
        if queue is None:
            return
        peaks = [(at, q) for at, q in self._peaks if now - at <= ACCEPT_PEAK_S]
        peaks.append((now, queue))
        self._peaks = peaks  # one writer (the probe); readers take the list whole

    @property
    def accept_queue(self) -> int | None:
        """The watched sockets' accept queue at its peak over the last
        ``ACCEPT_PEAK_S``; None when it cannot be read (or none is watched)."""
        if self._queue is None:
            return None
        now = time.monotonic()
        recent = [q for at, q in self._peaks if now - at <= ACCEPT_PEAK_S]
        return max(recent, default=self._queue)

    def behind(self) -> tuple[str, str] | None:
        """(signal, why) when the service is behind, None when it keeps up or is not
        armed."""
        if self.max_lag_s is None:
            return None
        lag = self.lag.current_s
        if lag > self.max_lag_s:
            return "lag", f"the event loop is {lag:.2f} s late"
        queue = self.accept_queue
        if queue is not None and queue > self.max_accept_queue:
            return "accept_queue", f"{queue} connections wait to be accepted"
        if self.in_flight > self.max_in_flight:
            return "in_flight", f"{self.in_flight} heartbeats are in flight"
        waited = self.unflushed_s() if self.unflushed_s is not None else 0.0
        if waited > self.max_unflushed_s:
            return "flush", f"beats have waited {waited:.1f} s for their commit"
        return None

    def needs_beat(self, path: str) -> bool:
        """The node of this heartbeat path was not heard in ``NEEDS_BEAT_SHARE`` of its
        period (or never): it is admitted even while the service is behind."""
        if self.heard_age_s is None:
            return False
        ids = node_of(path)
        if ids is None:
            return False
        age = self.heard_age_s(*ids)
        return age is None or age >= NEEDS_BEAT_SHARE * self.base_interval_s

    @property
    def base_interval_s(self) -> float:
        return interval_for(int(self.fleet_nodes()))

    @property
    def interval_s(self) -> float:
        """The period agents are told now: the fleet's, or the longest allowed (a
        third of the timeout) while the service is behind."""
        base = self.base_interval_s
        if self.max_lag_s is not None and self.behind() is not None:
            return max(base, longest_interval())
        return base


class HeartbeatAdmission:
    """ASGI middleware: refuse heartbeats fast while the service is behind (module
    docstring), and count the ones in flight."""

    def __init__(self, app: ASGIApp, *, pressure: Pressure) -> None:
        self.app = app
        self.pressure = pressure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        p = self.pressure
        p.lag.ensure_started()
        path = str(scope.get("path", ""))
        if scope.get("method") != "POST" or not path.endswith("/heartbeat"):
            await self.app(scope, receive, send)
            return
        behind = p.behind()
        if behind is not None and not p.needs_beat(path):
            signal, why = behind
            p.refused += 1
            p.refused_by[signal] = p.refused_by.get(signal, 0) + 1
            # Back at its own period: a refused node was heard within half of it,
            # so it is heard again within 2 periods (with the agent's jitter), far
            # inside the timeout (3 periods at least).
            interval = p.base_interval_s
            body = json.dumps(
                {"detail": f"the service is behind ({why}); beat later", "interval_s": interval}
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", str(math.ceil(interval)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        p.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            p.in_flight -= 1


def interval_for(fleet_nodes: int, timeout_s: float = 30.0) -> float:
    """The heartbeat period agents are told, for a fleet of this many live nodes."""
    return sl.heartbeat_interval_s(fleet_nodes, timeout_s=timeout_s)


def longest_interval(timeout_s: float = 30.0) -> float:
    """The longest period agents are ever told: a node is still heard
    ``silence.BEATS_PER_TIMEOUT`` times per timeout."""
    return round(timeout_s / sl.BEATS_PER_TIMEOUT, 3)


def heartbeat_limiter() -> anyio.CapacityLimiter:
    """The heartbeat path's own worker threads (made inside the running loop)."""
    return anyio.CapacityLimiter(HEARTBEAT_THREADS)


class PressureMetrics:
    """``/metrics``: the loop's lag, refused beats, the interval agents are told, and
    whether the reconciler's intake says the control plane is degraded."""

    def __init__(self, pressure: Pressure, app: Any) -> None:
        self.pressure = pressure
        self.app = app

    def collect(self) -> Iterator[Any]:
        p = self.pressure
        yield GaugeMetricFamily(
            "skyresume_event_loop_lag_seconds", "How late the event loop runs", p.lag.current_s
        )
        refused = CounterMetricFamily(
            "skyresume_heartbeats_refused",
            "Heartbeats answered 503 with Retry-After (back-pressure), by what said the "
            "service was behind (lag, accept_queue, in_flight, flush)",
            labels=["signal"],
        )
        for signal, n in sorted(p.refused_by.items()):
            refused.add_metric([signal], n)
        yield refused
        queue = p.accept_queue
        if queue is not None:
            yield GaugeMetricFamily(
                "skyresume_accept_queue",
                "Connections the kernel holds that the service has not accepted yet",
                queue,
            )
        yield GaugeMetricFamily(
            "skyresume_heartbeats_in_flight", "Heartbeats admitted, not answered yet", p.in_flight
        )
        if p.unflushed_s is not None:
            yield GaugeMetricFamily(
                "skyresume_heartbeats_unflushed_seconds",
                "How long accepted beats have waited for their batched commit",
                p.unflushed_s(),
            )
        yield GaugeMetricFamily(
            "skyresume_heartbeat_interval_seconds", "The period agents are told", p.interval_s
        )
        rec = getattr(self.app.state, "reconciler", None)
        log = getattr(rec, "intake", None)
        latest = log.latest if log is not None else None
        if log is None or latest is None:
            return  # no reconciler here: no intake to speak of (missing, not healthy)
        yield GaugeMetricFamily(
            "skyresume_fleet_heard_share",
            "Share of the fleet's live nodes heard in the hearing window (last tick)",
            latest.share,
        )
        degraded = log.degraded(datetime.now(UTC))
        yield GaugeMetricFamily(
            "skyresume_control_plane_degraded",
            "1 while the service hears too little of the fleet or stalled "
            "(silence is not held against nodes meanwhile)",
            1.0 if degraded else 0.0,
        )
