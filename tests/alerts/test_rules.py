"""The example Prometheus rules name only metrics the service exports."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "skyresume-alerts.yml"


def test_every_rule_expression_names_a_metric_the_service_exports(client):
    exposition = client.get("/metrics").text
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
