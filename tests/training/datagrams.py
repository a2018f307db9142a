"""The agent's UDP progress listener, for tests: it collects every datagram a rank
sends (``orchestrator.contract`` progress channel)."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any


class Listener:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.got: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.is_set():
            try:
                self.got.append(json.loads(self.sock.recv(65536)))
            except TimeoutError:
                continue

    def close(self) -> list[dict[str, Any]]:
        self._done.set()
        self._thread.join()
        self.sock.close()
        return self.got

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [d for d in self.got if d["type"] == type_]
