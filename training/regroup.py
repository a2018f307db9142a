"""Warm regroup: an elastic rank re-forms its process group in the same process
(``Run.groups()``), keeping torch imported, the model built and the optimizer.

``Group`` is the ``with`` block of one process group; ``detect_group_loss`` (pure)
says which errors end it; ``await_membership`` (pure, fake-able clock) waits for the
agent's next ``Membership``; the torch helpers at the end are what Run calls around
``destroy_process_group`` / ``init_process_group``.

Which errors end a group rather than the process (``detect_group_loss``): only the
errors gloo raises when a peer of a collective is gone, read from the exception's text
because gloo raises a plain ``RuntimeError`` for them (no type of its own; torch
2.13 with gloo, a peer SIGKILLed mid-run: every survivor blocked in a collective got
it milliseconds after the kill):

    RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer
    [127.0.0.1]:8880. This is typically caused by a remote worker crashing. ...

or, by where the survivor was (seen as often, from DDP's all-reduce future):

    RuntimeError: Got the following error when running the callback: RuntimeError:
    [.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:27534: Connection
    reset by peer. ...

and, when a peer hangs or its host vanishes without closing its sockets (a spot VM
reclaimed at once sends no FIN), after the group's timeout:

    RuntimeError: [.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
    5000ms for recv operation to complete

(and on the rank's other operations of the same context, which gloo closes with it:
``RuntimeError: Application timeout caused pair closure``)

The same texts reach Run wrapped: ``CheckpointError`` (a background save whose
collective failed, as its ``__cause__``) and DCP's ``CheckpointException`` (a
``BaseException``, holding each rank's error in ``failures``), so the causes are
walked. Nothing else is a loss: a user's bug, an OOM, ``RunExit`` (NaN, corruption,
a stop) and NCCL's errors propagate as on a run without warm regroup (NCCL's async
error handling tears the process down on its own, so a warm NCCL regroup needs more
than this module).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from orchestrator.contract import Membership, RegroupReason

#: gloo's texts for a collective whose peer is gone. "closed by peer" and "reset by
#: peer" are what torch 2.13 raised here (by where the survivor was); the others are
#: gloo's texts for the same loss at another moment (a write into the closed socket)
#: and in other versions, as the service's classifier lists them under node_lost.
PEER_LOST_PATTERNS = (
    re.compile(r"Connection closed by peer"),
    re.compile(r"Connection reset by peer"),
    re.compile(r"Broken pipe"),
    re.compile(r"failed to recv, got 0 bytes"),
)
#: A timed-out recv also closes every other pair of the context, and an operation on
#: one of those raises "Application timeout caused pair closure" (gloo's
#: transport/tcp/unbound_buffer.cc, ``context_->signalException``): seen here on a
#: survivor in DDP's backward, a peer SIGKILLed on a loaded machine.
PEER_TIMEOUT_PATTERNS = (
    re.compile(r"Timed out waiting \d+ms for (recv|send) operation"),
    re.compile(r"Application timeout caused pair closure"),
)

#: How deep the causes of one exception are walked (a cycle ends it sooner).
_MAX_DEPTH = 8


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, its ``__cause__``/``__context__`` chain, and the per-rank errors a
    DCP ``CheckpointException`` carries, each once."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < _MAX_DEPTH:
        e = todo.pop(0)
        if any(e is s for s in seen):
            continue
        seen.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return seen


def detect_group_loss(exc: BaseException) -> tuple[RegroupReason, str] | None:
    """(why, the error's text) when ``exc`` says a peer of the process group is gone;
    None for anything else, which must propagate."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return None  # RunExit is a SystemExit: an agreed exit, never a loss
    for e in _causes(exc):
        if not isinstance(e, RuntimeError):  # gloo's, and torch's DistError family
            continue
        text = str(e)
        if any(p.search(text) for p in PEER_LOST_PATTERNS):
            return RegroupReason.PEER_LOST, text
        if any(p.search(text) for p in PEER_TIMEOUT_PATTERNS):
            return RegroupReason.PEER_TIMEOUT, text
    return None


#: Characters of a collective's error kept for the ``regroup`` datagram and the log.
MAX_ERROR_CHARS = 1000


@dataclass(frozen=True)
class GroupEnd:
    """Why a group ended with the process alive. Text only, never the exception: its
    traceback holds the frames of the failed step, and with them the old DDP wrapper,
    whose autograd hooks would fire into the destroyed group."""

    reason: RegroupReason
    error: str | None = None
    saved_step: int | None = None
    """A planned leave: the step every rank saved at the boundary before leaving."""


class LeaveForMembership(BaseException):
    """``Run.steps()`` raises it at the step boundary where every rank read a newer
    membership generation, after the save; ``Group.__exit__`` takes it. A
    BaseException, like ``RunExit``: a script's ``except Exception`` around its step
    must not swallow the leave."""

    def __init__(self, generation: int, saved_step: int | None) -> None:
        super().__init__(f"generation {generation} named; saved step {saved_step}")
        self.generation = generation
        self.saved_step = saved_step


class Group:
    """One process group of ``Run.groups()``: enter it around everything that uses the
    group (the DDP wrapper's construction, ``restore()``, the steps).

    With warm regroup off (every non-elastic run) it takes nothing: exceptions leave
    the ``with`` as without it. With it on, a lost peer's collective error
    (``detect_group_loss``) and the planned ``LeaveForMembership`` end the group:
    ``__exit__`` keeps why in ``end`` and suppresses them, and ``groups()`` re-forms.
    Anything else (a user's bug, an OOM, ``RunExit``) still propagates."""

    def __init__(self, generation: int, rank: int, world_size: int, *, warm: bool) -> None:
        self.generation = generation
        """The membership generation this group was formed on (0: the first launch's)."""
        self.rank = rank
        self.world_size = world_size
        self.warm = warm
        self.active = False
        """Inside ``with group``: only then may a step boundary leave for a membership."""
        self.end: GroupEnd | None = None
        """Set when the group ended with the process alive; None when it finished."""

    def __enter__(self) -> Group:
        self.active = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.active = False
        if exc is None:
            return False
        if isinstance(exc, LeaveForMembership):
            self.end = GroupEnd(RegroupReason.MEMBERSHIP, None, exc.saved_step)
            return True
        if not self.warm:
            return False
        loss = detect_group_loss(exc)
        if loss is None:
            return False
        reason, text = loss
        self.end = GroupEnd(reason, text[:MAX_ERROR_CHARS])
        return True

    def __repr__(self) -> str:
        return f"Group(generation={self.generation}, rank={self.rank}/{self.world_size})"


class RegroupTimeline:
    """Wall-clock marks of one warm regroup, from the group's end to the first step
    the new group completes; one line on stderr says where the seconds went.

    Wall clock (``time.time()``), not monotonic: the line is read beside other
    processes' clocks (the agent's log, a benchmark's kill) on the same host, and
    monotonic clocks of processes in other network namespaces agree only by luck of
    the kernel; ``clock`` is injectable for tests."""

    #: The marks, in the order a regroup passes them.
    PHASES = ("ended", "membership", "formed", "restoring", "agreed", "loaded", "resumed")

    def __init__(self, generation_left: int, clock: Callable[[], float] = time.time) -> None:
        self.generation_left = generation_left
        self._clock = clock
        self.marks: dict[str, float] = {"ended": clock()}
        self.resume_step: int | None = None
        """The step the new group resumed at (set with the ``resumed`` mark)."""

    def mark(self, phase: str) -> None:
        if phase not in self.PHASES:
            raise ValueError(f"unknown regroup phase {phase!r}")
        self.marks[phase] = self._clock()

    def first_step_line(self, rank: int, generation: int, step: int) -> str:
        """The line for the first step the new group completed (``step`` steps done),
        its completion time in unix seconds and each phase's offset from the end."""
        done = self._clock()
        t0 = self.marks["ended"]
        phases = ", ".join(
            f"{p} +{self.marks[p] - t0:.3f}" for p in self.PHASES[1:] if p in self.marks
        )
        return (
            f"rank {rank}: regroup {self.generation_left} -> {generation}: first step "
            f"{step} (resumed at {self.resume_step}) done at {done:.3f} unix s; group ended at "
            f"{t0:.3f}; {phases}, first step +{done - t0:.3f} s"
        )


#: What ``RegroupTimeline.first_step_line`` prints, for readers of rank logs (the
#: benchmark): (rank, generation, steps done, resume step, done at, ended at).
FIRST_STEP_LINE = re.compile(
    r"rank (\d+): regroup \d+ -> (\d+): first step (\d+) \(resumed at (\d+)\) done at "
    r"([\d.]+) unix s; group ended at ([\d.]+)"
)


class MembershipTimeout(Exception):
    """No membership newer than the one left came within the timeout."""


class StoppedWhileWaiting(Exception):
    """SIGTERM/SIGUSR1 arrived while the rank waited for a membership."""


def await_membership(
    read: Callable[[], Membership | None],
    newer_than: int,
    timeout_s: float,
    *,
    stopped: Callable[[], bool] = lambda: False,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Membership:
    """The first membership ``read()`` returns whose generation is above ``newer_than``.
    ``read`` re-reads the control file (one stat when it did not change, so a short
    ``poll_s`` costs nothing and the group re-forms as soon as the agent writes).
    Raises ``MembershipTimeout`` after ``timeout_s``, ``StoppedWhileWaiting`` when
    ``stopped()`` (checked before each sleep, so a stop is never slept through)."""
    deadline = clock() + timeout_s
    while True:
        m = read()
        if m is not None and m.generation > newer_than:
            return m
        if stopped():
            raise StoppedWhileWaiting(f"stop requested while waiting for generation > {newer_than}")
        if clock() >= deadline:
            raise MembershipTimeout(
                f"no membership newer than generation {newer_than} within {timeout_s:g} s"
            )
        sleep(poll_s)


def _tcp_connect(host: str, port: int, timeout_s: float) -> None:
    socket.create_connection((host, port), timeout=timeout_s).close()


def await_store(
    host: str,
    port: int,
    timeout_s: float,
    *,
    poll_s: float = 0.01,
    connect: Callable[[str, int, float], None] = _tcp_connect,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Wait until ``host:port`` accepts a TCP connection (the new group's rank 0 hosts
    its store there); False when it did not within ``timeout_s``.

    Why not let ``init_process_group`` connect: torch's store client, refused because
    rank 0 is a few ms behind in reading the same membership, retries after about
    0.3 s and then 0.7 s (measured here, torch 2.13), so a regroup whose ranks read
    the membership 20-100 ms apart lost most of a second in that backoff. A refused
    probe costs nothing and is retried every ``poll_s``; the store's server takes a
    connection closed unused as a client that left. A False changes nothing: the
    caller forms the group as before, and torch's own timeout still applies."""
    deadline = clock() + timeout_s
    while True:
        left = deadline - clock()
        try:
            connect(host, port, max(min(left, 1.0), poll_s))
            return True
        except OSError:
            pass
        if clock() >= deadline:
            return False
        sleep(poll_s)


# --- torch helpers (Run calls them; torch is imported where used) -------------------


def process_group_timeout(default_s: int) -> Any:
    """The default group's collective timeout (a ``timedelta``), so a re-formed group
    keeps the one the script chose. torch keeps it only on the backend's options
    (``_timeout``, private, read the way ``_set_pg_timeout`` writes it); when that
    cannot be read, ``default_s`` (the service's ``COLLECTIVE_TIMEOUT_S``)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    pg = dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return timedelta(seconds=default_s)


def sharded_on_group(model: Any) -> bool:
    """The model's parameters are sharded over the process group (FSDP2's DTensors,
    FSDP1's flat parameters): a lost rank's shards are gone and the survivors' cannot
    be re-sharded onto a new mesh in place, so such a model is never regrouped warm."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - every torch Run supports has it
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def drop_ddp_hooks(model: Any) -> None:
    """Unhook a DDP wrapper of the group being destroyed from the parameters. Its
    reducer's autograd hooks live as long as the wrapper does, and a reference the
    script still holds (a local, a closure, a traceback) would make the next
    backward all-reduce into the destroyed group."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model._remove_autograd_hooks()  # type: ignore[no-untyped-call]


def stale_ddp(model: Any) -> bool:
    """``model`` is a DDP wrapper of a process group that is no longer the default."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel) and (
        model.process_group is not dist.group.WORLD
    )
