"""Each test gets the signal handlers the session had: a Run that exits keeps its
flag-only SIGTERM/SIGUSR1 handler installed (a rank must, until it is gone), and in
this shared process that would leave pytest unable to be stopped by SIGTERM."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _signal_handlers_back() -> Iterator[None]:
    found = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in found.items():
        signal.signal(s, handler)
