"""The agent's HTTP client for the service (stdlib ``urllib``, JSON in and out).

Three outcomes, kept apart because the agent acts differently on each:

* an answer (any HTTP status): :class:`Answer`, the caller reads ``status``;
* the attempt is no longer current: HTTP 409 raises :class:`Superseded` — the agent
  stops its ranks and exits, whatever it was doing; a 409 that refuses the agent
  itself (another version or protocol, header ``X-Skyresume-Refused``) raises its
  subclass :class:`AgentRefused`, so whoever catches only ``Superseded`` still stops;
* the service cannot be reached (refused, timeout, 5xx): :class:`Unreachable` — the
  agent keeps training and retries with :func:`backoff_delays`, because a service
  restart must never cost a training step;
* the service is up and asks for less (429, or 503 with ``Retry-After``): its
  subclass :class:`Busy`, with the wait it asked for — back-pressure, not a failure:
  the agent waits that long with jitter (:func:`busy_wait`) and counts nothing lost.

A 4xx other than 409 is an answer, not a failure to reach: the service refused that
body, and sending it again would be refused again (the report outbox drops it).
"""

from __future__ import annotations

import json
import math
import random
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class Unreachable(Exception):
    """No usable answer: connection refused or reset, timeout, or a 5xx."""


class Busy(Unreachable):
    """HTTP 429, or 503 with ``Retry-After``: the service is behind and asks for fewer
    requests. ``retry_after_s`` is how long it asked the client to wait."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


#: The longest wait a Busy answer is obeyed for (a bad header must not silence a node
#: past any heartbeat timeout).
MAX_BUSY_WAIT_S = 30.0


def busy_wait(retry_after_s: float, jitter: float = 0.5) -> float:
    """The wait after a Busy answer: what the service asked, stretched by up to
    ``jitter`` at random, so a fleet refused together does not come back together."""
    base = min(MAX_BUSY_WAIT_S, max(0.1, retry_after_s))
    return base * (1 + random.uniform(0.0, jitter))


def told_interval(body: Any, own_s: float, jitter: float = 0.1) -> float:
    """The wait before the next beat after an answered one: our own period, or the
    longer ``interval_s`` the service asked for (a big fleet), spread by +-``jitter``."""
    told = body.get("interval_s") if isinstance(body, dict) else None
    if not isinstance(told, (int, float)) or isinstance(told, bool) or not told > own_s:
        return own_s
    return min(MAX_BUSY_WAIT_S, float(told)) * (1 + random.uniform(-jitter, jitter))


def _retry_after(value: str | None, body: Any) -> float | None:
    """``Retry-After`` as seconds (delta-seconds only; an HTTP date is ignored), or the
    ``interval_s`` a JSON body names."""
    if value:
        try:
            return max(0.0, float(value.strip()))
        except ValueError:
            pass
    if isinstance(body, dict) and isinstance(body.get("interval_s"), (int, float)):
        return float(body["interval_s"])
    return None


class Superseded(Exception):
    """HTTP 409: the service moved on from this attempt."""


class AgentRefused(Superseded):
    """HTTP 409 from register: the service will not work with this agent's version or
    protocol (the message names both sides')."""


#: The header (and value) the service sets on a 409 that refuses the agent itself.
REFUSED_HEADER = "X-Skyresume-Refused"
AGENT_VERSION_REFUSED = "agent-version"


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any
    date: str | None = None
    """The answer's ``Date`` header (the node's clock is checked against it)."""


def backoff_delays(
    base: float = 0.2, cap: float = 5.0, factor: float = 2.0, jitter: float = 0.2
) -> Iterator[float]:
    """Exponential delays with +-``jitter`` spread, capped; endless.

    Jitter keeps 64 agents that lost the same service from retrying in lockstep
    when it comes back.
    """
    delay = base
    while True:
        yield min(cap, delay) * (1 + random.uniform(-jitter, jitter))
        delay = min(cap, delay * factor)


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


class ServiceClient:
    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        job_id: str,
        attempt: int,
        node_id: str,
        ca_pem: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._job_id, self._node_id = job_id, node_id
        self._target = (self._prefix(attempt), token)
        """(URL prefix, token): one value, so a request never pairs one attempt's URL
        with another's token while :meth:`move_to` runs on another thread."""
        # A proxy from the environment must not sit between an agent and a service
        # on loopback (the local launcher); a remote service may need one.
        handlers: list[urllib.request.BaseHandler] = (
            [urllib.request.ProxyHandler({})] if _is_loopback(base_url) else []
        )
        # An https service is verified (certificate and host name) against the
        # operator's CA bundle when one came with the task, else the node's trust store.
        handlers.append(
            urllib.request.HTTPSHandler(context=ssl.create_default_context(cadata=ca_pem))
        )
        self._opener = urllib.request.build_opener(*handlers)

    def _prefix(self, attempt: int) -> str:
        q = urllib.parse.quote
        return (
            f"{self.base_url}/v1/jobs/{q(self._job_id, safe='')}/attempts/{attempt}"
            f"/nodes/{q(self._node_id, safe='')}"
        )

    @property
    def prefix(self) -> str:
        return self._target[0]

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = 10.0) -> Answer:
        data = None if body is None else _encode(body)
        prefix, token = self._target
        req = urllib.request.Request(
            prefix + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        try:
            with self._opener.open(req, timeout=timeout) as r:
                return Answer(r.status, _parse(r.read()), r.headers.get("Date"))
        except urllib.error.HTTPError as e:
            try:
                raw = e.read()
            except Exception:
                raw = b""
            if e.code == 409:
                if (e.headers.get(REFUSED_HEADER) or "") == AGENT_VERSION_REFUSED:
                    raise AgentRefused(_detail(raw) or "the service refused this agent") from None
                raise Superseded(_detail(raw) or "attempt superseded") from None
            if e.code == 429 or e.code == 503:
                wait = _retry_after(e.headers.get("Retry-After"), _parse(raw))
                if wait is not None or e.code == 429:
                    raise Busy(
                        f"{method} {path}: HTTP {e.code} {_detail(raw)}",
                        wait if wait is not None else 1.0,
                    ) from None
            if e.code >= 500:
                raise Unreachable(f"{method} {path}: HTTP {e.code} {_detail(raw)}") from None
            return Answer(e.code, _parse(raw))
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise Unreachable(f"{method} {path}: {reason}") from None
        except Exception as e:  # http.client.RemoteDisconnected, IncompleteRead, ...
            raise Unreachable(f"{method} {path}: {type(e).__name__}: {e}") from None

    def register(self, body: dict[str, Any]) -> Answer:
        return self.request("POST", "/register", body)

    def use_token(self, token: str) -> None:
        """From now on, present ``token``: the attempt's agent token, which register
        hands back for the single-use enrolment token a launched task carries."""
        self._target = (self._target[0], token)

    def move_to(self, attempt: int, token: str) -> None:
        """From now on, speak for ``attempt`` with its agent token (a node carried warm
        into it by a ``regroup`` command)."""
        self._target = (self._prefix(attempt), token)

    def heartbeat(self, body: dict[str, Any]) -> Answer:
        return self.request("POST", "/heartbeat", body)

    def commands(self, after: int, wait: float) -> Answer:
        return self.request("GET", f"/commands?after={after}&wait={wait:g}", timeout=wait + 10.0)

    def report(self, body: dict[str, Any]) -> Answer:
        return self.request("POST", "/reports", body)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _encode(body: Any) -> bytes:
    """JSON the service accepts: NaN and Infinity (which json.dumps writes, and the
    service refuses) go out as null, anything else unknown as its str. Never raises:
    a body that failed to encode would stop the thread sending it."""
    try:
        return json.dumps(body, allow_nan=False, default=str).encode()
    except ValueError:
        return json.dumps(_finite(body), allow_nan=False, default=str).encode()


def _parse(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw[:200].decode("utf-8", "replace")


def _detail(raw: bytes) -> str:
    doc = _parse(raw)
    if isinstance(doc, dict) and "detail" in doc:
        return str(doc["detail"])
    return str(doc or "")
