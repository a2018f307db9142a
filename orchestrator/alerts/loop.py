"""The operator loop: one thread of the service that, every ``alerts_interval_s``,
samples progress into the run's time series, detects alert events and queues them
in the outbox, then sends what is due.

Detection looks back from the newest queued row (or, on an empty outbox, one hour),
with a margin, so events that happened while the service was down are queued when it
comes back, and the outbox's unique key keeps the overlap from queueing any twice.
Each part of a tick fails on its own: a receiver that is down delays alerts, never
the time series.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.alerts import outbox
from orchestrator.alerts.events import AlertKind, detect_events
from orchestrator.domain.protocol import ProtocolStep as Step
from orchestrator.store.models import AlertOutbox, ProtocolStep
from orchestrator.store.series import ProgressSampler

log = logging.getLogger(__name__)

#: With an empty outbox, how far back the first detection looks.
FIRST_LOOKBACK = timedelta(hours=1)
#: Overlap with the last detection: rows committed late by another writer.
MARGIN = timedelta(minutes=10)


class OperatorLoop:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        interval_s: float = 2.0,
        configured: Sequence[outbox.Target] = (),
        dashboard_url: str = "",
        post: outbox.Post | None = None,
        backoff: Sequence[float] = outbox.BACKOFF_S,
        sample_every_s: float = 5.0,
        first_lookback: timedelta = FIRST_LOOKBACK,
    ) -> None:
        self.sessions = sessions
        self.interval_s = interval_s
        self.configured = list(configured)
        self.dashboard_url = dashboard_url
        self.post = post or outbox.httpx_post()
        self.backoff = backoff
        self.first_lookback = first_lookback
        self.sampler = ProgressSampler(sample_every_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now: datetime | None = None) -> None:
        now = now or datetime.now(UTC)
        for part in (self._sample, self._queue, self._send):
            try:
                with self.sessions() as s:
                    part(s, now)
            except Exception:  # one part failing must not stop the others
                log.exception("operator loop: %s failed", part.__name__)

    def _sample(self, s: Session, now: datetime) -> None:
        self.sampler.sample(s, now=now)

    def _queue(self, s: Session, now: datetime) -> None:
        to = outbox.targets(s, self.configured)
        if not to:
            return
        newest = s.scalar(select(func.max(AlertOutbox.created_at)))
        since = (_utc(newest) - MARGIN) if newest else now - self.first_lookback
        outbox.enqueue(
            s, detect_events(s, since=since), to, now=now, dashboard_url=self.dashboard_url
        )

    def _send(self, s: Session, now: datetime) -> None:
        secrets = {t.key: t.secret for t in outbox.targets(s, self.configured)}
        outbox.deliver_due(s, secrets, self.post, now=now, backoff=self.backoff)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="skyresume-operator", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None


def _utc(d: datetime) -> datetime:
    return d if d.tzinfo else d.replace(tzinfo=UTC)


class AlertMetrics:
    """Prometheus families computed at scrape time from SQL (every replica agrees):
    ``skyresume_alert_events_total{kind}`` (events queued, counted once per event),
    ``skyresume_alert_outbox_pending`` and ``..._failing`` (rows with an error),
    ``skyresume_incidents_open`` (a protocol started, its validate step not ended)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def collect(self):  # type: ignore[no-untyped-def]
        try:
            with self.sessions() as s:
                by_kind = dict(
                    s.execute(
                        select(
                            AlertOutbox.kind, func.count(func.distinct(AlertOutbox.event_key))
                        ).group_by(AlertOutbox.kind)
                    ).all()
                )
                pending = (
                    s.scalar(select(func.count()).where(AlertOutbox.delivered_at.is_(None))) or 0
                )
                failing = (
                    s.scalar(
                        select(func.count()).where(
                            AlertOutbox.delivered_at.is_(None), AlertOutbox.last_error.is_not(None)
                        )
                    )
                    or 0
                )
                started = select(func.count(func.distinct(ProtocolStep.incident_id)))
                closed = started.where(
                    ProtocolStep.step == Step.VALIDATE.value, ProtocolStep.finished_at.is_not(None)
                )
                open_ = (s.scalar(started) or 0) - (s.scalar(closed) or 0)
        except Exception:  # a scrape must not fail because the DB blinked
            log.exception("metrics: could not read the alert outbox")
            return
        c = CounterMetricFamily(
            "skyresume_alert_events", "Alert events detected and queued", labels=["kind"]
        )
        for k in AlertKind:
            c.add_metric([k.value], by_kind.get(k.value, 0))
        yield c
        yield GaugeMetricFamily(
            "skyresume_alert_outbox_pending", "Alerts not delivered yet", value=pending
        )
        yield GaugeMetricFamily(
            "skyresume_alert_outbox_failing",
            "Undelivered alerts whose last try failed",
            value=failing,
        )
        yield GaugeMetricFamily(
            "skyresume_incidents_open",
            "Incidents whose restart protocol has not ended",
            value=max(open_, 0),
        )


def operator_loop(app: Any) -> OperatorLoop:
    """The loop for a service app, from its settings (not started)."""
    st = app.state.settings
    configured = (
        [outbox.global_target(st.alert_webhook_url, st.alert_webhook_secret)]
        if st.alert_webhook_url
        else []
    )
    return OperatorLoop(
        app.state.sessionmaker,
        interval_s=st.alerts_interval_s,
        configured=configured,
        dashboard_url=st.public_url or st.service_url,
    )
