"""A metadata simulator: AWS IMDSv2, GCP and Azure formats for many nodes, one server.

Every simulated node has its own base URL, ``<url>/nodes/<node>``, under which the
providers' real paths answer (``/latest/api/token``, ``/computeMetadata/v1/...``,
``/metadata/scheduledevents``), so the pollers run unchanged against it. Nodes are
created on first use. The admin API schedules and clears notices and injects faults:

    POST   /admin/nodes/<node>/notice  {"provider": "aws", "kind": "terminate", "in_seconds": 120}
    DELETE /admin/nodes/<node>/notice
    POST   /admin/nodes/<node>/faults  {"errors_5xx": 2, "garbage": true,
                                        "slow_first_call_s": 3.0, "revoke_tokens": true}
    DELETE /admin/nodes/<node>/faults
    GET    /admin/nodes/<node>         state and request counters (JSON)

Run it standalone with ``python -m orchestrator.cloud.simulator --port P``.

A node that is a host of its own (a network namespace, see
:mod:`orchestrator.launchers.netns`) reaches its metadata at the real address. There a
:class:`MetadataFront` listens and forwards every request, as it came, to this
simulator's ``/nodes/<node>`` URL, and every answer, as it came, back:

    python -m orchestrator.cloud.simulator front --listen 169.254.169.254:80 \
        --upstream http://GATEWAY:PORT/nodes/NODE
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from orchestrator.cloud import metadata as md
from orchestrator.cloud.metadata import PROVIDERS

_KINDS = {str(p): {str(k) for k in kinds} for p, kinds in md.NOTICE_KINDS.items()}
#: Long polls are capped so a stuck client cannot hold a server thread for long.
MAX_WAIT_S = 60.0


@dataclass
class _Notice:
    provider: str
    kind: str
    deadline: datetime
    event_id: str


@dataclass
class NodeState:
    notice: _Notice | None = None
    errors_5xx: int = 0
    """This many next provider requests answer 503."""
    garbage: bool = False
    """Provider paths answer 200 with a body in no provider's format."""
    slow_first_call_s: float = 0.0
    """Azure's first scheduledevents call sleeps this long (the service warming up)."""
    azure_called: bool = False
    incarnation: int = 1
    tokens: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    version: int = 0
    aws_meta: dict[str, str] = field(default_factory=dict)
    """AWS ``/latest/meta-data/<key>`` leaves (instance-id, ...): the node's identity."""


class MetadataSimulator:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        providers: tuple[str, ...] = PROVIDERS,
    ) -> None:
        #: Formats served; a real cloud serves one, which is what detection relies on.
        self.providers = frozenset(providers)
        self._nodes: dict[str, NodeState] = {}
        self._cond = threading.Condition()
        sim = self

        class Handler(_Handler):
            simulator = sim

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def node_url(self, node: str) -> str:
        return f"{self.url}/nodes/{node}"

    def start(self) -> MetadataSimulator:
        # A short poll interval keeps stop() (and so each test teardown) fast.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        if self._thread:
            self._thread.join(5)

    def __enter__(self) -> MetadataSimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- state, used by the admin API and directly by tests -----------------------

    def node(self, name: str) -> NodeState:
        with self._cond:
            return self._nodes.setdefault(name, NodeState())

    def schedule_notice(self, node: str, provider: str, kind: str, in_seconds: float) -> None:
        if provider not in _KINDS:
            raise ValueError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
        if kind not in _KINDS[provider]:
            raise ValueError(f"kind for {provider} must be one of {sorted(_KINDS[provider])}")
        if not isinstance(in_seconds, int | float) or in_seconds < 0:
            raise ValueError(f"in_seconds must be a number >= 0, got {in_seconds!r}")
        deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=in_seconds)
        with self._cond:
            st = self._nodes.setdefault(node, NodeState())
            st.notice = _Notice(provider, kind, deadline, secrets.token_hex(8))
            st.incarnation += 1
            st.version += 1
            self._cond.notify_all()

    def clear_notice(self, node: str) -> None:
        with self._cond:
            st = self._nodes.setdefault(node, NodeState())
            if st.notice is not None:
                st.notice = None
                st.incarnation += 1
                st.version += 1
            self._cond.notify_all()

    def set_faults(
        self,
        node: str,
        *,
        errors_5xx: int | None = None,
        garbage: bool | None = None,
        slow_first_call_s: float | None = None,
        revoke_tokens: bool = False,
    ) -> None:
        with self._cond:
            st = self._nodes.setdefault(node, NodeState())
            if errors_5xx is not None:
                st.errors_5xx = int(errors_5xx)
            if garbage is not None:
                st.garbage = bool(garbage)
            if slow_first_call_s is not None:
                st.slow_first_call_s = float(slow_first_call_s)
                st.azure_called = False
            if revoke_tokens:
                st.tokens.clear()

    def set_aws_metadata(self, node: str, values: dict[str, str]) -> None:
        """Serve ``values`` under AWS's ``/latest/meta-data/`` (the node's identity)."""
        with self._cond:
            self._nodes.setdefault(node, NodeState()).aws_meta.update(values)

    def clear_faults(self, node: str) -> None:
        with self._cond:
            st = self._nodes.setdefault(node, NodeState())
            st.errors_5xx, st.garbage, st.slow_first_call_s = 0, False, 0.0

    def snapshot(self, node: str) -> dict[str, Any]:
        with self._cond:
            st = self._nodes.setdefault(node, NodeState())
            n = st.notice
            return {
                "notice": None
                if n is None
                else {"provider": n.provider, "kind": n.kind, "deadline": n.deadline.isoformat()},
                "errors_5xx": st.errors_5xx,
                "garbage": st.garbage,
                "slow_first_call_s": st.slow_first_call_s,
                "counts": dict(st.counts),
            }


def _etag(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


class _Handler(BaseHTTPRequestHandler):
    simulator: MetadataSimulator
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests and agents
        pass

    def _send(self, status: int, body: bytes | str, headers: dict[str, str] | None = None) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, status: int, doc: Any, headers: dict[str, str] | None = None) -> None:
        h = {"Content-Type": "application/json", **(headers or {})}
        self._send(status, json.dumps(doc), h)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        return json.loads(raw)

    def do_GET(self) -> None:
        self._route("GET")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def _route(self, method: str) -> None:
        parts = urlsplit(self.path)
        segs = parts.path.strip("/").split("/")
        try:
            if len(segs) >= 3 and segs[0] == "admin" and segs[1] == "nodes":
                return self._admin(method, segs[2], segs[3:])
            if len(segs) >= 3 and segs[0] == "nodes":
                rest = "/" + "/".join(segs[2:])
                return self._provider(method, segs[1], rest, parse_qs(parts.query))
        except (ValueError, TypeError) as e:
            return self._json(400, {"error": str(e)})
        self._json(404, {"error": f"no route for {method} {parts.path}"})

    # --- admin --------------------------------------------------------------------

    def _admin(self, method: str, node: str, rest: list[str]) -> None:
        sim = self.simulator
        what = rest[0] if rest else ""
        if what == "notice" and method == "POST":
            doc = self._body()
            if not isinstance(doc, dict):
                raise ValueError("body must be a JSON object")
            sim.schedule_notice(
                node, doc.get("provider", ""), doc.get("kind", ""), doc.get("in_seconds", 120)
            )
            return self._json(200, sim.snapshot(node))
        if what == "notice" and method == "DELETE":
            sim.clear_notice(node)
            return self._json(200, sim.snapshot(node))
        if what == "faults" and method == "POST":
            doc = self._body()
            if not isinstance(doc, dict):
                raise ValueError("body must be a JSON object")
            allowed = {"errors_5xx", "garbage", "slow_first_call_s", "revoke_tokens"}
            unknown = set(doc) - allowed
            if unknown:
                raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {sorted(allowed)}")
            sim.set_faults(node, **doc)
            return self._json(200, sim.snapshot(node))
        if what == "faults" and method == "DELETE":
            sim.clear_faults(node)
            return self._json(200, sim.snapshot(node))
        if what == "" and method == "GET":
            return self._json(200, sim.snapshot(node))
        self._json(404, {"error": f"no admin route {method} {'/'.join(rest)}"})

    # --- provider formats ---------------------------------------------------------

    def _provider(self, method: str, node: str, path: str, query: dict[str, list[str]]) -> None:
        sim = self.simulator
        st = sim.node(node)
        with sim._cond:
            st.counts[f"{method} {path}"] = st.counts.get(f"{method} {path}", 0) + 1
            if st.errors_5xx > 0:
                st.errors_5xx -= 1
                return self._send(503, "Service Unavailable")
            garbage = st.garbage
        if garbage:
            return self._send(200, b"<html>\x00\xff not metadata", {"Content-Type": "text/html"})
        served = sim.providers
        if path.startswith("/latest/") and "aws" in served:
            return self._aws(method, st, path)
        if path.startswith("/computeMetadata/v1/") and "gcp" in served:
            return self._gcp(st, path, query)
        if path == "/metadata/scheduledevents" and "azure" in served:
            return self._azure(st)
        self._send(404, "Not Found")

    def _aws(self, method: str, st: NodeState, path: str) -> None:
        sim = self.simulator
        if path == md.AWS_TOKEN_PATH:
            if method != "PUT":
                return self._send(405, "Method Not Allowed")
            try:
                ttl = int(self.headers.get(md.AWS_TOKEN_TTL_HEADER, ""))
            except ValueError:
                return self._send(400, "Bad Request")
            if not 1 <= ttl <= 21600:
                return self._send(400, "Bad Request")
            token = secrets.token_urlsafe(24)
            with sim._cond:
                st.tokens[token] = time.monotonic() + ttl
            return self._send(200, token, {AWS_TTL_RESPONSE: str(ttl)})
        token = self.headers.get(md.AWS_TOKEN_HEADER, "")
        with sim._cond:
            valid = st.tokens.get(token, 0.0) > time.monotonic()
            n = st.notice
        if not valid:
            return self._send(401, "Unauthorized")
        is_aws = n is not None and n.provider == "aws"
        if path == md.AWS_SPOT_PATH and is_aws and n is not None and n.kind != "rebalance":
            when = n.deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
            return self._json(200, {"action": n.kind, "time": when})
        if path == md.AWS_REBALANCE_PATH and is_aws and n is not None:
            # A spot notice implies a rebalance recommendation was (or is) out too.
            issued = (n.deadline - timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
            return self._json(200, {"noticeTime": issued})
        leaf = path.removeprefix("/latest/meta-data/")
        if leaf != path and leaf in st.aws_meta:
            return self._send(200, st.aws_meta[leaf], {"Content-Type": "text/plain"})
        self._send(404, "Not Found")

    def _gcp_value(self, st: NodeState, path: str) -> str | None:
        n = st.notice
        gcp = n if n is not None and n.provider == "gcp" else None
        if path == md.GCP_PREEMPTED_PATH:
            return "TRUE" if gcp and gcp.kind == "preempt" else "FALSE"
        if path == md.GCP_MAINTENANCE_PATH:
            return "TERMINATE_ON_HOST_MAINTENANCE" if gcp and gcp.kind == "maintenance" else "NONE"
        return None

    def _gcp(self, st: NodeState, path: str, query: dict[str, list[str]]) -> None:
        sim = self.simulator
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._send(403, "Missing Metadata-Flavor:Google header.")
        with sim._cond:
            value = self._gcp_value(st, path)
            if value is None:
                return self._send(404, "Not Found")
            if query.get("wait_for_change", [""])[0] == "true":
                last = query.get("last_etag", [""])[0]
                wait = min(float(query.get("timeout_sec", ["30"])[0]), MAX_WAIT_S)
                end = time.monotonic() + wait
                # Without last_etag GCP answers at the next change; with it, at once
                # if the value already differs from what the client saw.
                start_version = st.version
                while True:
                    value = self._gcp_value(st, path) or ""
                    if last and _etag(value) != last:
                        break
                    if not last and st.version != start_version:
                        break
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    sim._cond.wait(left)
        self._send(
            200,
            value,
            {"Metadata-Flavor": "Google", "ETag": _etag(value), "Content-Type": "text/plain"},
        )

    def _azure(self, st: NodeState) -> None:
        sim = self.simulator
        if self.headers.get("Metadata") != "true":
            return self._json(400, {"error": "Bad request. Required metadata header not specified"})
        with sim._cond:
            slow = 0.0 if st.azure_called else st.slow_first_call_s
            st.azure_called = True
        if slow:
            time.sleep(slow)
        with sim._cond:
            n, inc = st.notice, st.incarnation
        events = []
        if n is not None and n.provider == "azure":
            events.append(
                {
                    "EventId": n.event_id,
                    "EventStatus": "Scheduled",
                    "EventType": n.kind.capitalize(),
                    "ResourceType": "VirtualMachine",
                    "Resources": ["node"],
                    "NotBefore": format_datetime(n.deadline, usegmt=True),
                    "Description": "simulated",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            )
        self._json(200, {"DocumentIncarnation": inc, "Events": events})


AWS_TTL_RESPONSE = md.AWS_TOKEN_TTL_HEADER

# Hop-by-hop headers belong to one connection, not to the request (RFC 9110 7.6.1);
# Content-Length is recomputed from the body actually relayed.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)


def relay(
    upstream: tuple[str, int],
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes | None,
    *,
    timeout_s: float,
    host: str | None = None,
) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """One HTTP exchange relayed to ``upstream`` as it came (the metadata front here,
    the emulated AWS's fault front before moto): status, reason, headers, body.
    ``host`` replaces the client's ``Host`` header; None passes it on (moto reads the
    region from it)."""
    conn = http.client.HTTPConnection(*upstream, timeout=timeout_s)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        for k, v in headers:
            if k.lower() in _HOP_BY_HOP or (host is not None and k.lower() == "host"):
                continue
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
        return resp.status, resp.reason, kept, data
    finally:
        conn.close()


def send_relayed(
    handler: BaseHTTPRequestHandler,
    status: int,
    reason: str,
    headers: list[tuple[str, str]],
    data: bytes,
) -> None:
    """Answer ``handler``'s request with what :func:`relay` brought back."""
    # send_response_only: the upstream's own Server and Date pass through as they came.
    handler.send_response_only(status, reason)
    for k, v in headers:
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


class MetadataFront:
    """One node's metadata service at the real address, relaying to a shared simulator.

    Method, path, query, headers (``X-aws-ec2-metadata-token``, ``Metadata-Flavor``,
    ``Metadata``, ...) and body go upstream unchanged; status, headers and body come
    back unchanged, so IMDSv2 tokens, GCP's ``wait_for_change`` long polls and Azure's
    scheduled events behave exactly as against the simulator itself. An unreachable
    upstream answers 502: a poller reads that as *unknown*, which is the truth.
    """

    def __init__(self, host: str, port: int, upstream: str) -> None:
        up = urlsplit(upstream)
        if up.scheme != "http" or not up.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {upstream!r}")
        self.upstream = upstream
        self._up_host, self._up_port = up.hostname, up.port or 80
        self._up_netloc = up.netloc
        self._up_path = up.path.rstrip("/")
        #: Longer than the longest long poll the simulator holds open.
        self.timeout_s = MAX_WAIT_S + 30
        front = self

        class Handler(_FrontHandler):
            relay = front

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> MetadataFront:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread:
            self._thread.join(5)

    def __enter__(self) -> MetadataFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        self._server.serve_forever(poll_interval=0.5)

    def forward(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        return relay(
            (self._up_host, self._up_port),
            method,
            self._up_path + path,
            headers,
            body,
            timeout_s=self.timeout_s,
            host=self._up_netloc,
        )


class _FrontHandler(BaseHTTPRequestHandler):
    relay: MetadataFront
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet, like the simulator
        pass

    def _relay(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n or "Content-Length" in self.headers else None
        try:
            status, reason, headers, data = self.relay.forward(
                self.command, self.path, list(self.headers.items()), body
            )
        except (OSError, http.client.HTTPException) as e:
            status, reason, data = 502, "Bad Gateway", f"metadata upstream: {e}".encode()
            headers = [("Content-Type", "text/plain")]
            print(f"metadata front: {self.command} {self.path}: {e}", file=sys.stderr, flush=True)
        send_relayed(self, status, reason, headers, data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay


def _front_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.cloud.simulator front",
        description="Serve one node's metadata at LISTEN, relayed to UPSTREAM.",
    )
    parser.add_argument("--listen", default="169.254.169.254:80", help="HOST:PORT")
    parser.add_argument("--upstream", required=True, help="the simulator's /nodes/<node> URL")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--listen must be HOST:PORT, got {args.listen!r}")
    front = MetadataFront(host, int(port), args.upstream)
    # The one line on stdout: the launcher waits for it to know the front is bound.
    print(f"metadata front at {front.url} -> {args.upstream}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        front.serve_forever()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["front"]:
        return _front_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument(
        "--providers", default=",".join(PROVIDERS), help="formats to serve, comma-separated"
    )
    args = parser.parse_args(argv)
    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    sim = MetadataSimulator(args.host, args.port, providers).start()
    print(f"metadata simulator at {sim.url} (nodes under {sim.url}/nodes/<node>)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        sim.stop()


if __name__ == "__main__":
    main()
