"""Alerts through the outbox to a real HTTP receiver, on SQLite and PostgreSQL:
each event reaches it once, signed, across a restart of the loop; a receiver that
fails is retried on the backoff's schedule; a job's webhook hears only its job.
The outbox's SQL (claim, unique key) runs on both backends in the first test; the
others run on SQLite alone, to keep the default run short."""

from __future__ import annotations

from datetime import timedelta

from goodput_history import LOST_STEPS, JobHistory, at, two_incident_job
from sqlalchemy import func, select
from webhook_receiver import SECRET

from orchestrator.alerts import outbox
from orchestrator.alerts.loop import AlertMetrics, OperatorLoop
from orchestrator.domain.status import JobStatus
from orchestrator.store.models import AlertOutbox, AlertWebhook

NOW = at(18_060)  # a minute after two_incident_job succeeded


def loop(sessions, receiver, **kw):  # type: ignore[no-untyped-def]
    return OperatorLoop(
        sessions,
        configured=[outbox.global_target(receiver.url, SECRET)],
        dashboard_url="https://sky.example",
        first_lookback=timedelta(days=1),
        **kw,
    )


def test_each_event_is_delivered_once_and_signed_across_a_restart(sessions, receiver):
    with sessions() as s:
        good = two_incident_job(s, "gpt-7b-spot")
        s.commit()
    first = loop(sessions, receiver)
    first.tick(NOW)
    first.tick(NOW + timedelta(seconds=2))  # nothing new: nothing sent again
    want = (
        {f"incident_opened:{i}" for i in _incidents(sessions, good.id)}
        | {f"incident_closed:{i}" for i in _incidents(sessions, good.id)}
        | {f"job_succeeded:{good.id}"}
    )
    assert sorted(receiver.delivered()) == sorted(want)

    # The service restarts (a new loop, nothing in memory); meanwhile a second job
    # failed. Only the new events go out, and each once.
    with sessions() as s:
        bad = JobHistory(s, "will-fail", submitted=18_000)
        bad.incident(18_100, "node_lost", LOST_STEPS, last_step=10, finished=2)
        bad.status(JobStatus.FAILED, 18_200, "restart limit reached")
        s.commit()
    second = loop(sessions, receiver)
    second.tick(at(18_300))
    second.tick(at(18_302))
    got = receiver.delivered()
    assert len(got) == len(set(got)), "an event was delivered twice"
    (opened,) = _incidents(sessions, bad.id)
    assert set(got) - want == {
        f"incident_opened:{opened}",
        f"incident_closed:{opened}",  # the job ended mid-protocol: closed with it
        f"job_failed:{bad.id}",
    }
    assert all(g["signed"] for g in receiver.got)
    failed = next(g["body"] for g in receiver.got if g["event"] == f"job_failed:{bad.id}")
    assert failed["text"].startswith("skyresume: job will-fail")  # Slack shows ``text``
    assert "restart limit reached" in failed["text"]
    assert f"https://sky.example/dashboard/jobs/{bad.id}" in failed["text"]


def test_a_failing_receiver_is_retried_on_the_backoff_schedule(sqlite_sessions, receiver):
    sessions = sqlite_sessions
    with sessions() as s:
        two_incident_job(s)
        s.commit()
    receiver.fail_with = 503
    lp = loop(sessions, receiver, backoff=(10, 60))
    lp.tick(NOW)
    tries = len(receiver.got)
    assert tries == 5 and receiver.delivered() == []
    lp.tick(NOW + timedelta(seconds=9))  # before the first delay: nothing is sent
    assert len(receiver.got) == tries
    receiver.fail_with = None
    lp.tick(NOW + timedelta(seconds=10))
    assert len(receiver.delivered()) == 5
    with sessions() as s:
        rows = list(s.scalars(select(AlertOutbox)))
        assert {r.tries for r in rows} == {2} and all(r.delivered_at for r in rows)


def test_a_jobs_own_webhook_hears_only_that_job(sqlite_sessions, receiver):
    sessions = sqlite_sessions
    with sessions() as s:
        mine = two_incident_job(s, "mine")
        other = two_incident_job(s, "other")
        s.add(AlertWebhook(job_id=mine.id, url=receiver.url, secret=SECRET, created_at=NOW))
        s.commit()
    OperatorLoop(sessions, first_lookback=timedelta(days=1)).tick(
        NOW
    )  # no global webhook configured
    bodies = [g["body"] for g in receiver.got]
    assert bodies and {b["job_id"] for b in bodies} == {mine.id}
    assert other.id not in {b["job_id"] for b in bodies}


def test_metrics_count_each_event_once_and_what_is_pending(sqlite_sessions, receiver):
    sessions = sqlite_sessions
    with sessions() as s:
        two_incident_job(s)
        s.commit()
    receiver.fail_with = 500
    loop(sessions, receiver).tick(NOW)
    families = {f.name: f for f in AlertMetrics(sessions).collect()}
    events = {s.labels["kind"]: s.value for s in families["skyresume_alert_events"].samples}
    assert events == {
        "incident_opened": 2,
        "incident_closed": 2,
        "job_failed": 0,
        "job_succeeded": 1,
    }
    assert families["skyresume_alert_outbox_pending"].samples[0].value == 5
    assert families["skyresume_alert_outbox_failing"].samples[0].value == 5


def _incidents(sessions, job_id: str) -> list[int]:  # type: ignore[no-untyped-def]
    from orchestrator.store.models import ProtocolStep

    with sessions() as s:
        return sorted(
            s.scalars(
                select(func.distinct(ProtocolStep.incident_id)).where(ProtocolStep.job_id == job_id)
            )
        )
