"""Wiring the service for ``skyresume serve`` and the schema for ``skyresume db``.

``skyresume serve`` is, in order: pick the port (:func:`bind_settings`); check TLS
files, hold the SQLite file (one ``serve`` per file), migrate the embedded database,
check that the database answers at this code's schema revision, and build the app
(:func:`build_service`), with a launcher and a reconciler not yet started
(:func:`attach_reconciler`); bind (:func:`bind_service`: a port in use is one line
and nothing has started); then run uvicorn with the limits of
``api/connections.py``, the reconciler started, and release both when it returns
(:func:`run_service`). The ``db`` commands move the
schema with Alembic through :mod:`orchestrator.store.db` (:func:`migrate`,
:func:`current_revision`).

Nothing here prints or exits: a failure the operator can fix (a database that cannot
be opened or migrated, a port in use, a bad TLS file) raises its own error class, and
the CLI turns it into its
one ``error:`` line. Every heavy import (FastAPI, SQLAlchemy, uvicorn, launchers)
happens inside the function that needs it, so importing this module is as cheap as
``skyresume --help`` must be.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from fastapi import FastAPI

    from orchestrator.domain.reconcile import ReconcileConfig
    from orchestrator.launchers.base import Launcher
    from orchestrator.launchers.local import LocalLauncherConfig
    from orchestrator.reconciler.loop import Reconciler
    from orchestrator.settings import Settings


class TLSError(ValueError):
    """The TLS settings cannot serve: a certificate or key that does not load, a CA
    bundle that holds no certificate (the message names the file and why)."""


def _no_password() -> bytes:
    # OpenSSL asks this instead of prompting on the tty (it did, twice: once here and
    # once inside uvicorn); an empty password fails the load, which names the fix.
    return b""


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
    for name, path in (("tls_cert", settings.tls_cert), ("tls_key", settings.tls_key)):
        try:  # each file named on its own: load_cert_chain's error names neither
            with open(path, "rb"):
                pass
        except OSError as e:
            why = "no such file" if isinstance(e, FileNotFoundError) else e.strerror
            raise TLSError(f"{name} (SKYRESUME_{name.upper()}) {path}: {why}") from None
    if b"ENCRYPTED" in settings.tls_key.read_bytes()[:4096]:
        raise TLSError(
            f"tls_key {settings.tls_key} is encrypted: serve reads an unencrypted key "
            "(openssl pkey -in KEY -out PLAIN), kept readable by the service alone"
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key, password=_no_password)
    except (ssl.SSLError, OSError) as e:
        raise TLSError(
            f"tls_cert {settings.tls_cert} with tls_key {settings.tls_key} do not load: "
            f"{getattr(e, 'reason', None) or e}"
        ) from None


class TokenFileError(RuntimeError):
    """The local operator token file cannot be read or written (the message names it)."""


class BindError(RuntimeError):
    """The service cannot listen where it was told (the message is the one line)."""


class AlreadyServing(RuntimeError):
    """Another ``serve`` holds this SQLite database (the message names its pid)."""


def hold_sqlite(settings: Settings, cleanup: contextlib.ExitStack) -> None:
    """One ``serve`` per SQLite file: an exclusive ``flock`` on ``<db>.serve.lock``,
    held until the service ends, with the holder's pid written in it.

    Two services on one file would each run a reconciler with its own in-memory
    heartbeats and launch each other's nodes; SQLite's own locks keep the file
    whole, not the protocol. The kernel drops the lock when the process dies, so a
    killed service never leaves a stale one."""
    import fcntl
    import os

    url = settings.effective_database_url
    if not url.startswith("sqlite"):
        return
    path = url.split("///", 1)[-1]
    if not path or path == ":memory:":
        return
    lock = Path(path + ".serve.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AlreadyServing(
            f"another skyresume serve (pid {held}) is serving the database {path}; "
            "stop it, or give this one its own SKYRESUME_HOME or SKYRESUME_DATABASE_URL"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    cleanup.callback(os.close, fd)


def check_schema(url: str, *, older_ok: bool = False) -> None:
    """:class:`DatabaseError` unless ``url`` answers and is at this code's revision:
    an empty schema, an older one or a newer one each name what to run (``older_ok``:
    before an automatic upgrade, only a newer one is refused)."""
    from orchestrator.store import db

    try:
        current = db.current_revision(url)
        head = db.head_revision()
        known = db.known_revisions()
    except Exception as e:  # unreachable, wrong user or password, no such database
        raise DatabaseError.of(e) from e
    if current == head or (older_ok and (current is None or current in known)):
        return
    if current is None:
        raise DatabaseError(f"the schema is empty (this code needs revision {head}): "
                            "run `skyresume db upgrade`")  # fmt: skip
    if current not in known:
        raise DatabaseError(
            f"the schema is at revision {current}, newer than this code knows (its newest "
            f"is {head}): run the skyresume that upgraded it, or downgrade with that one"
        )
    raise DatabaseError(
        f"the schema is at revision {current}, older than this code's {head}: "
        "run `skyresume db upgrade`"
    )


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
    sockets: list[socket.socket] = field(default_factory=list)
    """Bound by :func:`bind_service` before anything starts."""


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
    from orchestrator.api.auth import ensure_local_token
    from orchestrator.app import create_app
    from orchestrator.store import db

    check_tls(settings)
    cleanup = contextlib.ExitStack()
    try:
        hold_sqlite(settings, cleanup)
        try:
            ensure_local_token(settings)
        except OSError as e:
            raise TokenFileError(
                f"cannot keep the operator token in {settings.token_path}: "
                f"{e.strerror or e} (SKYRESUME_HOME, or set SKYRESUME_TOKEN)"
            ) from None
        try:
            if settings.should_auto_migrate:
                # A newer schema is never "upgraded" (Alembic's answer would be that it
                # cannot find the revision): it is refused, naming both revisions.
                check_schema(settings.effective_database_url, older_ok=True)
                db.upgrade(settings.effective_database_url)
        except DatabaseError:
            raise
        except Exception as e:  # any driver's error: the operator fixes the URL or server
            raise DatabaseError.of(e) from e
        # Before anything binds or starts: a database that is unreachable, empty, older
        # or newer is one line now, not a 500 with a traceback on every call later.
        check_schema(settings.effective_database_url)
        try:
            app = create_app(settings)
        except Exception as e:
            raise DatabaseError.of(e) from e
        service = Service(settings=settings, app=app, reconciler=None, cleanup=cleanup)
        if settings.reconcile:
            service.reconciler = attach_reconciler(app, service.cleanup)
        else:
            # Built once, now, in the background: the package routes serve its outcome.
            wheels = _wheel_cache(app)
            if not settings.agent_package.strip():
                wheels.start()
    except BaseException:
        cleanup.close()
        raise
    return service


def _wheel_cache(app: FastAPI) -> Any:
    from orchestrator.package import WheelCache

    wheels = getattr(app.state, "agent_wheels", None) or WheelCache(app.state.settings.home)
    app.state.agent_wheels = wheels
    return wheels


def bind_service(service: Service) -> None:
    """Listen where the settings say (and on the nodes' bridge); :class:`BindError`
    with one line when the port is taken or the address is not this machine's.
    Nothing has started yet: no reconciler runs for a service that cannot serve."""
    settings = service.settings
    try:
        service.sockets.append(_bind(settings.host, settings.port))
        gateway = _node_address(service)
        if gateway is not None and settings.host not in ("0.0.0.0", "::", gateway):
            service.sockets.append(_bind(gateway, settings.port))  # where the nodes reach us
    except OSError as e:
        for sock in service.sockets:
            sock.close()
        service.sockets.clear()
        where = f"{settings.host}:{settings.port}"
        if e.errno == errno.EADDRINUSE:
            why = "the port is in use (another skyresume serve?); set SKYRESUME_PORT or --port"
        else:
            why = f"{e.strerror or e} (SKYRESUME_HOST, SKYRESUME_PORT)"
        raise BindError(f"cannot listen on {where}: {why}") from None


def run_service(service: Service) -> None:
    """Serve until uvicorn returns (Ctrl-C, SIGTERM), the reconciler running meanwhile;
    then stop the reconciler and release the launcher, in that order."""
    import uvicorn

    from orchestrator.api.connections import uvicorn_config

    with service.cleanup:
        if not service.sockets:
            bind_service(service)  # bound first: a port in use starts nothing
        for sock in service.sockets:
            service.cleanup.callback(sock.close)
        # Heartbeats flush in batches from here on; the last flush runs on the way out,
        # after the reconciler stopped (callbacks run last-registered first).
        service.app.state.liveness.start()
        service.cleanup.callback(service.app.state.liveness.stop)
        # Beats are refused (503 + Retry-After) while the loop lags or connections wait
        # in these sockets' accept queues (api/backpressure.py).
        service.app.state.pressure.arm(sockets=service.sockets)
        service.cleanup.callback(service.app.state.pressure.disarm)
        # Alerts and the run's time series (orchestrator/alerts/loop.py).
        service.app.state.operator.start()
        service.cleanup.callback(service.app.state.operator.stop)
        if service.reconciler is not None:
            service.reconciler.start()
            # Registered last, so it runs first: no reconcile pass may use a launcher
            # that has already been released.
            service.cleanup.callback(service.reconciler.stop)
        config = uvicorn_config(service.app, service.settings)
        # What uvicorn.run does, with our sockets: Ctrl-C is a clean stop.
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.Server(config).run(sockets=service.sockets)


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
    return launcher.config.network_note if isinstance(launcher, LocalLauncher) else ""


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


def local_launcher_config(
    settings: Settings,
    *,
    network: str,
    network_note: str,
    package: str,
    environ: Mapping[str, str],
) -> LocalLauncherConfig:
    """The local launcher's config from the service's settings: the one place the
    ``SKYRESUME_LOCAL_*`` settings (and the environment variables they name: the
    checkpoint store's, ``local_node_env``'s) become launcher values. ``network`` is
    resolved already (``local_network``: never ``auto``)."""
    from orchestrator.launchers.local import STORAGE_ENV, LocalLauncherConfig

    return LocalLauncherConfig(
        provider=settings.local_provider,
        network=network,
        network_note=network_note,
        regions=tuple(settings.local_regions.split(",")),
        hosts_per_region=settings.local_hosts_per_region,
        provision_delay_s=settings.local_provision_delay_s,
        gpu_memory_gib=settings.local_gpu_memory_gib,
        replacement_gpu_memory_gib=settings.local_replacement_gpu_memory_gib,
        package=package,
        pip_args=settings.pip_args or "--no-index --no-deps",
        storage_env={k: environ[k] for k in STORAGE_ENV if environ.get(k)},
        # Named ones only, never a token: nothing else of the service's environment
        # reaches a node.
        image_env={
            k: environ[k]
            for k in (n.strip() for n in settings.local_node_env.split(","))
            if k and k in environ and not k.endswith("TOKEN")
        },
        keep_survivors=settings.local_keep_survivors,
        release_single_nodes=settings.local_release_single_nodes,
    )


def _local_launcher(
    settings: Settings, token: str, cleanup: contextlib.ExitStack, wheels: Any = None
) -> Launcher:
    """The local provisioner: nodes as hosts in namespaces where the kernel allows; the
    agent installed by each node's setup from this service's own wheel, as on a cloud;
    the checkpoint store's endpoint and keys passed to nodes as task secrets."""
    import os

    from orchestrator.launchers.local import LocalLauncher
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
    config = local_launcher_config(
        settings, network=mode, network_note=why, package=package, environ=os.environ
    )
    local = LocalLauncher(root, url, enrolments(settings, token), config, fabric=fabric)
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
    from orchestrator.domain.elastic import ElasticConfig
    from orchestrator.domain.reconcile import ReconcileConfig
    from orchestrator.reconciler.loop import Reconciler

    settings: Settings = app.state.settings
    # One wheel per service: the one whose sha256 the nodes are handed is the one the
    # package route serves, even if the checkout is edited while the service runs.
    wheels = _wheel_cache(app)
    launcher = make_launcher(settings, app.state.token, cleanup, wheels)
    app.state.launcher = launcher
    rec = Reconciler(
        sessionmaker=app.state.sessionmaker,
        launcher=launcher,
        service_url=node_service_url(settings, launcher),
        service_ca_pem=settings.ca_pem(),
        config=config
        or ReconcileConfig(
            register_timeout_s=settings.register_timeout_s,
            elastic=ElasticConfig(
                spare_retry_s=settings.spare_retry_s,
                spare_retry_cap_s=max(settings.spare_retry_s, ElasticConfig.spare_retry_cap_s),
            ),
        ),
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
