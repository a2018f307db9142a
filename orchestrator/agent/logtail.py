"""The node's log tails, uploaded to the service: the agent's own log (kept in memory
by :class:`RingHandler`), torchrun's log and each rank's log (the ends of their files).

Sent on request (the ``upload_logs`` command), every ``every_s`` while anything
changed, and once more at exit. The periodic upload is what keeps a SIGKILLed node's
last lines: a killed agent uploads nothing at exit, so the service holds what it sent
at most ``every_s`` before. Each upload replaces the node's stored tails.

Python 3.9 stdlib only (the agent runs on the node's Python).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable

from orchestrator.agent.ranks import rank_log_tail, tail_lines

log = logging.getLogger(__name__)

#: Lines kept per source (the service refuses more).
TAIL_LINES = 200
#: Seconds between periodic uploads (only when a tail changed); the environment
#: variable overrides it (tests, or a node whose logs matter more than its uplink).
EVERY_S = 5.0
EVERY_ENV = "SKYRESUME_AGENT_LOG_UPLOAD_S"


class RingHandler(logging.Handler):
    """The agent's last ``n`` log records, formatted, in memory."""

    def __init__(self, n: int = TAIL_LINES) -> None:
        super().__init__()
        self.lines: deque[str] = deque(maxlen=n)
        self._lock_lines = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a bad record must never break the agent's logging
            return
        with self._lock_lines:
            for line in text.splitlines() or [""]:
                self.lines.append(line[:4000])

    def snapshot(self) -> list[str]:
        with self._lock_lines:
            return list(self.lines)


def install(node_id: str) -> RingHandler:
    """Attach a ring to the root logger, with the agent's own line format."""
    h = RingHandler()
    h.setFormatter(
        logging.Formatter(f"%(asctime)s skyresume-agent[{node_id}] %(levelname)s %(message)s")
    )
    logging.getLogger().addHandler(h)
    return h


def collect(
    ring: RingHandler | None, ranks: list[Any], torchrun_log: Path | None
) -> list[dict[str, Any]]:
    """Each source's tail: ``agent``, ``torchrun``, ``rank<N>`` (global rank)."""
    out: list[dict[str, Any]] = []
    if ring is not None:
        out.append({"source": "agent", "rank": None, "lines": ring.snapshot()[-TAIL_LINES:]})
    if torchrun_log is not None and torchrun_log.exists():
        out.append(
            {"source": "torchrun", "rank": None, "lines": tail_lines(torchrun_log, TAIL_LINES)}
        )
    for r in ranks:
        out.append(
            {"source": f"rank{r.rank}", "rank": r.rank, "lines": rank_log_tail(r, TAIL_LINES)}
        )
    return out


class LogUploader:
    """Uploads the tails through ``send(body)``; a failed upload is retried at the
    next period (logs are best effort: they never hold up a stop or an exit)."""

    def __init__(
        self,
        send: Callable[[dict[str, Any]], Any],
        gather: Callable[[], list[dict[str, Any]]],
        every_s: float = EVERY_S,
    ) -> None:
        self.send = send
        self.gather = gather
        self.every_s = every_s
        self._last_digest = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def upload(self, reason: str, *, force: bool = True) -> bool:
        with self._lock:  # one upload at a time: request, period and exit may meet
            try:
                logs = self.gather()
                digest = hashlib.sha256(json.dumps(logs, sort_keys=True).encode()).hexdigest()
                if not force and digest == self._last_digest:
                    return False
                self.send({"reason": reason, "logs": logs})
                self._last_digest = digest
                return True
            except Exception as e:  # the service down, a file gone: next time
                log.debug("log upload (%s) failed: %s", reason, e)
                return False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="log-upload", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.upload("periodic", force=False)

    def stop(self, *, final: bool = True) -> None:
        self._stop.set()
        if final:
            self.upload("exit")
