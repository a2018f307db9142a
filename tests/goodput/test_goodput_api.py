"""GET /v1/jobs/{id}/goodput through the real app on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from goodput_history import two_incident_job


def _seed(app):
    with app.state.sessionmaker() as s:
        h = two_incident_job(s)
        s.commit()
        return h.id


def test_goodput_reports_the_split_and_each_incidents_breakdown(client, app):
    job_id = _seed(app)
    r = client.get(f"/v1/jobs/{job_id}/goodput")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["job_id"] == job_id and doc["status"] == "SUCCEEDED" and not doc["live"]
    assert doc["effective_training_fraction"] == pytest.approx(16_771.3 / 18_000, abs=1e-5)
    assert doc["idle_seconds"] == pytest.approx(300)
    assert doc["started_at"].endswith(("Z", "+00:00"))
    notice, lost = doc["incidents"]
    assert notice["failure_class"] == "preemption_notice"
    assert list(notice["step_seconds"]) == [
        "detect",
        "signal",
        "confirm_checkpoint",
        "select_replacement",
        "launch",
        "stage",
        "validate",
    ]
    assert notice["step_seconds"]["launch"] == pytest.approx(310)
    assert lost["steps_lost"] == 63 and lost["usd"] == 2.30
    assert [s["outcome"] for s in lost["steps"]][1] == "skipped"
    assert [a["cloud"] for a in doc["attempts"]] == ["aws", "gcp", "gcp"]


def test_goodput_of_an_unknown_job_is_404(client):
    r = client.get("/v1/jobs/j-missing/goodput")
    assert r.status_code == 404 and "j-missing" in r.json()["detail"]


def test_goodput_needs_the_operator_token(client, app):
    job_id = _seed(app)
    r = client.get(f"/v1/jobs/{job_id}/goodput", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    del client.headers["Authorization"]
    assert client.get(f"/v1/jobs/{job_id}/goodput").status_code == 401
