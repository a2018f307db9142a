"""Preemption notices from the cloud metadata endpoints of AWS, GCP and Azure.

The node agent imports this module and polls from boot, so it uses only the stdlib
(urllib) and never raises out of :meth:`poll`. Each poller takes a *base endpoint
URL* and appends the provider's real paths, so the same code runs against the real
link-local service and against :mod:`orchestrator.cloud.simulator`.

Every poll answers with a :class:`PollResult` in one of three states:

* ``notice`` — the provider announced an interruption; ``notice`` is normalized
  (provider, kind, deadline, raw payload);
* ``none`` — the endpoint answered in its documented format and nothing is scheduled;
* ``unknown`` — the endpoint could not be read (timeout, refused, 5xx, a body that is
  not the documented format). A blind poller must never look like a quiet one: an
  agent that read "unknown" as "none" would sleep through a preemption.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from typing import Any, Literal, Union

# The provider list is the contract's (the one list); re-exported, since the pollers'
# callers name providers beside them.
from orchestrator.contract import PROVIDERS as PROVIDERS
from orchestrator.contract import Provider as Provider
from orchestrator.contract import StrEnum

AWS_ENDPOINT = "http://169.254.169.254"
GCP_ENDPOINT = "http://metadata.google.internal"
AZURE_ENDPOINT = "http://169.254.169.254"

AWS_TOKEN_PATH = "/latest/api/token"
AWS_TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_SPOT_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
AZURE_EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"

#: GCP announces a spot preemption about 30 s ahead but the endpoint carries no time;
#: the deadline is this long after the poll that saw it (an estimate, kept short).
GCP_PREEMPT_GRACE = timedelta(seconds=30)
#: Azure event types that end or pause the VM (``Freeze`` pauses it for seconds).
AZURE_EVENT_TYPES = frozenset({"Preempt", "Terminate", "Reboot", "Redeploy", "Freeze"})


class NoticeKind(StrEnum):
    """What is coming. Whether it ends the VM is :attr:`Notice.ends_vm` (the one answer:
    the agent acts on those and only logs the rest)."""

    terminate = "terminate"  # AWS spot terminate, Azure Terminate
    stop = "stop"  # AWS spot stop
    hibernate = "hibernate"  # AWS spot hibernate
    rebalance = "rebalance"  # AWS rebalance recommendation: early warning only
    preempt = "preempt"  # GCP preempted=TRUE, Azure Preempt
    maintenance = "maintenance"  # GCP host maintenance event
    reboot = "reboot"  # Azure Reboot
    redeploy = "redeploy"  # Azure Redeploy
    freeze = "freeze"  # Azure Freeze


@dataclass(frozen=True)
class Notice:
    provider: Provider
    kind: NoticeKind
    deadline: datetime | None
    """When the VM may go (UTC); None when the provider gives no time."""
    raw: Any
    """The payload as the endpoint returned it (parsed JSON or text)."""

    @property
    def ends_vm(self) -> bool:
        """True when the VM goes (or stops) soon: the ranks save and stop. False for a
        warning that leaves it running: AWS's rebalance recommendation (an early
        warning, no interruption scheduled), GCP's ``MIGRATE_ON_HOST_MAINTENANCE`` (a
        live migration; spot and GPU VMs get ``TERMINATE_ON_HOST_MAINTENANCE``, which
        ends them), and Azure's ``Freeze`` (a pause of a few seconds, memory and open
        files kept: a restart would cost far more than the pause)."""
        if self.kind is NoticeKind.rebalance or self.kind is NoticeKind.freeze:
            return False
        if self.kind is NoticeKind.maintenance:
            return self.raw != "MIGRATE_ON_HOST_MAINTENANCE"
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": str(self.provider),
            "kind": str(self.kind),
            "deadline": self.deadline.isoformat() if self.deadline else None,
            "raw": self.raw,
        }


@dataclass(frozen=True)
class PollResult:
    state: Literal["notice", "none", "unknown"]
    notice: Notice | None = None
    error: str = ""

    @classmethod
    def none(cls) -> PollResult:
        return cls("none")

    @classmethod
    def unknown(cls, error: str) -> PollResult:
        return cls("unknown", None, error)

    @classmethod
    def of(cls, notice: Notice) -> PollResult:
        return cls("notice", notice)


class _Unreadable(Exception):
    """The endpoint could not be read; the message says why (becomes ``unknown``)."""


@dataclass
class _Response:
    status: int
    headers: dict[str, str]
    body: bytes


# Link-local metadata must never go through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(
    method: str, url: str, headers: dict[str, str], timeout: float, data: bytes | None = None
) -> _Response:
    """One request; any HTTP status comes back, transport failures raise _Unreadable."""
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return _Response(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        try:
            body = e.read()
        except Exception:
            body = b""
        return _Response(e.code, {k.lower(): v for k, v in (e.headers or {}).items()}, body)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise _Unreadable(f"{method} {url}: {reason or type(e).__name__}") from None
    except Exception as e:  # http.client.BadStatusLine, IncompleteRead, ...
        raise _Unreadable(f"{method} {url}: {type(e).__name__}: {e}") from None


def _bad_status(url: str, r: _Response) -> _Unreadable:
    return _Unreadable(f"GET {url}: HTTP {r.status}")


def _parse_iso(value: Any, what: str) -> datetime:
    if not isinstance(value, str):
        raise _Unreadable(f"{what}: expected an ISO 8601 time, got {value!r}")
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise _Unreadable(f"{what}: not an ISO 8601 time: {value!r}") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _Unreadable(f"{what}: body is not JSON: {body[:60]!r}") from None
    if not isinstance(doc, dict):
        raise _Unreadable(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


@dataclass
class AwsPoller:
    """IMDSv2: a session token (PUT, with a TTL) then the spot and rebalance paths.

    The token is refreshed ``refresh_margin`` seconds before it expires, and once
    more whenever IMDS answers 401 (a token can be revoked early, e.g. after the
    instance is stopped and started).
    """

    endpoint: str = AWS_ENDPOINT
    timeout: float = 2.0
    token_ttl: int = 21600
    refresh_margin: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _token: str | None = field(default=None, repr=False)
    _token_expiry: float = field(default=0.0, repr=False)

    provider = Provider.aws

    def _base(self) -> str:
        return self.endpoint.rstrip("/")

    def _fetch_token(self) -> str:
        url = self._base() + AWS_TOKEN_PATH
        now = self.clock()
        r = _http("PUT", url, {AWS_TOKEN_TTL_HEADER: str(self.token_ttl)}, self.timeout, b"")
        if r.status != 200:
            raise _Unreadable(f"PUT {url}: HTTP {r.status}")
        token = r.body.decode("ascii", "replace").strip()
        if not token or len(token) > 4096 or any(c.isspace() for c in token):
            raise _Unreadable(f"PUT {url}: body is not an IMDSv2 token")
        self._token, self._token_expiry = token, now + self.token_ttl
        return token

    def _token_now(self) -> str:
        if self._token is None or self.clock() >= self._token_expiry - self.refresh_margin:
            return self._fetch_token()
        return self._token

    def _get(self, path: str) -> _Response:
        url = self._base() + path
        r = _http("GET", url, {AWS_TOKEN_HEADER: self._token_now()}, self.timeout)
        if r.status == 401:
            self._token = None
            r = _http("GET", url, {AWS_TOKEN_HEADER: self._token_now()}, self.timeout)
        if r.status not in (200, 404):
            raise _bad_status(url, r)
        return r

    def _read(self) -> PollResult:
        r = self._get(AWS_SPOT_PATH)
        if r.status == 200:
            doc = _json_object(r.body, "spot/instance-action")
            action = doc.get("action")
            if action not in ("terminate", "stop", "hibernate"):
                raise _Unreadable(f"spot/instance-action: unknown action {action!r}")
            deadline = _parse_iso(doc.get("time"), "spot/instance-action time")
            return PollResult.of(Notice(Provider.aws, NoticeKind(action), deadline, doc))
        r = self._get(AWS_REBALANCE_PATH)
        if r.status == 200:
            doc = _json_object(r.body, "rebalance recommendation")
            _parse_iso(doc.get("noticeTime"), "rebalance noticeTime")
            # A recommendation carries no deadline: the spot notice, if it comes, does.
            return PollResult.of(Notice(Provider.aws, NoticeKind.rebalance, None, doc))
        return PollResult.none()

    def poll(self) -> PollResult:
        try:
            return self._read()
        except _Unreadable as e:
            return PollResult.unknown(str(e))
        except Exception as e:  # a poller must never take the agent down
            return PollResult.unknown(f"aws poll failed: {type(e).__name__}: {e}")


@dataclass
class GcpPoller:
    """``instance/preempted`` (TRUE/FALSE) and ``instance/maintenance-event``.

    :meth:`wait` long-polls with ``wait_for_change`` and the last ETag, so a change
    arrives as soon as the metadata server knows it instead of a poll interval later.
    A response without the ``Metadata-Flavor: Google`` header is not from the
    metadata server (a proxy page, a captive portal) and reads as unknown.
    """

    endpoint: str = GCP_ENDPOINT
    timeout: float = 2.0
    clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)
    last_etag: str | None = None

    provider = Provider.gcp

    def _get(self, path: str, timeout: float) -> tuple[str, _Response]:
        url = self.endpoint.rstrip("/") + path
        r = _http("GET", url, {"Metadata-Flavor": "Google"}, timeout)
        if r.status != 200:
            raise _bad_status(url, r)
        if r.headers.get("metadata-flavor") != "Google":
            raise _Unreadable(f"GET {url}: response lacks Metadata-Flavor: Google")
        try:
            text = r.body.decode("ascii").strip()
        except UnicodeDecodeError:
            raise _Unreadable(f"GET {url}: body is not text") from None
        return text, r

    def _read(self, wait_s: float | None) -> PollResult:
        path, timeout = GCP_PREEMPTED_PATH, self.timeout
        if wait_s is not None:
            path += f"?wait_for_change=true&timeout_sec={max(1, int(wait_s))}"
            if self.last_etag:
                path += f"&last_etag={self.last_etag}"
            timeout = wait_s + self.timeout
        text, r = self._get(path, timeout)
        if text not in ("TRUE", "FALSE"):
            raise _Unreadable(f"instance/preempted: expected TRUE or FALSE, got {text[:40]!r}")
        self.last_etag = r.headers.get("etag", self.last_etag)
        if text == "TRUE":
            deadline = self.clock() + GCP_PREEMPT_GRACE
            return PollResult.of(Notice(Provider.gcp, NoticeKind.preempt, deadline, text))
        event, _ = self._get(GCP_MAINTENANCE_PATH, self.timeout)
        if event == "NONE":
            return PollResult.none()
        if not event.replace("_", "").isalnum():
            raise _Unreadable(f"instance/maintenance-event: unexpected value {event[:40]!r}")
        return PollResult.of(Notice(Provider.gcp, NoticeKind.maintenance, None, event))

    def poll(self) -> PollResult:
        return self._guard(None)

    def wait(self, timeout_s: float = 30.0) -> PollResult:
        """Block until ``preempted`` changes (or ``timeout_s``), then read like poll()."""
        return self._guard(timeout_s)

    def _guard(self, wait_s: float | None) -> PollResult:
        try:
            return self._read(wait_s)
        except _Unreadable as e:
            return PollResult.unknown(str(e))
        except Exception as e:
            return PollResult.unknown(f"gcp poll failed: {type(e).__name__}: {e}")


@dataclass
class AzurePoller:
    """Scheduled Events. The first call enables the service and can take minutes, so
    it gets ``first_timeout``; later calls get ``timeout``. Of several events, the
    one with the earliest NotBefore is reported (it is the one that bites first)."""

    endpoint: str = AZURE_ENDPOINT
    timeout: float = 2.0
    first_timeout: float = 180.0
    document_incarnation: int | None = None
    _answered: bool = field(default=False, repr=False)

    provider = Provider.azure

    def _read(self) -> PollResult:
        url = self.endpoint.rstrip("/") + AZURE_EVENTS_PATH
        timeout = self.timeout if self._answered else self.first_timeout
        r = _http("GET", url, {"Metadata": "true"}, timeout)
        if r.status != 200:
            raise _bad_status(url, r)
        self._answered = True
        doc = _json_object(r.body, "scheduledevents")
        inc, events = doc.get("DocumentIncarnation"), doc.get("Events")
        if not isinstance(inc, int) or not isinstance(events, list):
            raise _Unreadable("scheduledevents: needs DocumentIncarnation and Events")
        self.document_incarnation = inc
        found: list[tuple[datetime | None, dict[str, Any]]] = []
        for ev in events:
            if not isinstance(ev, dict) or ev.get("EventType") not in AZURE_EVENT_TYPES:
                continue
            nb = ev.get("NotBefore") or ""
            try:
                deadline = parsedate_to_datetime(nb) if nb else None
            except (TypeError, ValueError):
                raise _Unreadable(f"scheduledevents: bad NotBefore {nb!r}") from None
            found.append((deadline, ev))
        if not found:
            return PollResult.none()
        far = datetime.max.replace(tzinfo=timezone.utc)
        deadline, ev = min(found, key=lambda f: f[0] or far)
        kind = NoticeKind(str(ev["EventType"]).lower())
        return PollResult.of(Notice(Provider.azure, kind, deadline, doc))

    def poll(self) -> PollResult:
        try:
            return self._read()
        except _Unreadable as e:
            return PollResult.unknown(str(e))
        except Exception as e:
            return PollResult.unknown(f"azure poll failed: {type(e).__name__}: {e}")


# Union, not |: a type alias is evaluated at import, and the agent imports this on the
# node's Python (3.9+), where classes have no | (3.10).
Poller = Union[AwsPoller, GcpPoller, AzurePoller]

#: Each provider's real metadata endpoint (the launchers point agents at these).
DEFAULT_ENDPOINTS = {
    Provider.aws: AWS_ENDPOINT,
    Provider.gcp: GCP_ENDPOINT,
    Provider.azure: AZURE_ENDPOINT,
}

#: The kinds each provider's format can announce (what its poller can return, and what
#: the simulator agrees to serve for it).
NOTICE_KINDS: dict[Provider, frozenset[NoticeKind]] = {
    Provider.aws: frozenset(
        {NoticeKind.terminate, NoticeKind.stop, NoticeKind.hibernate, NoticeKind.rebalance}
    ),
    Provider.gcp: frozenset({NoticeKind.preempt, NoticeKind.maintenance}),
    Provider.azure: frozenset(NoticeKind(t.lower()) for t in AZURE_EVENT_TYPES),
}

#: The notice a spot reclaim brings on each provider (chaos's ``preempt`` sends it).
RECLAIM_KIND: dict[Provider, NoticeKind] = {
    Provider.aws: NoticeKind.terminate,
    Provider.gcp: NoticeKind.preempt,
    Provider.azure: NoticeKind.preempt,
}


def poller_for(provider: Provider | str, endpoint: str | None = None, **kw: Any) -> Poller:
    """The poller for an explicit provider; ``endpoint`` defaults to the real one."""
    try:
        p = Provider(provider)
    except ValueError:
        raise ValueError(f"unknown provider {provider!r} (use {', '.join(PROVIDERS)})") from None
    url = endpoint or DEFAULT_ENDPOINTS[p]
    if p is Provider.aws:
        return AwsPoller(url, **kw)
    if p is Provider.gcp:
        return GcpPoller(url, **kw)
    return AzurePoller(url, **kw)


def _looks_like(provider: Provider, base: str, timeout: float) -> bool:
    try:
        if provider is Provider.gcp:
            r = _http("GET", base + GCP_PREEMPTED_PATH, {"Metadata-Flavor": "Google"}, timeout)
            return r.status == 200 and r.headers.get("metadata-flavor") == "Google"
        if provider is Provider.aws:
            r = _http("PUT", base + AWS_TOKEN_PATH, {AWS_TOKEN_TTL_HEADER: "60"}, timeout, b"")
            return r.status == 200 and bool(r.body.strip())
        r = _http("GET", base + AZURE_EVENTS_PATH, {"Metadata": "true"}, timeout)
        return r.status == 200 and "DocumentIncarnation" in _json_object(r.body, "azure")
    except (_Unreadable, Exception):
        return False


def detect_provider(endpoint: str | None = None, timeout: float = 0.5) -> Provider | None:
    """Which provider's metadata format answers, probing GCP, AWS, Azure in turn.

    GCP is probed first because its answer is unambiguous (the Metadata-Flavor
    response header); AWS before Azure because both share 169.254.169.254 and the
    Azure probe could take long on a cold Azure service. None when nothing answers.
    """
    for provider in (Provider.gcp, Provider.aws, Provider.azure):
        base = (endpoint or DEFAULT_ENDPOINTS[provider]).rstrip("/")
        if _looks_like(provider, base, timeout):
            return provider
    return None
