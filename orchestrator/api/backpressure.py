"""Back-pressure on the heartbeat route: under load, a beat is answered at once.

Issue 25: at 2,048 nodes on a busy machine the service fell 9.5 s behind (p99) and
3,030 beats timed out on the clients' side; each of those had cost the service a
whole request before the client gave up. A late answer helps nobody: the agent has
already sent the next beat.

* :class:`LoopLag` measures how late the event loop runs its callbacks (a task that
  sleeps 50 ms and notes how much longer it took). Every request, the heartbeat
  included, waits that long before a handler sees it.
* :class:`HeartbeatAdmission` (ASGI, outermost): while the lag is over
  ``max_lag_s``, ``POST .../heartbeat`` is answered 503 with ``Retry-After`` (whole
  seconds, RFC 9110) and the longer interval in the body, before the body is read,
  routed or validated. An agent then waits that long, with jitter, and does not count
  the refused beat as a failure of its own (``agent/client.py``). The service's own
  deafness meanwhile is not held against the nodes (``domain.silence``: a refused
  beat lowers the fleet's intake, which forgives the silence it causes).
* :func:`interval_for` is the period every heartbeat and register answer carries: it
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
import time
from collections.abc import Callable, Iterator
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


class Pressure:
    """One app's heartbeat back-pressure: its loop lag and what it refused."""

    def __init__(self, fleet_nodes: Callable[[], int], *, max_lag_s: float | None = None) -> None:
        self.lag = LoopLag()
        self.fleet_nodes = fleet_nodes
        """The fleet's live nodes as this replica knows them."""
        self.max_lag_s = max_lag_s
        """None: never refuse (an app embedded in a test or a tool, whose loop is not
        the service's); ``serve`` arms it (:meth:`arm`)."""
        self.refused = 0
        """Beats answered 503 (``/metrics``)."""

    def arm(self, max_lag_s: float = MAX_LAG_S) -> None:
        """Refuse beats while the loop lags more than ``max_lag_s`` (``serve``)."""
        self.max_lag_s = max_lag_s

    @property
    def interval_s(self) -> float:
        """The period agents are told now."""
        return interval_for(int(self.fleet_nodes()))


class HeartbeatAdmission:
    """ASGI middleware: refuse heartbeats fast while the loop lags (module docstring)."""

    def __init__(self, app: ASGIApp, *, pressure: Pressure) -> None:
        self.app = app
        self.pressure = pressure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        p = self.pressure
        p.lag.ensure_started()
        if (
            scope.get("method") == "POST"
            and str(scope.get("path", "")).endswith("/heartbeat")
            and p.max_lag_s is not None
            and p.lag.current_s > p.max_lag_s
        ):
            p.refused += 1
            interval = 2.0 * p.interval_s
            body = json.dumps(
                {
                    "detail": f"the service is behind ({p.lag.current_s:.2f} s); beat later",
                    "interval_s": interval,
                }
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
        await self.app(scope, receive, send)


def interval_for(fleet_nodes: int, timeout_s: float = 30.0) -> float:
    """The heartbeat period agents are told, for a fleet of this many live nodes."""
    return sl.heartbeat_interval_s(fleet_nodes, timeout_s=timeout_s)


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
        yield CounterMetricFamily(
            "skyresume_heartbeats_refused",
            "Heartbeats answered 503 with Retry-After (back-pressure)",
            p.refused,
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
