"""Wiring the service for ``skyresume serve`` and the schema for ``skyresume db``.

``skyresume serve`` is, in order: pick the port (:func:`bind_settings`), migrate the
embedded database and build the app (:func:`build_service`), give it a launcher and a
reconciler (:func:`attach_reconciler`), then run uvicorn with the reconciler started
and release both when it returns (:func:`run_service`). The ``db`` commands move the
schema with Alembic through :mod:`orchestrator.store.db` (:func:`migrate`,
:func:`current_revision`).

Nothing here prints or exits: a failure the operator can fix (a database that cannot
be opened or migrated) raises :class:`DatabaseError`, and the CLI turns it into its
one ``error:`` line. Every heavy import (FastAPI, SQLAlchemy, uvicorn, launchers)
happens inside the function that needs it, so importing this module is as cheap as
``skyresume --help`` must be.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from collections.abc import Callable

    from fastapi import FastAPI

    from orchestrator.domain.reconcile import ReconcileConfig
    from orchestrator.launchers.base import Launcher
    from orchestrator.reconciler.loop import Reconciler
    from orchestrator.settings import Settings


class TLSError(ValueError):
    """The TLS settings cannot serve: a certificate or key that does not load, a CA
    bundle that holds no certificate (the message names the file and why)."""


def check_tls(settings: Settings) -> None:
    """Load what ``serve`` will use for HTTPS now, so a bad file is one line at start
    and not a traceback from inside uvicorn (or a node that cannot verify us later)."""
    import ssl

    try:
        settings.ca_pem()
    except ValueError as e:
        raise TLSError(str(e)) from None
    if settings.tls_cert is None or settings.tls_key is None:
        return
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    except FileNotFoundError as e:
        raise TLSError(f"tls_cert/tls_key: {e.filename}: no such file") from None
    except (ssl.SSLError, OSError) as e:
        raise TLSError(
            f"tls_cert {settings.tls_cert} with tls_key {settings.tls_key} do not load: "
            f"{getattr(e, 'reason', None) or e}"
        ) from None


class DatabaseError(RuntimeError):
    """The database could not be opened, read or migrated; the message is the cause
    (``ExceptionType: text``) without the URL, which the caller prints redacted."""

    @classmethod
    def of(cls, cause: Exception) -> DatabaseError:
        # Drivers report on several lines (psycopg adds a hint, SQLAlchemy a link);
        # the operator gets one line, so scripts and logs keep one record per failure.
        return cls(" ".join(f"{type(cause).__name__}: {cause}".split()))


@dataclass
class Service:
    """A built service, not yet serving: what :func:`run_service` runs and releases."""

    settings: Settings
    app: FastAPI
    reconciler: Reconciler | None
    cleanup: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """Releases what the launcher holds (run on exit, after the reconciler stops)."""


def bind_settings(settings: Settings) -> Settings:
    """``settings`` with a concrete port when port 0 ("any free port") was asked for
    and the reconciler runs: agents are told where the service is before uvicorn
    binds, so the port must be known first."""
    if settings.port != 0 or not settings.reconcile:
        return settings
    from orchestrator.launchers.local import free_port

    return settings.model_copy(update={"port": free_port()})


def build_service(settings: Settings) -> Service:
    """Migrate the embedded database (when the settings say so), build the app and,
    when the reconciler is on, attach it with its launcher (not started)."""
    from orchestrator.api.app import create_app
    from orchestrator.store import db

    check_tls(settings)
    try:
        if settings.should_auto_migrate:
            db.upgrade(settings.effective_database_url)
        app = create_app(settings)
    except Exception as e:  # any driver's error: the operator fixes the URL or the server
        raise DatabaseError.of(e) from e
    service = Service(settings=settings, app=app, reconciler=None)
    if settings.reconcile:
        service.reconciler = attach_reconciler(app, service.cleanup)
    return service


def run_service(service: Service) -> None:
    """Serve until uvicorn returns (Ctrl-C, SIGTERM), the reconciler running meanwhile;
    then stop the reconciler and release the launcher, in that order."""
    import uvicorn

    settings = service.settings
    with service.cleanup:
        # Heartbeats flush in batches from here on; the last flush runs on the way out,
        # after the reconciler stopped (callbacks run last-registered first).
        service.app.state.liveness.start()
        service.cleanup.callback(service.app.state.liveness.stop)
        # Alerts and the run's time series (orchestrator/alerts/loop.py).
        service.app.state.operator.start()
        service.cleanup.callback(service.app.state.operator.stop)
        if service.reconciler is not None:
            service.reconciler.start()
            # Registered last, so it runs first: no reconcile pass may use a launcher
            # that has already been released.
            service.cleanup.callback(service.reconciler.stop)
        config = uvicorn.Config(
            service.app,
            host=settings.host,
            port=settings.port,
            log_level="warning",
            ssl_certfile=settings.tls_cert,
            ssl_keyfile=settings.tls_key,
        )
        sockets = [_bind(settings.host, settings.port)]
        gateway = _node_address(service)
        if gateway is not None and settings.host not in ("0.0.0.0", "::", gateway):
            sockets.append(_bind(gateway, settings.port))  # where the nodes reach us
        # What uvicorn.run does, with our sockets: Ctrl-C is a clean stop.
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.Server(config).run(sockets=sockets)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s


def _node_address(service: Service) -> str | None:
    """This machine's address on the local nodes' bridge, when they live there."""
    from orchestrator.launchers.local import LocalLauncher

    launcher = service.app.state.launcher
    if isinstance(launcher, LocalLauncher) and launcher.fabric is not None:
        return str(launcher.fabric.gateway)
    return None


def launcher_note(service: Service) -> str:
    """What the operator should know about where nodes run (the local fallback)."""
    from orchestrator.launchers.local import LocalLauncher

    launcher = service.app.state.launcher
    return launcher.network_note if isinstance(launcher, LocalLauncher) else ""


def node_service_url(settings: Settings, launcher: Launcher) -> str:
    """The service URL handed to nodes: the local launcher's nodes in namespaces reach
    it on their bridge; everyone else at the public (or configured) URL."""
    from orchestrator.launchers.local import LocalLauncher

    if isinstance(launcher, LocalLauncher):
        return launcher.service_url
    return settings.effective_service_url


def enrolments(settings: Settings, token: str) -> Callable[[str, int], str]:
    """What a launch's task carries for its agents: a single-use enrolment token, not
    the attempt's agent token (SkyPilot keeps task secrets in plaintext in its request
    database): each node exchanges it at its first register (store/tokens.py)."""
    from datetime import timedelta

    from orchestrator.store.tokens import enrolment_token

    ttl = timedelta(seconds=settings.enrolment_ttl_s)
    return lambda job_id, attempt: enrolment_token(token, job_id, attempt, ttl=ttl)


def make_launcher(
    settings: Settings, token: str, cleanup: contextlib.ExitStack, wheels: Any = None
) -> Launcher:
    """The launcher ``settings.launcher`` names, its release registered on ``cleanup``.

    Whoever builds a launcher knows what it holds: the local one runs a metadata
    simulator (an HTTP server thread) that must stop with the service; the SkyPilot
    one holds nothing of its own (SkyPilot's API server outlives us by design). So
    the release is registered here, on the concrete type, instead of the caller
    probing every launcher for a ``close`` that only one of them has."""
    if settings.launcher == "local":
        return _local_launcher(settings, token, cleanup, wheels)
    from orchestrator.launchers.skypilot import sky_client_environment
    from orchestrator.launchers.skypilot_grouping import launcher_for
    from orchestrator.package import agent_package_spec
    from orchestrator.settings import require_routable

    # No telemetry, and never a local API server started by an SDK call (its request
    # database would be new: every request id the store holds, lost).
    sky_client_environment()

    # Its nodes are other hosts: a loopback or bind-all URL would have every agent talk
    # to itself (Settings refuses that too; a model_copy such as bind_settings' skips it).
    require_routable(settings.effective_service_url, launcher="skypilot")
    # What the nodes pip install: the operator's spec, or this service's own wheel
    # (built now, once), by URL pinned to its sha256 (PackageUnavailable: no source tree).
    package = agent_package_spec(settings, wheels)
    # One cluster per attempt or per node (SKYRESUME_SKYPILOT_GROUPING).
    return launcher_for(settings, token_for=enrolments(settings, token), package=package)


class LocalNetworkError(RuntimeError):
    """``local_network=netns`` was asked for where namespaces cannot be made."""


def local_network(settings: Settings) -> tuple[str, str]:
    """(``netns`` | ``loopback``, why) for the local launcher's nodes."""
    from orchestrator.launchers.netns import Fabric

    why = Fabric.unavailable_reason()
    if settings.local_network == "loopback":
        return "loopback", "SKYRESUME_LOCAL_NETWORK=loopback"
    if why is None:
        bridge, subnet = local_bridge(settings)
        return "netns", f"nodes are hosts in network namespaces on {bridge} ({subnet})"
    if settings.local_network == "netns":
        raise LocalNetworkError(f"SKYRESUME_LOCAL_NETWORK=netns, but {why}")
    return "loopback", f"no network namespaces ({why}): nodes share this machine's loopback"


def local_bridge(settings: Settings) -> tuple[str, str]:
    """The local nodes' bridge and subnet: the settings', else this home's own."""
    import hashlib

    h = hashlib.sha256(str(settings.home.resolve()).encode()).digest()
    bridge = settings.local_bridge or f"srb{h[:3].hex()}"
    subnet = settings.local_subnet or f"10.{64 + h[3] % 64}.{h[4]}.0/24"
    return bridge, subnet


def _local_launcher(
    settings: Settings, token: str, cleanup: contextlib.ExitStack, wheels: Any = None
) -> Launcher:
    """The local provisioner: nodes as hosts in namespaces where the kernel allows; the
    agent installed by each node's setup from this service's own wheel, as on a cloud;
    the checkpoint store's endpoint and keys passed to nodes as task secrets."""
    import os

    from orchestrator.launchers.local import STORAGE_ENV, LocalLauncher
    from orchestrator.package import agent_package_spec

    mode, why = local_network(settings)
    root = settings.home / "local-nodes"
    fabric = None
    url = settings.effective_service_url
    if mode == "netns":
        from orchestrator.launchers.netns import Fabric

        bridge, subnet = local_bridge(settings)
        fabric = Fabric(root / "fabric", bridge=bridge, subnet=subnet)
        fabric.up()
        # Nodes reach the service at its address on the bridge (a real, routable one).
        url = settings.public_url or f"{settings.scheme}://{fabric.gateway}:{settings.port}"
    package = agent_package_spec(settings.model_copy(update={"public_url": url}), wheels)
    local = LocalLauncher(
        root,
        url,
        enrolments(settings, token),
        provider=settings.local_provider,
        gpu_memory_gib=settings.local_gpu_memory_gib,
        replacement_gpu_memory_gib=settings.local_replacement_gpu_memory_gib,
        regions=tuple(settings.local_regions.split(",")),
        hosts_per_region=settings.local_hosts_per_region,
        network=mode,
        provision_delay_s=settings.local_provision_delay_s,
        package=package,
        pip_args=settings.pip_args or "--no-index --no-deps",
        storage_env={k: os.environ[k] for k in STORAGE_ENV if os.environ.get(k)},
        image_env={
            k: os.environ[k]
            for k in (n.strip() for n in settings.local_node_env.split(","))
            if k and k in os.environ and not k.endswith("TOKEN")
        },
        fabric=fabric,
        network_note=why,
        keep_survivors=settings.local_keep_survivors,
        release_single_nodes=settings.local_release_single_nodes,
    )
    if fabric is not None:
        cleanup.callback(_teardown_when_idle, fabric, local)
    cleanup.callback(local.close)
    if local.held_hosts():
        # Nodes that outlived the previous service on this home: their metadata
        # endpoint forwards to the simulator's port, so it answers again at once.
        local.metadata  # noqa: B018 - starts the simulator
    return local


def _teardown_when_idle(fabric: Any, local: Any) -> None:
    """Remove the nodes' bridge when the service stops, unless a node still holds a
    host: nodes outlive the service, as a cloud's VMs outlive its control plane, and
    the next service on this home finds them where they were (release_everything
    gives every host back, for a harness that ends it all)."""
    if local.held_hosts():
        return
    fabric.teardown()


def attach_reconciler(
    app: FastAPI, cleanup: contextlib.ExitStack, config: ReconcileConfig | None = None
) -> Reconciler:
    """Give ``app`` a launcher (for chaos and status) and a reconciler, not yet started;
    the launcher's release goes on ``cleanup``."""
    from orchestrator.domain.reconcile import ReconcileConfig
    from orchestrator.package import WheelCache
    from orchestrator.reconciler.loop import Reconciler

    settings: Settings = app.state.settings
    # One wheel per service: the one whose sha256 the nodes are handed is the one the
    # package route serves, even if the checkout is edited while the service runs.
    wheels = getattr(app.state, "agent_wheels", None) or WheelCache(settings.home)
    app.state.agent_wheels = wheels
    launcher = make_launcher(settings, app.state.token, cleanup, wheels)
    app.state.launcher = launcher
    rec = Reconciler(
        sessionmaker=app.state.sessionmaker,
        launcher=launcher,
        service_url=node_service_url(settings, launcher),
        service_ca_pem=settings.ca_pem(),
        config=config or ReconcileConfig(register_timeout_s=settings.register_timeout_s),
        interval_s=settings.reconcile_interval_s,
    )
    app.state.reconciler = rec
    return rec


def migrate(url: str, action: Literal["upgrade", "downgrade"], revision: str) -> str | None:
    """Move the schema of ``url`` to ``revision``; the revision it is at afterwards
    (None: base, an empty schema)."""
    from orchestrator.store import db

    move = db.upgrade if action == "upgrade" else db.downgrade
    try:
        move(url, revision)
        return db.current_revision(url)
    except Exception as e:  # Alembic's, the driver's: the message is the diagnosis
        raise DatabaseError.of(e) from e


def current_revision(url: str) -> str | None:
    """The schema revision of ``url`` (None: base, an empty schema)."""
    from orchestrator.store import db

    try:
        return db.current_revision(url)
    except Exception as e:
        raise DatabaseError.of(e) from e
