"""The example Prometheus rules name only metrics the service exports."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "skyresume-alerts.yml"


def test_every_rule_expression_names_a_metric_the_service_exports(tmp_path):
    from fastapi.testclient import TestClient

    from orchestrator.app import create_app
    from orchestrator.settings import Settings
    from orchestrator.store import db

    url = f"sqlite:///{tmp_path / 'rules.db'}"
    db.upgrade(url)
    app = create_app(Settings(home=tmp_path / "home", database_url=url))
    with TestClient(app) as c:
        exposition = c.get("/metrics").text
    app.state.engine.dispose()
    exported = set(re.findall(r"^([a-z_]+)(?:\{|\s)", exposition, re.M))
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {
        "SkyresumeIncidentOpened",
        "SkyresumeIncidentClosed",
        "SkyresumeJobFailed",
        "SkyresumeJobSucceeded",
    }
    for r in rules:
        names = set(re.findall(r"\b(skyresume_[a-z_]+)", r["expr"]))
        assert names and names <= exported, (r["alert"], names - exported)
    for kind in ("incident_opened", "incident_closed", "job_failed", "job_succeeded"):
        assert f'skyresume_alert_events_total{{kind="{kind}"}} 0.0' in exposition
