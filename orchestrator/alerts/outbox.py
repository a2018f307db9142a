"""The alert outbox: one row per (event, webhook), written before anything is sent.

* **Queue once.** ``enqueue`` inserts (event key, target) rows; the unique constraint
  turns a second insert (a restarted service, another replica) into nothing.
* **Send at least once, receive once.** A row is delivered when the receiver answered
  2xx; it is claimed first (``next_try_at`` moved forward, compared on write), so two
  replicas never post it at the same moment. A crash between the POST and the
  ``delivered_at`` write can repeat one POST: every request carries the event id
  (``X-Skyresume-Event``), which a receiver uses to drop the repeat.
* **Backoff** takes its delays as an argument (tests fake the clock); after the last
  delay it keeps retrying at that delay until ``max_tries``, then the row stays with
  its ``last_error`` for an operator to read.
* **Signed.** ``X-Skyresume-Signature: sha256=HMAC(secret, "<timestamp>.<body>")``
  with ``X-Skyresume-Timestamp``: a receiver checks both (and the age) to refuse a
  forgery or a replay.

Does I/O: SQL, and the POSTs in :func:`deliver_due`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrator.alerts.events import AlertEvent
from orchestrator.store.models import AlertOutbox, AlertWebhook

log = logging.getLogger(__name__)

#: Seconds between tries: the n-th retry waits BACKOFF_S[min(n, len-1)].
BACKOFF_S: tuple[float, ...] = (1, 2, 5, 15, 60, 300)
MAX_TRIES = 50
#: How long a claimed row is hidden from other senders while its POST runs.
CLAIM_S = 30.0
SIGNATURE_HEADER = "X-Skyresume-Signature"
TIMESTAMP_HEADER = "X-Skyresume-Timestamp"
EVENT_HEADER = "X-Skyresume-Event"


@dataclass(frozen=True)
class Target:
    key: str
    """``webhook:<id>`` or ``global:<hash>``: which receiver, stable across restarts."""
    url: str
    secret: str
    job_id: str | None
    """None: every job."""


def global_target(url: str, secret: str) -> Target:
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return Target(f"global:{digest}", url, secret, None)


def targets(s: Session, configured: Sequence[Target] = ()) -> list[Target]:
    """The configured global webhooks and those stored (global or per job)."""
    stored = [
        Target(f"webhook:{w.id}", w.url, w.secret, w.job_id)
        for w in s.scalars(select(AlertWebhook).order_by(AlertWebhook.id))
    ]
    return [*configured, *stored]


def sign(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def enqueue(
    s: Session,
    events: Iterable[AlertEvent],
    to: Sequence[Target],
    *,
    now: datetime,
    dashboard_url: str = "",
) -> int:
    """Queue every (event, target) not queued yet; returns how many rows were added."""
    added = 0
    for e in events:
        for t in to:
            if t.job_id is not None and t.job_id != e.job_id:
                continue
            row = AlertOutbox(
                event_key=e.key,
                kind=e.kind.value,
                job_id=e.job_id,
                target=t.key,
                url=t.url,
                body=e.body(dashboard_url),
                tries=0,
                next_try_at=now,
                created_at=now,
            )
            try:
                with s.begin_nested():
                    s.add(row)
                added += 1
            except IntegrityError:
                pass  # queued before (by us before a restart, or by another replica)
    s.commit()
    return added


Post = Callable[[str, bytes, dict[str, str]], int]
"""(url, body, headers) -> HTTP status; raises on a transport error."""


def httpx_post(timeout_s: float = 5.0) -> Post:
    def post(url: str, body: bytes, headers: dict[str, str]) -> int:
        import httpx

        return httpx.post(url, content=body, headers=headers, timeout=timeout_s).status_code

    return post


def _utc(d: datetime) -> datetime:
    return d if d.tzinfo else d.replace(tzinfo=UTC)


def deliver_due(
    s: Session,
    secrets: dict[str, str],
    post: Post,
    *,
    now: datetime,
    backoff: Sequence[float] = BACKOFF_S,
    max_tries: int = MAX_TRIES,
    limit: int = 100,
) -> tuple[int, int]:
    """POST every due row once; returns (delivered, failed). ``secrets`` maps a
    target key to its secret (a target removed since keeps failing, visibly)."""
    due = list(
        s.scalars(
            select(AlertOutbox)
            .where(
                AlertOutbox.delivered_at.is_(None),
                AlertOutbox.next_try_at <= now,
                AlertOutbox.tries < max_tries,
            )
            .order_by(AlertOutbox.id)
            .limit(limit)
        )
    )
    delivered = failed = 0
    for row in due:
        claimed = s.execute(
            update(AlertOutbox)
            .where(
                AlertOutbox.id == row.id,
                AlertOutbox.tries == row.tries,
                AlertOutbox.delivered_at.is_(None),
                AlertOutbox.next_try_at <= now,
            )
            .values(next_try_at=now + timedelta(seconds=CLAIM_S))
            .execution_options(synchronize_session=False)
        ).rowcount  # type: ignore[attr-defined]
        s.commit()
        if claimed != 1:
            continue  # another sender has it
        s.refresh(row)
        secret = secrets.get(row.target)
        error: str | None = None
        if secret is None:
            error = f"target {row.target} is no longer configured"
        else:
            body = json.dumps(row.body, separators=(",", ":"), sort_keys=True).encode()
            ts = str(int(now.timestamp()))
            headers = {
                "Content-Type": "application/json",
                TIMESTAMP_HEADER: ts,
                SIGNATURE_HEADER: sign(secret, ts, body),
                EVENT_HEADER: row.event_key,
            }
            try:
                code = post(row.url, body, headers)
                if not 200 <= code < 300:
                    error = f"HTTP {code}"
            except Exception as e:  # a receiver down is a retry, never a crash of the loop
                error = f"{type(e).__name__}: {e}"[:500]
        row.tries += 1
        if error is None:
            row.delivered_at = now
            row.last_error = None
            delivered += 1
        else:
            delay = backoff[min(row.tries - 1, len(backoff) - 1)]
            row.next_try_at = now + timedelta(seconds=delay)
            row.last_error = error
            failed += 1
            log.warning("alert %s to %s: %s (try %d)", row.event_key, row.target, error, row.tries)
        s.commit()
    return delivered, failed
