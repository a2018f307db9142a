"""Goodput accounts the incidents of the one read model (``store.incidents``), so the
incident list (API, CLI, dashboard) and the goodput report never disagree about which
incidents a job had, the attempt each one ended or the last step it trained."""

from __future__ import annotations

from goodput_history import LOST_STEPS, JobHistory, at, reread, two_incident_job

from orchestrator.domain.status import JobStatus
from orchestrator.store import incidents as incidents_module
from orchestrator.store.goodput import job_goodput
from orchestrator.store.incidents import (
    fleet_incident_records,
    fleet_incidents,
    incident_records,
    incidents,
)


def test_goodput_reports_the_incidents_the_incident_list_shows(session):
    h = two_incident_job(session)
    reread(session)
    listed = incidents(session, h.id)
    report = job_goodput(session, h.id)

    assert [i.id for i in report.incidents] == [d["id"] for d in listed]
    assert [(i.failed_attempt, i.last_step) for i in report.incidents] == [
        (d["attempt"], d["last_step"]) for d in listed
    ]
    assert [i.failed_attempt for i in report.incidents] == [1, 2]


def test_an_incident_that_does_not_name_its_attempt_is_blamed_alike_by_both(session):
    # No ``details.attempt``: the read model places it on the attempt started last
    # before it, whose last heartbeats (step 1234) outran the detection's 1000.
    h = JobHistory(session)
    h.status(JobStatus.PROVISIONING, 0)
    h.attempt(1, 60, 3000, last_step=1234)
    ev = h.incident(3000, "host_oom_killed", LOST_STEPS, last_step=1000)
    h.attempt(2, 3100, None, resume_step=1200, incident_id=ev.id)
    reread(session)

    (record,) = incident_records(session, h.id)
    assert record.failed is not None and record.failed.number == 1
    assert [a.number for a in record.recovering] == [2]
    (listed,) = incidents(session, h.id)
    (counted,) = job_goodput(session, h.id, now=at(4000)).incidents
    assert listed["last_step"] == counted.last_step == record.last_step == 1234
    assert counted.failed_attempt == 1


def test_the_read_model_names_each_incident_s_cause_and_steps_in_recorded_order(session):
    h = two_incident_job(session)
    reread(session)
    records = incident_records(session, h.id)

    assert [r.cause.kind if r.cause else None for r in records] == [
        "preemption_notice",
        "node_lost",
    ]
    for r in records:
        assert [s.id for s in r.steps] == sorted(s.id for s in r.steps)
        assert len(r.steps) == 7


def _said(r: incidents_module.IncidentRecord) -> tuple:  # type: ignore[type-arg]
    return (
        r.event.job_id,
        r.event.id,
        r.failed.number if r.failed else None,
        [a.number for a in r.recovering],
        r.last_step,
        r.cause.id if r.cause else None,
        [s.id for s in r.steps],
    )


def test_across_jobs_each_incident_is_read_as_its_own_jobs_read_model_reads_it(session):
    # Both jobs have an attempt 1 and 2, with different last steps: the fleet's read
    # must blame each job's own attempt and take its own nodes' heartbeats.
    a = two_incident_job(session, "gpt-a")
    b = JobHistory(session, "gpt-b", submitted=100)
    b.status(JobStatus.PROVISIONING, 100)
    b.attempt(1, 200, 3000, last_step=777)
    ev = b.incident(3000, "node_lost", LOST_STEPS, last_step=700, attempt=1)
    b.attempt(2, 3100, None, resume_step=700, incident_id=ev.id)
    reread(session)

    each = sorted(
        [*incident_records(session, a.id), *incident_records(session, b.id)],
        key=lambda r: r.event.id,
    )
    assert [_said(r) for r in fleet_incident_records(session)] == [_said(r) for r in each]
    assert [_said(r) for r in fleet_incident_records(session, job_ids=[b.id])] == [
        _said(r) for r in incident_records(session, b.id)
    ]
    assert [r.last_step for r in incident_records(session, b.id)] == [777]


def test_an_incident_without_protocol_steps_is_listed_but_counted_by_no_report(session):
    h = JobHistory(session)
    h.status(JobStatus.PROVISIONING, 0)
    h.attempt(1, 60, None, last_step=50)
    ev = h.incident(3000, "node_lost", (), last_step=50, attempt=1)
    reread(session)

    assert [d["id"] for d in incidents(session, h.id)] == [ev.id]
    (record,) = incident_records(session, h.id)
    assert not record.has_protocol_steps
    assert fleet_incidents(session) == []
    assert job_goodput(session, h.id, now=at(4000)).incidents == ()


def test_causes_are_all_found_when_their_ids_take_several_statements(session, monkeypatch):
    h = two_incident_job(session)
    reread(session)
    monkeypatch.setattr(incidents_module, "_IN_CHUNK", 1)  # one statement per cause

    assert [r.cause.kind if r.cause else None for r in incident_records(session, h.id)] == [
        "preemption_notice",
        "node_lost",
    ]
