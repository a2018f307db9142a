"""Node liveness and progress in the service's memory, written to SQL in batches.

A heartbeat is one per node per second: 2,048 nodes are 2,048 requests a second.
One SQL transaction each cost 5-12 ms of CPU and, past ~200/s, the backlog grew
until clients timed out and nodes looked lost (BENCHMARKS.md, "Heartbeats at
scale"). So a heartbeat touches no database on its hot path:

- **Validation** (job known, attempt current, node registered for it) reads an
  in-memory cache of each job's newest attempt and its nodes' attempts. A miss
  (first beat after a restart, a node another replica registered) loads the whole
  job at once, one loader per job, in a worker thread. Register fills the cache;
  every flush re-reads the currency of the cached jobs; a commit through this
  app's sessions that touches a ``jobs`` or ``attempts`` row drops that job's
  entry at once (so a cancel or a new attempt made by *this* replica is seen by the
  next beat). A change made by another replica is seen within one flush interval.
  Only "current" can go stale: an attempt that is not current never becomes current
  again (a newer attempt, ``ended`` and a terminal job are all final).
  A job found over (or gone) at a flush is forgotten, nodes and beats with it, so
  memory does not grow with every job the service ever ran.
- **Progress** is kept per node as the newest accepted beat (:class:`Beat`). A
  flush writes every beat accepted since the last one in **one transaction** (one
  SELECT of the rows, one executemany UPDATE, one currency read), guarded by
  ``last_heartbeat_at`` so a replica's older beat never overwrites a newer row (an
  agent may reach any replica, or register again in between). A flush that fails
  keeps its batch for the next one; ``stop`` flushes.
- **Detection reads the live view**: :func:`live_of` finds this replica's memory
  from any session of its sessionmaker, and the snapshot takes the newer of memory
  and SQL (:func:`newer_beat`), so a beat sitting in a batch never makes a node look
  silent. Another replica's beats reach SQL within its flush interval.

Until :meth:`LiveHeartbeats.start` (``skyresume serve`` calls it) there is no
flusher, and each beat is written through at once by the handler (in a worker
thread), as before: an app embedded without a flusher must not hold beats that
nobody will ever write.

Does I/O: the loads and the flush (SQL). ``record`` and ``check`` do none.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.contract import AttemptState
from orchestrator.domain.status import JobStatus
from orchestrator.store import agents
from orchestrator.store.db import read_session
from orchestrator.store.models import Attempt, Job, Node
from orchestrator.store.repo import NotFound, utcnow

log = logging.getLogger(__name__)

#: How often the flusher writes the batch (and so how stale a replica's SQL row is).
FLUSH_INTERVAL_S = 1.0
#: A beat older than this is dropped from memory at a flush (SQL has it by then).
FORGET_AFTER_S = 600.0
#: A node whose newest beat here is this recent counts in ``fleet_nodes``.
FLEET_HORIZON_S = 60.0
#: Where a session of the app's sessionmaker finds this replica's memory.
SESSION_KEY = "skyresume.liveness"


@dataclass(frozen=True)
class Beat:
    """The newest heartbeat this replica accepted from one node."""

    job_id: str
    attempt: int
    node_id: str
    at: datetime
    state: str
    body: dict[str, Any]
    """The heartbeat body as JSON (``HeartbeatIn``): state, ranks, last_checkpoint."""
    acked: int | None
    """The newest command cursor the node acknowledged in this replica's beats (a beat
    that acked nothing new carries the one before it: the cursor never rewinds)."""


class Verdict(enum.Enum):
    OK = "ok"
    NOT_CURRENT = "not_current"  # 409: the agent stops
    NOT_REGISTERED = "not_registered"  # 404: the agent registers again
    MISS = "miss"  # the cache cannot tell: load the job


@dataclass(frozen=True)
class _Currency:
    newest: int | None
    """The job's highest attempt number (None: no attempt yet)."""
    current: bool
    """``newest`` is not ended and the job is not terminal."""


class LiveHeartbeats:
    """One replica's heartbeat memory: validation cache, pending batch, flusher."""

    def __init__(
        self, maker: sessionmaker[Session], *, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self._maker = maker
        self._clock = clock
        self._lock = threading.Lock()  # held for dict operations only, never for I/O
        self._flush_lock = threading.Lock()  # one flush at a time (thread or handler)
        self._load_locks: dict[str, threading.Lock] = {}
        self._jobs: dict[str, _Currency] = {}
        self._recheck: set[str] = set()
        """Jobs dropped by an invalidation: the next flush forgets them if they are over."""
        self._nodes: dict[tuple[str, str], int] = {}
        """(job_id, node_id) -> the attempt its row is registered for."""
        self._pending: dict[tuple[str, str], Beat] = {}
        self._latest: dict[tuple[str, str], Beat] = {}
        self._batched = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flushes = 0
        """Successful flushes (tests and the bench read it)."""
        self._flushed_at = time.monotonic()
        self.failed_flushes = 0
        self.fleet_nodes = 0
        """Nodes registered for the current attempts this replica knows (at the last
        flush), or heard in the last ``FLEET_HORIZON_S`` if more: the fleet size the
        heartbeat interval grows with (``api/backpressure.py``). Registered ones count
        from their register on, so a fleet's first beats are already told its period."""
        maker.configure(info={**maker.kw.get("info", {}), SESSION_KEY: self})
        event.listen(maker, "after_flush", _note_touched_jobs)
        event.listen(maker, "after_commit", self._after_commit)
        event.listen(maker, "after_soft_rollback", _forget_touched_jobs)

    # --- validation (no I/O) --------------------------------------------------------

    def check(self, job_id: str, attempt: int, node_id: str) -> Verdict:
        """What the cache says about a beat from ``node_id`` of ``attempt``."""
        cur = self._jobs.get(job_id)
        if cur is None or cur.newest is None or attempt > cur.newest:
            return Verdict.MISS  # a newer attempt than we know of may exist by now
        if attempt < cur.newest or not cur.current:
            return Verdict.NOT_CURRENT
        if self._nodes.get((job_id, node_id)) != attempt:
            return Verdict.MISS  # never seen, or registered again (here or elsewhere)
        return Verdict.OK

    def load(self, job_id: str, attempt: int, node_id: str) -> Verdict:
        """Fill the cache from SQL for ``job_id`` and answer (in a worker thread).

        One loader per job: 2,048 nodes missing at once after a restart cost one read
        of the job and its nodes, not 2,048. Raises NotFound for an unknown job."""
        with self._lock:
            job_lock = self._load_locks.setdefault(job_id, threading.Lock())
        with job_lock:
            verdict = self.check(job_id, attempt, node_id)
            if verdict is not Verdict.MISS:
                return verdict
            with read_session(self._maker) as s:
                cur = _currency(s, [job_id]).get(job_id)
                if cur is None:
                    self._drop_job(job_id)
                    raise NotFound(f"job {job_id} not found")
                nodes = s.execute(
                    select(Node.node_id, Node.attempt).where(Node.job_id == job_id)
                ).all()
            with self._lock:
                self._jobs[job_id] = cur
                for nid, att in nodes:
                    self._nodes[(job_id, str(nid))] = int(att)
            verdict = self.check(job_id, attempt, node_id)
            if verdict is Verdict.MISS:  # loaded, and still unknown: what SQL says
                if cur.newest is None or attempt > cur.newest:
                    return Verdict.NOT_CURRENT  # no such attempt
                return Verdict.NOT_REGISTERED
            return verdict

    def registered(self, job_id: str, attempt: int, node_id: str) -> None:
        """A register for the current ``attempt`` committed (here)."""
        with self._lock:
            self._nodes[(job_id, node_id)] = attempt
            cur = self._jobs.get(job_id)
            if cur is None or cur.newest is None or attempt >= cur.newest:
                self._jobs[job_id] = _Currency(attempt, True)

    def invalidate(self, job_ids: Iterable[str]) -> None:
        """Forget what the cache believes about these jobs' currency (reload on use)."""
        with self._lock:
            for j in job_ids:
                self._jobs.pop(j, None)
                self._recheck.add(j)

    # --- beats (no I/O) -------------------------------------------------------------

    def record(self, job_id: str, attempt: int, node_id: str, body: dict[str, Any]) -> Beat:
        """Keep a validated beat; it reaches SQL with the next flush."""
        key = (job_id, node_id)
        acked = body.get("acked_command")
        with self._lock:
            if acked is None:
                prev = self._latest.get(key)
                if prev is not None and prev.attempt == attempt:
                    acked = prev.acked
            beat = Beat(job_id, attempt, node_id, self._clock(), str(body["state"]), body, acked)
            self._pending[key] = beat
            self._latest[key] = beat
        return beat

    def take(self, job_id: str, node_id: str) -> Beat | None:
        """Remove the node's pending beat (register writes it first, in its own
        transaction, so the cursor it hands back counts the newest ack)."""
        with self._lock:
            return self._pending.pop((job_id, node_id), None)

    def restore(self, beats: Iterable[Beat]) -> None:
        """Put beats back whose write failed, unless a newer one arrived meanwhile (its
        cursor then falls back to the older beat's when it acked nothing)."""
        with self._lock:
            for b in beats:
                key = (b.job_id, b.node_id)
                newer = self._pending.get(key)
                if newer is None:
                    self._pending[key] = b
                elif newer.acked is None and b.acked is not None and newer.attempt == b.attempt:
                    self._pending[key] = dataclasses.replace(newer, acked=b.acked)

    def latest(self, job_id: str, node_id: str) -> Beat | None:
        """The newest beat this replica accepted from the node (flushed or not)."""
        return self._latest.get((job_id, node_id))

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def unflushed_s(self) -> float:
        """Seconds since the last successful flush while beats wait for one (0 when
        none waits): how far SQL, which other replicas' reconcilers read, is behind
        this replica's memory (``api/backpressure.py``: the service is behind)."""
        if not self._pending:
            return 0.0
        return time.monotonic() - self._flushed_at

    # --- flushing -------------------------------------------------------------------

    @property
    def batched(self) -> bool:
        """True once something flushes on its own (``start``, or a test's ``hold``)."""
        return self._batched

    def hold(self) -> None:
        """Batch beats without a flusher thread: the caller flushes (tests)."""
        self._batched = True

    def start(self, interval_s: float = FLUSH_INTERVAL_S) -> None:
        """Batch beats and flush every ``interval_s`` from a thread of our own (no
        event-loop or worker thread is ever blocked by a slow database)."""
        if self._thread is not None:
            return
        self._batched = True
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), name="heartbeat-flush", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the flusher and write what is left (shutdown must not lose beats)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
        self.flush()
        self._batched = False

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.flush()

    def flush(self) -> bool:
        """Write every pending beat and refresh the cached currency, in one
        transaction. False (the batch kept for the next flush) when it failed."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
                jobs = sorted(set(self._jobs) | self._recheck)
                self._recheck = set()
            if not batch and not jobs:
                return True
            try:
                with self._maker.begin() as s:
                    agents.store_heartbeats(s, batch.values())
                    fresh = _currency(s, jobs)
            except Exception:  # the database blinked: the next flush tries again
                log.exception("heartbeat flush of %d node(s) failed; kept", len(batch))
                self.restore(batch.values())
                with self._lock:
                    self._recheck.update(jobs)
                self.failed_flushes += 1
                return False
            self.flushes += 1
            self._flushed_at = time.monotonic()
            self._refresh(jobs, fresh)
            return True

    def _refresh(self, asked: list[str], fresh: dict[str, _Currency]) -> None:
        horizon = self._clock().timestamp() - FORGET_AFTER_S
        with self._lock:
            for j in asked:
                cur = fresh.get(j)
                if cur is None or not cur.current:
                    # Gone or over: forget it all, so memory and this read do not grow
                    # with every job the service ever ran. A late beat of such a job
                    # loads it again once (409) and is forgotten at the next flush.
                    self._drop_job_locked(j)
                elif j in self._jobs:  # an invalidation since the read wins: reload
                    self._jobs[j] = cur
            for key, b in list(self._latest.items()):
                if b.at.timestamp() < horizon and key not in self._pending:
                    del self._latest[key]
            recent = self._clock().timestamp() - FLEET_HORIZON_S
            heard = sum(1 for b in self._latest.values() if b.at.timestamp() >= recent)
            current = sum(
                1
                for (job, _), att in self._nodes.items()
                if (cur := self._jobs.get(job)) is not None and cur.current and att == cur.newest
            )
            self.fleet_nodes = max(heard, current)

    def _drop_job(self, job_id: str) -> None:
        with self._lock:
            self._drop_job_locked(job_id)

    def _drop_job_locked(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._load_locks.pop(job_id, None)
        for d in (self._nodes, self._latest):
            for key in [k for k in d if k[0] == job_id]:
                del d[key]

    def _after_commit(self, session: Session) -> None:
        touched = session.info.pop(_TOUCHED, None)
        if touched:
            self.invalidate(touched)


_TOUCHED = "skyresume.liveness.touched_jobs"


def _note_touched_jobs(session: Session, _flush_context: Any) -> None:
    """Remember the jobs whose ``jobs``/``attempts`` rows this flush wrote."""
    for obj in (*session.new, *session.dirty, *session.deleted):
        if isinstance(obj, Job):
            session.info.setdefault(_TOUCHED, set()).add(str(obj.id))
        elif isinstance(obj, Attempt):
            session.info.setdefault(_TOUCHED, set()).add(str(obj.job_id))


def _forget_touched_jobs(session: Session, _previous: Any) -> None:
    if not session.in_transaction():
        session.info.pop(_TOUCHED, None)


def _currency(s: Session, job_ids: list[str]) -> dict[str, _Currency]:
    """Each known job's newest attempt and whether it is current (absent: no job)."""
    if not job_ids:
        return {}
    out: dict[str, _Currency] = {}
    for jid, status in s.execute(select(Job.id, Job.status).where(Job.id.in_(job_ids))):
        out[str(jid)] = _Currency(None, not JobStatus(status).is_terminal())
    rows = s.execute(
        select(Attempt.job_id, Attempt.number, Attempt.state).where(Attempt.job_id.in_(job_ids))
    )
    newest: dict[str, tuple[int, str]] = {}
    for jid, number, state in rows:
        if str(jid) not in newest or number > newest[str(jid)][0]:
            newest[str(jid)] = (int(number), str(state))
    for jid, cur in list(out.items()):
        n = newest.get(jid)
        if n is None:
            out[jid] = _Currency(None, False)
        else:
            out[jid] = _Currency(n[0], cur.current and n[1] != AttemptState.ENDED)
    return out


def live_of(session: Session) -> LiveHeartbeats | None:
    """This replica's memory, from any session of its app's sessionmaker (None: a
    session made elsewhere, which reads SQL alone)."""
    live = session.info.get(SESSION_KEY)
    return live if isinstance(live, LiveHeartbeats) else None


def newer_beat(
    live: LiveHeartbeats | None,
    job_id: str,
    node_id: str,
    attempt: int,
    sql_heartbeat_at: datetime | None,
) -> Beat | None:
    """This replica's newest beat of the node where it is newer than the SQL row
    (``sql_heartbeat_at``, UTC-aware) and of the row's attempt; None: SQL is as new."""
    beat = live.latest(job_id, node_id) if live is not None else None
    if beat is None or beat.attempt != attempt:
        return None
    if sql_heartbeat_at is not None and beat.at <= sql_heartbeat_at:
        return None
    return beat


def seen_state(row_state: str, beat: Beat | None) -> str:
    """The node's state as detection reads it: the row's, or its newer beat's."""
    return row_state if beat is None else agents.merged_state(row_state, beat.state)


def seen_progress(stored: dict[str, Any], beat: Beat | None) -> dict[str, Any]:
    """The node's progress as detection reads it: the row's (decoded), or merged with
    its newer beat (:func:`newer_beat`) as the next flush will write it."""
    return stored if beat is None else agents.merge_progress(stored, beat.body, beat.acked)
