"""The agent's control file: settings the service changes while the job runs.

The agent rewrites the JSON file named by ``SKYRESUME_RUN_CONTROL_FILE``
(``{"checkpoint_every": N}``, and for chaos ``"inject_fault": {"kind", "token",
"rank"}``, see ``training.chaos``; on an elastic run the group's ``"membership"``,
``orchestrator.contract.Membership``) when the service pushes a new value. Reading it
costs one ``stat`` per poll; the file is parsed only when its mtime, size or inode
changed (the agent replaces it by rename, so a rewrite of the same size within the
same clock tick is still seen). A missing, half-written or invalid file never stops
training: the last good value stays, and each distinct problem is printed once.

Ranks must switch at the same step (a save is a collective), so ``Run`` shares
each rank's reading at a step boundary and applies a new interval only when
every rank read the same one.
"""

from __future__ import annotations

import json
import os
import sys

from orchestrator.contract import MEMBERSHIP_KEY, Membership
from training.chaos import FaultRequest, parse_fault


class ControlFile:
    def __init__(self, path: str | None) -> None:
        self.path = path or None
        self._seen: tuple[int, int, int] | None = None
        self._warned: set[str] = set()
        self.checkpoint_every: int | None = None
        """The last valid value read; None until the file says something valid."""
        self.fault: FaultRequest | None = None
        """Chaos only: the last valid ``inject_fault`` request read. ``Run`` acts on
        each token once; the file may hold the same one for the rest of the run."""
        self.membership: Membership | None = None
        """Elastic runs: the last valid membership read (``Run.groups()`` re-forms on a
        newer generation); None until the file holds one."""

    def poll(self) -> int | None:
        """Re-read the file if it changed; returns the current checkpoint interval."""
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return self.checkpoint_every  # not written yet (or removed): keep what we had
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig == self._seen:
            return self.checkpoint_every
        self._seen = sig
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            self._warn(f"{self.path}: not valid JSON ({e}); keeping the current settings")
            self._seen = None  # a half-written file: read it again next time
            return self.checkpoint_every
        if isinstance(doc, dict) and doc.get("inject_fault") is not None:
            try:
                self.fault = parse_fault(doc["inject_fault"])
            except ValueError as e:
                self._warn(f"{self.path}: {e}; no fault injected")
        if isinstance(doc, dict) and doc.get(MEMBERSHIP_KEY) is not None:
            try:
                self.membership = Membership.from_doc(doc[MEMBERSHIP_KEY])
            except (TypeError, ValueError) as e:
                self._warn(f"{self.path}: {e}; keeping the current membership")
        every = doc.get("checkpoint_every") if isinstance(doc, dict) else None
        if every is None and "checkpoint_every" not in (doc if isinstance(doc, dict) else {}):
            return self.checkpoint_every  # nothing about the interval in this version
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            self._warn(
                f"{self.path}: checkpoint_every must be a positive integer, got {every!r}; "
                "keeping the current settings"
            )
            return self.checkpoint_every
        self.checkpoint_every = every
        return every

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            print(f"warning: {msg}", file=sys.stderr)
