"""A real webhook receiver on loopback (http.server in a thread): it records each
request's event id, body and whether the HMAC signature checks out. A module of its
own name: ``from conftest import`` would find whichever conftest pytest loaded last."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SECRET = "s3cret-for-the-webhook-tests"


class Receiver:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.fail_with: int | None = None  # answer this status instead of 200
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                ts = self.headers["X-Skyresume-Timestamp"]
                want = (
                    "sha256="
                    + hmac.new(
                        SECRET.encode(), ts.encode() + b"." + raw, hashlib.sha256
                    ).hexdigest()
                )
                code = receiver.fail_with or 200
                with receiver.lock:
                    receiver.got.append(
                        {
                            "event": self.headers["X-Skyresume-Event"],
                            "signed": hmac.compare_digest(
                                want, self.headers["X-Skyresume-Signature"]
                            ),
                            "body": json.loads(raw),
                            "answered": code,
                        }
                    )
                self.send_response(code)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def delivered(self) -> list[str]:
        with self.lock:
            return [g["event"] for g in self.got if g["answered"] == 200]
