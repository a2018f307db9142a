"""The fault front: a proxy before moto's server that does what AWS does and moto does not.

Every request (EC2, IAM, STS: whatever ``AWS_ENDPOINT_URL`` sends) is relayed to moto
unchanged, except three EC2 actions, which AWS answers differently:

- ``RunInstances`` fails with ``InsufficientInstanceCapacity`` (HTTP 500, EC2's XML
  error document) while a capacity rule matches its region, zone and instance type.
  Rules are set on demand and end after N seconds, after N matching calls, or when
  cleared. The zone is the request's ``Placement.AvailabilityZone`` or, as SkyPilot
  sends it, the zone of its ``NetworkInterface.1.SubnetId``.
- ``StopInstances`` naming a spot instance fails with ``UnsupportedOperation``
  (HTTP 400), always: AWS cannot stop a one-time spot instance, moto can, and a
  SkyPilot refill that tries it (SKYPILOT.md 1.3) must meet the real refusal.
- Spot interruption, which moto never does: ``preempt`` serves the IMDS
  ``spot/instance-action`` notice on the instance's own metadata, then terminates the
  instance in moto when the window runs out; ``terminate`` ends it without notice.

The region is the one in the request's SigV4 credential scope
(``Credential=AKID/DATE/REGION/SERVICE/aws4_request``), else the ``Host`` header's
``ec2.REGION.amazonaws.com``, else us-east-1 (boto3's default).

Admin API, under ``/_awsemu/`` on the same port (JSON in, JSON out; a bad body is a
400 naming the field):

    GET    /_awsemu/faults                    capacity rules, preemptions, counters
    POST   /_awsemu/capacity  {"region": "us-east-1", "zone": "us-east-1a",
                               "instance_type": "m6i.large", "seconds": 60, "calls": 2}
    DELETE /_awsemu/capacity                  clear every capacity rule
    POST   /_awsemu/preempt   {"instance_id": "i-...", "window_s": 120}
    POST   /_awsemu/terminate {"instance_id": "i-..."}
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

from orchestrator.cloud.simulator import relay, send_relayed

ADMIN_PREFIX = "/_awsemu/"
DEFAULT_REGION = "us-east-1"
#: AWS's own window between a spot instance-action notice and the interruption.
DEFAULT_WINDOW_S = 120.0
_SCOPE_RE = re.compile(r"Credential=[^/,\s]+/\d{8}/([a-z0-9-]+)/([a-z0-9-]+)/aws4_request")
_HOST_RE = re.compile(r"^ec2\.([a-z0-9-]+)\.amazonaws\.com")


class Moto(Protocol):
    """What the front asks moto directly (never through itself)."""

    def subnet_zone(self, region: str, subnet_id: str) -> str | None: ...

    def spot_instances(self, region: str, instance_ids: list[str]) -> list[str]: ...

    def terminate(self, instance_id: str) -> str | None:
        """Terminate wherever it lives; the region it was found in, None if nowhere."""
        ...


class Notices(Protocol):
    """Where a spot notice is served: the instance's own IMDS (the metadata simulator)."""

    def schedule_notice(self, node: str, provider: str, kind: str, in_seconds: float) -> None: ...


@dataclass
class CapacityRule:
    """``RunInstances`` matching this fails with InsufficientInstanceCapacity."""

    region: str | None = None
    """None matches every region."""
    zone: str | None = None
    """None matches every zone of the region (a request naming no zone included)."""
    instance_type: str | None = None
    """None matches every instance type."""
    until: float | None = None
    """Wall-clock end (epoch seconds); None: until cleared or its calls run out."""
    calls_left: int | None = None
    """Matching calls still to fail; None: no limit."""
    failed: int = 0
    """Calls this rule has failed so far."""

    def live(self, now: float) -> bool:
        if self.until is not None and now >= self.until:
            return False
        return self.calls_left is None or self.calls_left > 0

    def matches(self, region: str, zone: str | None, instance_type: str | None) -> bool:
        if self.region is not None and self.region != region:
            return False
        if self.zone is not None and self.zone != zone:
            return False
        return self.instance_type is None or self.instance_type == instance_type


@dataclass
class Preemption:
    instance_id: str
    deadline: float
    """Epoch seconds at which the instance is terminated."""
    done: bool = False


def parse_capacity_rule(doc: Any, *, now: float) -> CapacityRule:
    """A rule from the admin API's JSON, refused with a message naming the bad field."""
    if not isinstance(doc, dict):
        raise ValueError("body must be a JSON object")
    unknown = set(doc) - {"region", "zone", "instance_type", "seconds", "calls"}
    if unknown:
        raise ValueError(
            f"unknown field(s) {sorted(unknown)}; known: calls, instance_type, region, "
            "seconds, zone"
        )
    for key in ("region", "zone", "instance_type"):
        if doc.get(key) is not None and (not isinstance(doc[key], str) or not doc[key]):
            raise ValueError(f"{key} must be a non-empty string, got {doc[key]!r}")
    seconds, calls = doc.get("seconds"), doc.get("calls")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0
    ):
        raise ValueError(f"seconds must be a number > 0, got {seconds!r}")
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 1):
        raise ValueError(f"calls must be an integer >= 1, got {calls!r}")
    region, zone = doc.get("region"), doc.get("zone")
    if region is None and zone is not None:
        region = zone[:-1]  # us-east-1a is in us-east-1: AWS zone names are region + letter
    return CapacityRule(
        region=region,
        zone=zone,
        instance_type=doc.get("instance_type"),
        until=None if seconds is None else now + float(seconds),
        calls_left=calls,
    )


def region_of(headers: Any) -> tuple[str, str | None]:
    """(region, service) of a request: SigV4 credential scope, else Host, else default."""
    m = _SCOPE_RE.search(headers.get("Authorization", "") or "")
    if m:
        return m.group(1), m.group(2)
    h = _HOST_RE.match(headers.get("Host", "") or "")
    return (h.group(1) if h else DEFAULT_REGION), ("ec2" if h else None)


def ec2_error(code: str, message: str) -> bytes:
    """EC2's error document, as botocore parses it into ``ClientError``."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Response><Errors><Error><Code>{escape(code)}</Code>"
        f"<Message>{escape(message)}</Message></Error></Errors>"
        f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
    ).encode()


def capacity_message(instance_type: str | None, zone: str | None) -> str:
    # AWS's own wording, which SkyPilot logs and users search for.
    it = instance_type or "the requested"
    where = f"the Availability Zone you requested ({zone})" if zone else "this region"
    return (
        f"We currently do not have sufficient {it} capacity in {where}. Our system will "
        f"be working on provisioning additional capacity. You can currently get {it} "
        "capacity by not specifying an Availability Zone in your request or choosing a "
        "different Availability Zone."
    )


def spot_stop_message(instance_id: str) -> str:
    return (
        f"You can't stop the Spot Instance '{instance_id}' because it is associated with "
        "a one-time Spot Instance request. You can only stop Spot Instances associated "
        "with persistent Spot Instance requests."
    )


@dataclass
class FrontState:
    """Everything the front decides on, behind one lock."""

    rules: list[CapacityRule] = field(default_factory=list)
    preemptions: dict[str, Preemption] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    """Requests seen per EC2 action (and ``refused:<Code>`` per refusal)."""


class FaultFront:
    """The proxy; ``start()`` serves it on a thread, ``url`` is the AWS endpoint."""

    def __init__(
        self,
        upstream: str,
        moto: Moto,
        notices: Notices | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        up = urlsplit(upstream)
        if up.scheme != "http" or not up.hostname or not up.port:
            raise ValueError(f"upstream must be http://HOST:PORT, got {upstream!r}")
        self._up = (up.hostname, up.port)
        self.moto = moto
        self.notices = notices
        self.clock = clock
        self.state = FrontState()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        front = self

        class Handler(_Handler):
            owner = front

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FaultFront:
        for target in (
            lambda: self._server.serve_forever(poll_interval=0.05),
            self._interrupt_loop,
        ):
            t = threading.Thread(target=target, daemon=True, name="awsemu-front")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._server.shutdown()
        self._server.server_close()
        for t in self._threads:
            t.join(5)

    # --- faults, used by the admin API and directly by the emulator ------------------

    def add_capacity_rule(self, rule: CapacityRule) -> None:
        with self._lock:
            self.state.rules.append(rule)

    def clear_capacity(self) -> int:
        with self._lock:
            n = len(self.state.rules)
            self.state.rules.clear()
            return n

    def preempt(self, instance_id: str, window_s: float = DEFAULT_WINDOW_S) -> Preemption:
        """Serve the spot notice now; terminate the instance when the window runs out."""
        if not re.fullmatch(r"i-[0-9a-f]{8,17}", instance_id):
            raise ValueError(f"instance_id {instance_id!r} is not an EC2 instance id")
        if isinstance(window_s, bool) or not isinstance(window_s, int | float) or window_s < 0:
            raise ValueError(f"window_s must be a number >= 0, got {window_s!r}")
        if self.notices is None:
            raise ValueError("this emulator serves no instance metadata: preempt needs hosts")
        self.notices.schedule_notice(instance_id, "aws", "terminate", window_s)
        p = Preemption(instance_id, self.clock() + float(window_s))
        with self._lock:
            self.state.preemptions[instance_id] = p
        self._wake.set()
        return p

    def terminate(self, instance_id: str) -> str:
        """Terminate without notice (a host that just vanished); the instance's region."""
        region = self.moto.terminate(instance_id)
        if region is None:
            raise LookupError(f"no instance {instance_id} in any region")
        return region

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            now = self.clock()
            return {
                "capacity": [asdict(r) for r in self.state.rules if r.live(now)],
                "preemptions": [asdict(p) for p in self.state.preemptions.values()],
                "counts": dict(self.state.counts),
            }

    def _interrupt_loop(self) -> None:
        # One thread ends every due preemption: a timer per notice would be lost, with
        # its termination, if it raised once; this loop logs and tries again.
        while not self._stopping:
            with self._lock:
                now = self.clock()
                due = [p for p in self.state.preemptions.values() if not p.done
                       and p.deadline <= now]  # fmt: skip
                pending = [p.deadline for p in self.state.preemptions.values() if not p.done]
            for p in due:
                try:
                    self.moto.terminate(p.instance_id)
                except Exception as e:  # moto restarting: the next pass tries again
                    print(f"awsemu front: terminating {p.instance_id}: {e}", flush=True)
                    continue
                with self._lock:
                    p.done = True
            wait = min([d - self.clock() for d in pending if d > self.clock()] + [1.0])
            self._wake.wait(max(wait, 0.05))
            self._wake.clear()

    # --- the decision on one EC2 request ---------------------------------------------

    def refusal(self, region: str, params: dict[str, str]) -> tuple[int, str, str] | None:
        """(HTTP status, code, message) when AWS would refuse this EC2 request, else None."""
        action = params.get("Action", "")
        with self._lock:
            self.state.counts[action] = self.state.counts.get(action, 0) + 1
        if action == "RunInstances":
            return self._capacity(region, params)
        if action == "StopInstances":
            ids = [v for k, v in sorted(params.items()) if re.fullmatch(r"InstanceId\.\d+", k)]
            spot = self.moto.spot_instances(region, ids)
            if spot:
                return self._count(400, "UnsupportedOperation", spot_stop_message(spot[0]))
        return None

    def _capacity(self, region: str, params: dict[str, str]) -> tuple[int, str, str] | None:
        itype = params.get("InstanceType")
        with self._lock:
            now = self.clock()
            self.state.rules = [r for r in self.state.rules if r.live(now)]
            if not self.state.rules:
                return None
            zone_needed = any(r.zone is not None for r in self.state.rules)
        zone = params.get("Placement.AvailabilityZone")
        subnet = params.get("NetworkInterface.1.SubnetId") or params.get("SubnetId")
        if zone is None and subnet and zone_needed:
            zone = self.moto.subnet_zone(region, subnet)
        with self._lock:
            for r in self.state.rules:
                if r.live(now) and r.matches(region, zone, itype):
                    r.failed += 1
                    if r.calls_left is not None:
                        r.calls_left -= 1
                    break
            else:
                return None
        return self._count(500, "InsufficientInstanceCapacity", capacity_message(itype, zone))

    def _count(self, status: int, code: str, message: str) -> tuple[int, str, str]:
        with self._lock:
            key = f"refused:{code}"
            self.state.counts[key] = self.state.counts.get(key, 0) + 1
        return status, code, message

    # --- relaying ----------------------------------------------------------------------

    def forward(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        return relay(self._up, method, path, headers, body, timeout_s=120)


class _Handler(BaseHTTPRequestHandler):
    owner: FaultFront
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # moto logs every request
        pass

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, doc: Any) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json")

    def _handle(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        if self.path.startswith(ADMIN_PREFIX):
            return self._admin(body)
        region, service = region_of(self.headers)
        if service == "ec2":
            params = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
            ctype = self.headers.get("Content-Type", "")
            if body and ctype.startswith("application/x-www-form-urlencoded"):
                form = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
                params.update({k: v[0] for k, v in form.items()})
            try:
                refused = self.owner.refusal(region, params)
            except Exception as e:  # moto unreadable: say so, as AWS says InternalError
                refused = (500, "InternalError", f"awsemu front could not check: {e}")
            if refused is not None:
                status, code, message = refused
                return self._send(status, ec2_error(code, message), "text/xml;charset=UTF-8")
        try:
            status, reason, headers, data = self.owner.forward(
                self.command, self.path, list(self.headers.items()), body
            )
        except (OSError, http.client.HTTPException) as e:
            msg = f"awsemu front: moto is unreachable: {e}"
            return self._send(503, ec2_error("ServiceUnavailable", msg), "text/xml")
        send_relayed(self, status, reason, headers, data)

    def _admin(self, body: bytes | None) -> None:
        front = self.owner
        what = self.path[len(ADMIN_PREFIX) :].split("?")[0].strip("/")
        try:
            doc = json.loads(body) if body else {}
        except ValueError as e:
            return self._json(400, {"error": f"body is not JSON: {e}"})
        try:
            if (self.command, what) == ("GET", "faults"):
                return self._json(200, front.snapshot())
            if (self.command, what) == ("POST", "capacity"):
                rule = parse_capacity_rule(doc, now=front.clock())
                front.add_capacity_rule(rule)
                return self._json(200, {"added": asdict(rule), **front.snapshot()})
            if (self.command, what) == ("DELETE", "capacity"):
                return self._json(200, {"cleared": front.clear_capacity()})
            if (self.command, what) in {("POST", "preempt"), ("POST", "terminate")}:
                if not isinstance(doc, dict) or not isinstance(doc.get("instance_id"), str):
                    raise ValueError("body must be a JSON object with a string instance_id")
                if what == "terminate":
                    region = front.terminate(doc["instance_id"])
                    return self._json(200, {"terminated": doc["instance_id"], "region": region})
                window = doc.get("window_s", DEFAULT_WINDOW_S)
                return self._json(200, asdict(front.preempt(doc["instance_id"], window)))
        except LookupError as e:
            return self._json(404, {"error": str(e).strip("'\"")})
        except (ValueError, TypeError) as e:
            return self._json(400, {"error": str(e)})
        self._json(404, {"error": f"no admin route {self.command} {ADMIN_PREFIX}{what}"})

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle


def admin(url: str, method: str, what: str, doc: dict[str, Any] | None = None) -> Any:
    """Call the front's admin API at ``url``; the JSON answer, or RuntimeError saying why."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=30)
    with contextlib.closing(conn):
        body = json.dumps(doc).encode() if doc is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, ADMIN_PREFIX + what, body=body, headers=headers)
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"null")
    if resp.status != 200:
        raise RuntimeError(f"{method} {what}: {resp.status} {data.get('error', data)}")
    return data
