"""Per-step progress to the node agent: one UDP datagram on loopback per report.

UDP because a report must never block or slow a step: ``sendto`` on a
non-blocking socket either queues the datagram or fails at once, and nobody
listening (no agent) costs nothing. Errors are swallowed by design.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from orchestrator.contract import MAX_DATAGRAM, Env


class ProgressReporter:
    def __init__(self, addr: str | None = None, *, rank: int = 0) -> None:
        addr = addr if addr is not None else os.environ.get(Env.PROGRESS_ADDR, "")
        self.rank = rank
        self._dest: tuple[str, int] | None = None
        self._sock: socket.socket | None = None
        if addr:
            host, _, port = addr.rpartition(":")
            try:
                self._dest = (host or "127.0.0.1", int(port))
                self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            except (ValueError, OSError):
                self._dest = self._sock = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, type_: str, **fields: object) -> None:
        if self._sock is None or self._dest is None:
            return
        doc = {"type": type_, "rank": self.rank, "ts": time.time(), **fields}
        data = json.dumps(doc, default=str).encode()[:MAX_DATAGRAM]
        # A full buffer or no listener: progress is best effort, steps are not.
        with contextlib.suppress(OSError):
            self._sock.sendto(data, self._dest)

    def progress(
        self,
        *,
        step: int,
        step_time: float,
        loss: float,
        grad_norm: float,
        samples_per_s: float,
        max_steps: int | None = None,
    ) -> None:
        """``max_steps``: where the run ends (the work left, for the service's choices)."""
        self.send(
            "progress",
            step=step,
            step_time=step_time,
            loss=loss,
            grad_norm=grad_norm,
            samples_per_s=samples_per_s,
            max_steps=max_steps,
        )
