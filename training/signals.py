"""SIGTERM/SIGUSR1 become a flag; ranks agree to stop at a step boundary.

A handler does no I/O and touches no collective: it only sets a flag. At each step
boundary every rank all-reduces (MAX) its flag, so one rank's notice stops all of
them at the same step, and they save the same emergency checkpoint.
"""

from __future__ import annotations

import signal
import threading


class StopRequest:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        self._flag = threading.Event()
        self.signum: int | None = None
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signum = signum
        self._flag.set()

    @property
    def requested_here(self) -> bool:
        return self._flag.is_set()

    def agreed(self, group=None) -> bool:
        """True on every rank if any rank was signalled (a collective: all ranks call)."""
        import torch
        import torch.distributed as dist

        local = self._flag.is_set()
        if not (dist.is_available() and dist.is_initialized()):
            return local
        t = torch.tensor([1 if local else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())

    def reinstall(self) -> None:
        """This handler again, over one installed after it (a framework's own): the
        handlers ``restore`` puts back are still the ones found at construction."""
        for s in self._previous:
            signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
