"""The agent's UDP listener for the ranks' datagrams (``orchestrator.contract``,
``PROGRESS_TYPES``), aggregated per rank so one heartbeat carries the whole node.

UDP on loopback because a rank must never block on the agent; the agent in turn
must never trust a datagram: anything malformed is counted and dropped.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.contract import MAX_DATAGRAM, PROGRESS_TYPES


@dataclass
class RankProgress:
    step: int | None = None
    step_time: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    max_steps: int | None = None
    """Where the run ends (``training.Run.steps``), when the rank says."""
    last_seen: float | None = None
    """time.monotonic() of the last datagram from this rank."""
    resumed: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None
    exit: dict[str, Any] | None = None
    regrouping: int | None = None
    """Elastic warm regroup: the generation the rank left (its ``regroup`` datagram)
    while it waits for a newer membership; None once it resumed (or never left)."""
    first_step_due: bool = False
    """Resumed, and no step past the resume step reported yet: the first one is passed
    on as an event (the service hears a recovery train again at once)."""


def finite(x: Any) -> float | None:
    """A float the service can store: NaN/Inf (and non-numbers) become None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


EVENT_TYPES = ("checkpoint", "anomaly", "exit", "regroup", "resumed")
"""Datagrams passed on to ``ProgressBoard.on_event`` as they come; of progress, only a
rank's first step past a resume."""


@dataclass
class ProgressBoard:
    """Per-rank state from datagrams. ``on_event`` gets the docs of ``EVENT_TYPES``
    (from the listener thread): checkpoint/anomaly/exit become reports, and a rank
    leaving a group or resuming in one has the agent heartbeat at once."""

    on_event: Callable[[dict[str, Any]], None] = lambda doc: None
    clock: Callable[[], float] = time.monotonic
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    dropped: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ingest(self, data: bytes) -> dict[str, Any] | None:
        """Apply one datagram; returns the parsed doc, or None when it was dropped."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        if (
            not isinstance(doc, dict)
            or doc.get("type") not in PROGRESS_TYPES
            or _int(doc.get("rank")) is None
            or doc["rank"] < 0
        ):
            with self._lock:
                self.dropped += 1
            return None
        kind, rank = doc["type"], doc["rank"]
        with self._lock:
            p = self.ranks.setdefault(rank, RankProgress())
            p.last_seen = self.clock()
            first_step = False
            if kind == "progress":
                p.step = _int(doc.get("step"))
                since = (p.resumed or {}).get("step")
                if p.first_step_due and p.step is not None and since is not None:
                    first_step = p.step > since
                    p.first_step_due = not first_step
                p.step_time = finite(doc.get("step_time"))
                p.loss = finite(doc.get("loss"))
                p.grad_norm = finite(doc.get("grad_norm"))
                p.max_steps = _int(doc.get("max_steps"))
            elif kind == "regroup":
                p.regrouping = _int(doc.get("generation"))
                p.resumed = None  # what it resumed from belongs to the group it left
            elif kind == "resumed":
                p.regrouping = None
                p.resumed = {
                    "step": _int(doc.get("step")),
                    "manifest_digest": doc.get("manifest_digest"),
                }
                if p.step is None:
                    p.step = _int(doc.get("step"))
                p.first_step_due = True
            elif kind == "checkpoint":
                p.checkpoint = doc
            elif kind == "exit":
                p.exit = doc
        if kind in EVENT_TYPES or first_step:
            self.on_event(doc)
        return doc

    def reset(self) -> None:
        """Forget every rank (a carried agent: its ranks report under new global ranks,
        and what they said belongs to the attempt left)."""
        with self._lock:
            self.ranks.clear()

    def snapshot(self, rank: int) -> RankProgress:
        with self._lock:
            p = self.ranks.get(rank)
            return RankProgress(**p.__dict__) if p else RankProgress()

    def last_checkpoint(self) -> dict[str, Any] | None:
        """The newest checkpoint any local rank reported."""
        with self._lock:
            docs = [p.checkpoint for p in self.ranks.values() if p.checkpoint]
        if not docs:
            return None
        doc = max(docs, key=lambda d: _int(d.get("step")) or -1)
        step = _int(doc.get("step"))
        if step is None or step < 0:
            return None
        return {"step": step, "path": doc.get("path"), "uploaded_uri": doc.get("uploaded_uri")}


class ProgressListener:
    """A UDP socket on 127.0.0.1 (ephemeral port) feeding a :class:`ProgressBoard`."""

    def __init__(self, board: ProgressBoard, host: str = "127.0.0.1") -> None:
        self.board = board
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        # A burst of 8 ranks x checkpoint + progress must not overflow the default buffer.
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-udp", daemon=True)

    @property
    def addr(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> ProgressListener:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, _ = self._sock.recvfrom(MAX_DATAGRAM + 1024)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self.board.ingest(data)
            except Exception:  # a bad datagram or callback must not kill the listener
                self.board.dropped += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        self._sock.close()
