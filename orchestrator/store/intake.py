"""The fleet's heartbeat intake, sampled once per reconciler tick (``domain.silence``).

A sample counts the fleet's live nodes (registered, not exited, of attempts that are
launching or running), how many of them were heard within the hearing window, and
how many were heard since the previous sample (``fresh``: the beats taken in):
SQL's ``last_heartbeat_at``, or this replica's memory where it is newer (a beat
waiting in the batch is heard). It is read from SQL, not from one replica's memory,
so another replica's beats count within its flush interval.

:class:`IntakeLog` keeps the samples of the last ``keep_s`` in the reconciler's
memory, like ``heard_since``: a restarted service starts a new log, and its start is
``heard_since`` already.

Does I/O: :func:`fleet_intake` and :func:`noted_degraded` read SQL.
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import UTC, datetime, timedelta

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from orchestrator.contract import AttemptState, EventKind, NodeState
from orchestrator.domain import silence as sl
from orchestrator.store import liveness
from orchestrator.store.models import Attempt, FailureEvent, Node


def _utc(dt: datetime | None) -> datetime | None:
    if dt is None:
        return None
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)


def fleet_intake(
    s: Session,
    now: datetime,
    window_s: float,
    seen: dict[tuple[str, str, int], datetime] | None = None,
) -> sl.IntakeSample:
    """How many of the fleet's live nodes were heard in the ``window_s`` before ``now``.

    ``seen``: each live node's newest beat as the previous sample read it; given, the
    sample's ``fresh`` counts the nodes whose newest beat is newer now (the beats taken
    in since), and ``seen`` is updated to this sample's (the nodes gone dropped)."""
    rows = s.execute(
        select(Node.job_id, Node.node_id, Node.attempt, Node.last_heartbeat_at, Node.registered_at)
        .join(Attempt, and_(Attempt.job_id == Node.job_id, Attempt.number == Node.attempt))
        .where(
            Attempt.state.in_([AttemptState.LAUNCHING, AttemptState.RUNNING]),
            Node.state != NodeState.EXITED,
        )
    ).all()
    live = liveness.live_of(s)
    since = now - timedelta(seconds=window_s)
    heard = fresh = 0
    newest: dict[tuple[str, str, int], datetime] = {}
    for job_id, node_id, attempt, sql_at, registered_at in rows:
        last = _utc(sql_at) or _utc(registered_at)
        beat = live.latest(str(job_id), str(node_id)) if live is not None else None
        if beat is not None and beat.attempt == attempt and (last is None or beat.at > last):
            last = beat.at
        if last is None:
            continue
        if last >= since:
            heard += 1
        key = (str(job_id), str(node_id), int(attempt))
        newest[key] = last
        if seen is not None and key in seen and last > seen[key]:
            fresh += 1
    if seen is not None:
        seen.clear()
        seen.update(newest)
    return sl.IntakeSample(now, heard, len(rows), fresh)


def noted_degraded(s: Session, job_id: str, since: datetime) -> bool:
    """A ``control_plane_degraded`` event of the job was recorded at or after ``since``
    (the newest attempt's start: one note per attempt)."""
    return (
        s.scalars(
            select(FailureEvent.id)
            .where(
                FailureEvent.job_id == job_id,
                FailureEvent.kind == EventKind.CONTROL_PLANE_DEGRADED,
                FailureEvent.occurred_at >= since,
            )
            .limit(1)
        ).first()
        is not None
    )


class IntakeLog:
    """The reconciler's recent intake samples, oldest first (thread-safe)."""

    def __init__(self, keep_s: float = 900.0) -> None:
        self.keep_s = keep_s
        self._samples: deque[sl.IntakeSample] = deque()
        self._seen: dict[tuple[str, str, int], datetime] = {}
        """Each live node's newest beat at the last sample (for ``fresh``)."""
        self._lock = threading.Lock()

    def sample(self, s: Session, now: datetime, *, timeout_s: float = 30.0) -> sl.IntakeSample:
        """Take one sample; the hearing window follows the interval agents are told."""
        last = self.latest
        interval = sl.heartbeat_interval_s(last.expected if last else 0, timeout_s=timeout_s)
        smp = fleet_intake(s, now, sl.hearing_window_s(interval), self._seen)
        self.add(smp)
        return smp

    def add(self, smp: sl.IntakeSample) -> None:
        with self._lock:
            self._samples.append(smp)
            edge = smp.at - timedelta(seconds=self.keep_s)
            while self._samples and self._samples[0].at < edge:
                self._samples.popleft()

    @property
    def latest(self) -> sl.IntakeSample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def samples(self) -> tuple[sl.IntakeSample, ...]:
        with self._lock:
            return tuple(self._samples)

    def degraded(self, now: datetime, cfg: sl.SilenceConfig = sl.SilenceConfig()) -> bool:
        """The newest sample was deaf, or none was taken lately (``/metrics``)."""
        blind = sl.deafness(self.samples()[-2:], now, cfg)
        return blind.degraded
