"""The FastAPI app factory. Nothing is built at import time: ``create_app(settings)``
makes the engine, the session factory and the token for this app alone, so tests
can run several apps against several databases in one process.

It stands above both ``api`` (the REST routers) and ``dashboard`` (the pages), because
it mounts both: the dashboard uses the API's request session and operator auth, so a
factory inside ``api`` that imported the dashboard made the two packages a circle
(``tests/test_import_layers.py`` fails on any package circle)."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import Engine, func, select, text
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator import __version__
from orchestrator.alerts.loop import AlertMetrics, operator_loop
from orchestrator.api import (
    openapi,
    routes_agents,
    routes_goodput,
    routes_jobs,
    routes_operator,
    routes_recovery,
    routes_tokens,
)
from orchestrator.api.auth import ensure_local_token, install_redaction
from orchestrator.api.backpressure import HeartbeatAdmission, Pressure, PressureMetrics
from orchestrator.api.limits import (
    RequestLimits,
    http_error_handler,
    validation_error_handler,
)
from orchestrator.dashboard import routes as dashboard
from orchestrator.domain.status import JobStatus
from orchestrator.settings import Settings
from orchestrator.store.db import make_engine, make_sessionmaker
from orchestrator.store.liveness import LiveHeartbeats
from orchestrator.store.models import Job

log = logging.getLogger(__name__)


class _JobsByStatus:
    """Computed at scrape time from the database, so every replica reports the truth."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self):  # type: ignore[no-untyped-def]
        g = GaugeMetricFamily("skyresume_jobs", "Jobs by current status", labels=["status"])
        counts = dict.fromkeys(JobStatus, 0)
        try:
            with self.app.state.sessionmaker() as s:
                for st, n in s.execute(select(Job.status, func.count()).group_by(Job.status)):
                    counts[JobStatus(st)] = n
        except Exception:  # a scrape must not fail because the DB blinked
            log.exception("metrics: could not count jobs")
            return
        for st, n in counts.items():
            g.add_metric([st.value], n)
        yield g


class _Measure:
    """Counts and times every HTTP request by method, route template and status.

    Plain ASGI, not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs
    each request through a task group and memory streams, which was about half of a
    heartbeat's cost in the service (bench/heartbeats.py, in-process split)."""

    def __init__(self, app: Any, *, requests: Counter, latency: Histogram) -> None:
        self.app = app
        self.requests = requests
        self.latency = latency

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets when the app raises

        async def send_(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            # The router puts the matched route into this same scope dict.
            path = getattr(scope.get("route"), "path", "unmatched")
            self.requests.labels(scope["method"], path, str(status)).inc()
            self.latency.labels(scope["method"], path).observe(time.perf_counter() - start)


class _StrictTransport:
    """HSTS on every answer when ``serve`` speaks HTTPS itself: a browser that once
    reached the dashboard over TLS never sends its session cookie in clear again."""

    HEADER = (b"strict-transport-security", b"max-age=31536000")

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.HEADER]}
            await send(message)

        await self.app(scope, receive, send_)


def _heard_age_s(app: FastAPI, job_id: str, node_id: str) -> float | None:
    """Seconds since this replica accepted a beat from the node; None if never (no I/O:
    the liveness memory)."""
    beat = app.state.liveness.latest(job_id, node_id)
    return None if beat is None else (datetime.now(UTC) - beat.at).total_seconds()


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(
        title="skyresume",
        version=__version__,
        description="Jobs, failure events and recoveries for spot-instance training.",
        # Swagger UI and ReDoc load their scripts from a CDN: off unless SKYRESUME_DOCS.
        docs_url="/docs" if settings.docs else None,
        redoc_url="/redoc" if settings.docs else None,
    )
    openapi.install(app)  # the job spec body, 4xx answers and the bearer scheme
    app.state.settings = settings
    app.state.engine = engine or make_engine(settings.effective_database_url)
    app.state.sessionmaker = make_sessionmaker(app.state.engine)
    # Heartbeats: checked and kept in memory, flushed in batches (``serve`` starts it).
    app.state.liveness = LiveHeartbeats(app.state.sessionmaker)
    app.state.token = ensure_local_token(settings)
    install_redaction(app.state.token)  # no log line carries it (auth.RedactSecrets)
    app.state.launcher = None  # set by attach_reconciler (serve); chaos needs one

    registry = CollectorRegistry()
    requests = Counter(
        "skyresume_http_requests", "HTTP requests", ["method", "route", "code"], registry=registry
    )
    latency = Histogram(
        "skyresume_http_request_seconds", "HTTP latency", ["method", "route"], registry=registry
    )
    registry.register(_JobsByStatus(app))
    # Alerts, the run's time series: built here, started by ``serve`` (run_service).
    app.state.operator = operator_loop(app)
    registry.register(AlertMetrics(app.state.sessionmaker))
    # Heartbeats are refused fast (503 + Retry-After) while the service is behind, but
    # never one a node needs to be heard (backpressure.py).
    app.state.pressure = Pressure(
        lambda: app.state.liveness.fleet_nodes,
        heard_age_s=lambda j, n: _heard_age_s(app, j, n),
        unflushed_s=lambda: app.state.liveness.unflushed_s,
    )
    registry.register(PressureMetrics(app.state.pressure, app))
    app.state.registry = registry

    app.add_middleware(_Measure, requests=requests, latency=latency)

    # Outermost (added last): body size limits and NUL-free URLs before any route;
    # a 422 cuts the inputs it echoes (api/limits.py).
    app.add_middleware(HeartbeatAdmission, pressure=app.state.pressure)
    app.add_middleware(RequestLimits, max_headers=settings.max_headers)
    if settings.tls_cert is not None:
        app.add_middleware(_StrictTransport)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    def readyz() -> Response:
        """The database answers and has the schema."""
        try:
            with app.state.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
                conn.execute(select(func.count()).select_from(Job))
        except Exception as e:
            return JSONResponse({"status": "unavailable", "reason": type(e).__name__}, 503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain")

    app.include_router(routes_jobs.router)
    app.include_router(routes_goodput.router)
    app.include_router(dashboard.router)
    app.include_router(routes_agents.router)
    app.include_router(routes_recovery.router)
    app.include_router(routes_tokens.router)
    app.include_router(routes_operator.agent_router)
    app.include_router(routes_operator.router)
    return app
