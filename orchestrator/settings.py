"""Service settings, one class, read once per process by the app factory or the CLI.

Precedence, highest first:
1. keyword arguments to ``Settings(...)`` (tests, ``skyresume serve --db-url``);
2. environment variables with the ``SKYRESUME_`` prefix (``SKYRESUME_DATABASE_URL``);
3. a ``.env`` file in the working directory;
4. the defaults below (an embedded SQLite file under ``~/.skyresume/``).

Nothing here is evaluated at import time: building the engine or the app reads a
``Settings`` instance passed to it, so tests never inherit a stale global.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import urllib.parse
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path(os.environ.get("SKYRESUME_HOME", Path.home() / ".skyresume"))


class NotRoutable(ValueError):
    """Nodes would be given a service URL they cannot reach; the message says what to set."""


def _unroutable_reason(url: str) -> str | None:
    """Why nodes on other hosts could not reach ``url`` (None: they could)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").strip()
    except ValueError as e:
        return f"not a URL: {e}"
    if parts.scheme not in ("http", "https"):
        return "not an http:// or https:// URL"
    if not host:
        return "no host"
    if host == "localhost" or host.endswith(".localhost"):
        return "localhost is each node itself"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None  # a DNS name: whether nodes resolve it is the operator's to know
    if ip.is_loopback:
        return "a loopback address is each node itself"
    if ip.is_unspecified:
        return f"{host} is a bind address (every interface), not one a node can connect to"
    return None


#: DNS names that resolve only inside a private network: single labels (the local search
#: domain), RFC 6762's .local, RFC 8375's .home.arpa, the clouds' own internal zones
#: (``ip-10-0-0-5.ec2.internal``, ``vm.c.project.internal``) and the usual site ones.
_PRIVATE_NAME_SUFFIXES = (".internal", ".local", ".lan", ".home.arpa", ".localdomain",
                          ".intranet", ".corp", ".private")  # fmt: skip
#: Carrier-grade NAT space (RFC 6598): not routed on the internet, though Python's
#: ``is_private`` leaves it out (overlay networks such as Tailscale live there).
_SHARED_SPACE = ipaddress.ip_network("100.64.0.0/10")


def _plain_http_reason(url: str) -> str | None:
    """Why nodes must reach ``url`` over https (None: they need not). Every heartbeat
    carries the agent's bearer token and every wheel download the agent's code: over
    plain http, only a private network may carry them."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").strip()
    except ValueError:
        return None  # _unroutable_reason names it
    if parts.scheme != "http" or not host:
        return None
    fix = (
        "the agents' bearer tokens would cross it in clear: use https:// (SKYRESUME_TLS_CERT "
        "and SKYRESUME_TLS_KEY, or a TLS proxy), or an address on a private network "
        "(10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7)"
    )
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if "." not in host or host.lower().endswith(_PRIVATE_NAME_SUFFIXES):
            return None
        return f"plain http to {host}, a name that may be public: {fix}"
    if ip.is_private or (ip.version == 4 and ip in _SHARED_SPACE):
        return None
    return f"plain http to {host}, a public address: {fix}"


class InsecureURL(NotRoutable):
    """A service URL nodes could reach, but only over the internet in clear."""


def require_routable(url: str, *, launcher: str) -> str:
    """``url`` if nodes on other hosts can reach it, else :class:`NotRoutable`.

    A node given ``http://127.0.0.1:8470`` talks to itself: its agent never registers,
    and the service reads that as a node that never came up, again and again, on
    every launch, with nothing on the service's side saying why."""
    why = _unroutable_reason(url)
    if why is not None:
        raise NotRoutable(
            f"the {launcher} launcher would give its nodes the service URL {url or '(empty)'!r}, "
            f"which they cannot reach ({why}): set SKYRESUME_PUBLIC_URL to the URL nodes "
            "reach this service at, e.g. http://<this host's private IP>:8470 or "
            "https://skyresume.example.com"
        )
    insecure = _plain_http_reason(url)
    if insecure is not None:
        raise InsecureURL(
            f"the {launcher} launcher would give its nodes the service URL {url!r}: {insecure}"
            " (SKYRESUME_PUBLIC_URL)"
        )
    return url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKYRESUME_", env_file=".env", extra="ignore")

    home: Path = Field(default_factory=default_home)
    """State directory: the embedded database, the local token, local launcher dirs."""
    database_url: str = ""
    """SQLAlchemy URL. Empty means ``sqlite:///<home>/skyresume.db``."""
    host: str = "127.0.0.1"
    port: int = 8470
    service_url: str = ""
    """Where clients reach the service; empty means ``http://<host>:<port>``."""
    public_url: str = Field(default="", validate_default=True)
    """The routable URL nodes reach the service at (``http://10.0.0.5:8470``); preferred
    over ``service_url`` wherever a URL is handed out. Required with the SkyPilot
    launcher: its nodes are other hosts, for which ``127.0.0.1`` is themselves."""
    agent_package: str = ""
    """What nodes ``pip install`` as the agent: a pip spec or a wheel URL the operator
    chose. Empty: this service's own wheel, ``<public URL>/v1/agent/dist/<wheel>``
    pinned by its sha256 (orchestrator/package.py builds it from this source tree)."""
    skypilot_image_id: str = ""
    """The node image for SkyPilot tasks whose resources name none (``ami-...``, a GCP
    image path, or ``docker:<image>``): it needs Python 3.9+ and torch. Empty: a task
    must name its own image or install torch in its setup, else it is refused
    (SkyPilot's default images have no torch)."""
    skypilot_grouping: str = "attempt"
    """How the SkyPilot launcher groups a job's nodes: ``attempt`` (one cluster per
    attempt, refilled after a loss) or ``node`` (one single-node cluster per node: a
    lost node's cluster alone is downed and replaced, the survivors' VMs stay).
    Measured side by side in docs/skypilot-grouping.md."""
    pip_args: str = ""
    """Extra arguments for that ``pip install`` on the node, split on whitespace
    (``--no-index`` for nodes without internet: the service's wheel needs none)."""
    tls_cert: Path | None = None
    """PEM certificate (chain) ``serve`` answers HTTPS with; with ``tls_key``. Unset:
    plain HTTP (behind a TLS-terminating proxy, say; README: TLS)."""
    tls_key: Path | None = None
    """The private key of ``tls_cert``."""
    ca_bundle: Path | None = None
    """PEM certificates the CLI and every node's agent verify the service's certificate
    against (a private CA, or a self-signed certificate itself). The service hands its
    text to nodes in the task's envs (``SKYRESUME_RUN_CA_PEM``): certificates are
    public. Unset: the system's trust store."""
    token: str = ""
    """Operator bearer token. Empty in local mode: ``serve`` creates one in
    ``<home>/token`` (mode 0600) and the CLI reads it from there."""
    dashboard_session_hours: float = Field(default=12.0, gt=0, le=24 * 90)
    """How long a dashboard login lasts. Sessions are rows (the hash of the cookie's
    session id): logout, revoking the token they were opened with, or ``skyresume
    token revoke-sessions`` end them sooner."""
    alert_webhook_url: str = ""
    """A webhook every job's alerts go to (incident opened/closed, job failed or
    succeeded; Slack-compatible body). Per-job webhooks: ``POST /v1/alerts/webhooks``."""
    alert_webhook_secret: str = ""
    """The HMAC-SHA256 key that signs each body sent to ``alert_webhook_url``."""
    alerts_interval_s: float = Field(default=2.0, gt=0, le=3600)
    """How often the operator loop samples progress, detects events and sends alerts."""
    auto_migrate: bool | None = None
    """Upgrade the schema on ``serve``. Default: on for SQLite, off otherwise
    (production PostgreSQL is upgraded deliberately with ``skyresume db upgrade``)."""

    trusted_proxies: str = ""
    """Comma-separated addresses of reverse proxies whose ``X-Forwarded-For`` and
    ``X-Forwarded-Proto`` headers are believed (uvicorn's ``forwarded_allow_ips``).
    Empty: no header is believed, a caller's address is the TCP peer's. A node's
    stored address becomes ``MASTER_ADDR`` of a relaunch, so a header must never set
    it unless a proxy the operator named wrote it."""
    header_timeout_s: float = Field(default=10.0, gt=0, le=600)
    """How long a client has to send a request's headers, counted from its connection
    (or from the first byte of its next request): an idle or half-open connection is
    closed after this, and a slowloris header holds a connection no longer."""
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """How long a client has to send a request's body once its headers are in."""
    keep_alive_s: int = Field(default=5, ge=1, le=600)
    """How long a connection may sit idle between requests (uvicorn's keep-alive)."""
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1024 * 1024)
    """The most a request's line and headers may take (h11's incomplete-event limit):
    a longer one is refused (400) before more of it is buffered."""
    max_headers: int = Field(default=100, ge=8, le=10_000)
    """The most header fields a request may carry (more: 431)."""
    max_connections: int = Field(default=4096, ge=16, le=1_000_000)
    """Open connections past which a new one is closed at once, so the process keeps
    file descriptors for its database and its nodes."""
    docs: bool = False
    """Serve ``/docs`` and ``/redoc`` (Swagger UI and ReDoc load their scripts from a
    CDN, so they are off unless asked for; ``/openapi.json`` is always served)."""
    skypilot_yaml_dir: Path | None = None
    """The directory a job spec's ``task.skypilot_yaml`` must lie in (after symlinks
    are resolved). Unset: ``<home>/tasks``. A spec naming a file elsewhere is refused
    (422): without this a submitter could have the service read any file it can."""

    reconcile: bool = True
    """Run the reconciler (the restart protocol) inside ``serve``. One replica holds
    the lease at a time, so every replica may leave it on."""
    reconcile_interval_s: float = Field(default=0.5, gt=0)
    register_timeout_s: float = Field(default=180.0, gt=0, le=86400)
    """How long a node that is up (its launch request done) may take to register
    before it is lost; provisioning has its own timeout in the job spec."""
    spare_retry_s: float = Field(default=60.0, gt=0, le=86400)
    """How long an elastic job training on fewer nodes than its spec's, with no
    replacement coming (refused, or given back), waits before it asks again; the wait
    doubles with each try, up to 15 minutes (``domain.elastic``)."""
    enrolment_ttl_s: float = Field(default=3600.0, gt=0, le=7 * 86400)
    """How long the enrolment token a launch's task carries stays good: provisioning
    plus setup. Each node spends it at its first register, for the attempt's agent
    token; after this, or for a node already enrolled, it opens nothing (docs/
    control-plane.md: Tokens and roles)."""
    launcher: str = "local"
    """``local`` (nodes as process sessions on this machine) or ``skypilot``."""
    local_provider: str = "aws"
    """Which cloud's metadata format the local nodes' agents poll (aws, gcp, azure)."""
    local_gpu_memory_gib: float | None = Field(default=None, gt=0)
    """GPU memory the local nodes declare (none: CPU only, no memory planning)."""
    local_replacement_gpu_memory_gib: float | None = Field(default=None, gt=0)
    """GPU memory replacement nodes declare: less than the first launch's makes the
    memory planner replan activation checkpointing / micro-batch on this machine."""
    local_regions: str = "local"
    """Comma-separated regions of the local launcher; ``skyresume chaos stockout R``
    makes one refuse launches, as a cloud region out of capacity does."""
    local_hosts_per_region: int = Field(default=8, ge=1, le=1024)
    """Hosts each local region has; a host blamed for a hardware fault is never reused."""
    local_network: str = "auto"
    """How local nodes are hosts of their own: ``netns`` (a network namespace each on a
    bridge, its own IP and metadata address; needs root), ``loopback`` (processes
    sharing this machine's loopback: no partitions, no kept survivors) or ``auto``
    (netns where the kernel allows, else loopback, said out loud)."""
    local_bridge: str = ""
    """The bridge local nodes' namespaces hang on (netns). Empty: one of this service
    home's own (``srb`` + a digest of the home), so two services never share one."""
    local_subnet: str = ""
    """Their addresses; the first is this machine's on the bridge (the gateway). Empty:
    a /24 of 10.64.0.0/10 picked by the same digest."""
    local_node_env: str = ""
    """Comma-separated names of this service's environment variables that local nodes
    get, as if baked into their image (e.g. ``PATH`` with a tool on it). Nothing else
    of the service's environment reaches a node: its tokens stay here."""
    local_release_single_nodes: bool = True
    """Whether a lost node of a local launch can be given back alone; false behaves
    like SkyPilot (a cluster goes whole: a kept node's lost peer stays provisioned)."""
    local_keep_survivors: bool = True
    """After a node loss keep the healthy nodes and launch only the replacement (netns
    only); false relaunches every node, as before (kept to compare the two)."""
    local_provision_delay_s: float = Field(default=0.0, ge=0, le=3600)
    """How long a local launch takes to provision before its setup runs (a cloud VM
    takes minutes); the reconciler polls it, never waits on it."""

    @field_validator("local_regions")
    @classmethod
    def _regions(cls, v: str) -> str:
        names = [r.strip() for r in v.split(",")]
        if not names or any(not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", r) for r in names):
            raise ValueError(
                f"local_regions must be comma-separated names of lower-case letters, "
                f"digits and '-', got {v!r}"
            )
        return ",".join(names)

    @field_validator("skypilot_grouping")
    @classmethod
    def _grouping(cls, v: str) -> str:
        if v not in ("attempt", "node"):
            raise ValueError(f"skypilot_grouping must be attempt or node, got {v!r}")
        return v

    @field_validator("launcher")
    @classmethod
    def _launcher(cls, v: str, info: ValidationInfo) -> str:
        if v not in ("local", "skypilot"):
            raise ValueError(f"launcher must be local or skypilot, got {v!r}")
        d = info.data
        if v == "skypilot" and {"host", "port", "service_url", "public_url"} <= d.keys():
            # Here, not only when the launcher is built: a setting error is the one
            # line every command prints (``bad setting ...``), not a traceback.
            url = d["public_url"] or d["service_url"] or f"http://{d['host']}:{d['port']}"
            require_routable(url.rstrip("/"), launcher=v)
        return v

    @field_validator("local_network")
    @classmethod
    def _network(cls, v: str) -> str:
        if v not in ("auto", "netns", "loopback"):
            raise ValueError(f"local_network must be auto, netns or loopback, got {v!r}")
        return v

    @field_validator("local_provider")
    @classmethod
    def _provider(cls, v: str) -> str:
        from orchestrator.cloud.metadata import PROVIDERS

        if v not in PROVIDERS:
            raise ValueError(f"local_provider must be one of {', '.join(PROVIDERS)}, got {v!r}")
        return v

    @field_validator("port")
    @classmethod
    def _port_range(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError(f"port must be 0-65535, got {v}")
        return v

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if v:
            why = _unroutable_reason(v)
            if why is not None:
                raise ValueError(
                    f"{v!r} is not a URL nodes can reach ({why}); give the address nodes "
                    "connect to, e.g. http://<this host's private IP>:8470"
                )
            insecure = _plain_http_reason(v)
            if insecure is not None:
                raise ValueError(f"{v!r}: {insecure}")
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            )
            raise ValueError(
                f"{given} is set but {missing} is not: HTTPS needs both "
                f"(SKYRESUME_{given.upper()} and SKYRESUME_{missing.upper()})"
            )
        return self

    @field_validator("pip_args")
    @classmethod
    def _pip_args(cls, v: str) -> str:
        # One line: the template splits it on whitespace, and a newline in a task env
        # would end the pip command early on the node.
        if "\n" in v or "\r" in v:
            raise ValueError("pip_args must be one line")
        return v.strip()

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'skyresume.db'}"

    @property
    def effective_service_url(self) -> str:
        """The URL handed to nodes and used by the CLI: the public URL when set."""
        url = self.public_url or self.service_url or f"{self.scheme}://{self.host}:{self.port}"
        return url.rstrip("/")

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert is not None else "http"

    def ca_pem(self) -> str | None:
        """The text of ``ca_bundle`` (None when unset); ValueError naming the file when
        it cannot be read or holds no certificate."""
        if self.ca_bundle is None:
            return None
        try:
            pem = self.ca_bundle.expanduser().read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(f"ca_bundle {self.ca_bundle}: {why}") from None
        if "-----BEGIN CERTIFICATE-----" not in pem:
            raise ValueError(f"ca_bundle {self.ca_bundle} holds no PEM certificate")
        return pem

    def client_verify(self) -> ssl.SSLContext | bool:
        """What a client of the service verifies its certificate with: ``ca_bundle``
        when set, else the system's trust store (``True``)."""
        pem = self.ca_pem()
        return ssl.create_default_context(cadata=pem) if pem is not None else True

    @property
    def effective_skypilot_yaml_dir(self) -> Path:
        return (self.skypilot_yaml_dir or self.home / "tasks").expanduser()

    @property
    def token_path(self) -> Path:
        return self.home / "token"

    @property
    def should_auto_migrate(self) -> bool:
        if self.auto_migrate is not None:
            return self.auto_migrate
        return self.effective_database_url.startswith("sqlite")
