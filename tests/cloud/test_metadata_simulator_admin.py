"""The simulator's admin API over HTTP (what chaos commands and the launcher call),
and the metadata module's promise to stay light for the node agent."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from orchestrator.cloud import metadata as md
from orchestrator.cloud.simulator import MetadataSimulator


def admin(sim: MetadataSimulator, method: str, path: str, doc: object = None):  # type: ignore[no-untyped-def]
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(sim.url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_admin_schedules_and_clears_a_notice(sim: MetadataSimulator) -> None:
    notice = {"provider": "gcp", "kind": "preempt", "in_seconds": 30}
    status, doc = admin(sim, "POST", "/admin/nodes/a/notice", notice)
    assert status == 200 and doc["notice"]["provider"] == "gcp"
    assert md.poller_for("gcp", sim.node_url("a")).poll().state == "notice"
    status, doc = admin(sim, "DELETE", "/admin/nodes/a/notice")
    assert status == 200 and doc["notice"] is None
    assert md.poller_for("gcp", sim.node_url("a")).poll().state == "none"


def test_admin_faults_apply_then_clear(sim: MetadataSimulator) -> None:
    assert admin(sim, "POST", "/admin/nodes/a/faults", {"errors_5xx": 1})[0] == 200
    p = md.poller_for("azure", sim.node_url("a"))
    assert p.poll().state == "unknown"
    assert p.poll().state == "none"  # one 5xx, then healthy again
    admin(sim, "POST", "/admin/nodes/a/faults", {"garbage": True})
    assert p.poll().state == "unknown"
    admin(sim, "DELETE", "/admin/nodes/a/faults")
    assert p.poll().state == "none"


@pytest.mark.parametrize(
    ("path", "doc", "complaint"),
    [
        ("/admin/nodes/a/notice", {"provider": "oracle", "kind": "x"}, "provider"),
        ("/admin/nodes/a/notice", {"provider": "aws", "kind": "preempt"}, "kind for aws"),
        ("/admin/nodes/a/notice", {"provider": "aws", "kind": "stop", "in_seconds": -1}, "in_s"),
        ("/admin/nodes/a/faults", {"explode": True}, "unknown fault"),
        ("/admin/nodes/a/notice", [1, 2], "JSON object"),
    ],
    ids=["provider", "kind", "negative-time", "fault-name", "not-an-object"],
)
def test_admin_bad_input_is_a_400_naming_the_field(
    sim: MetadataSimulator, path: str, doc: object, complaint: str
) -> None:
    status, body = admin(sim, "POST", path, doc)
    assert status == 400
    assert complaint in body["error"]


def test_nodes_are_independent(sim: MetadataSimulator) -> None:
    sim.schedule_notice("a", "aws", "terminate", 60)
    sim.set_faults("b", errors_5xx=10)
    assert md.poller_for("aws", sim.node_url("a")).poll().state == "notice"
    assert md.poller_for("aws", sim.node_url("b")).poll().state == "unknown"
    assert md.poller_for("aws", sim.node_url("c")).poll().state == "none"


def test_metadata_module_imports_no_heavy_dependency() -> None:
    code = (
        "import sys, orchestrator.cloud.metadata\n"
        "heavy = {'boto3', 'botocore', 'google', 'torch', 'fastapi', 'sqlalchemy', 'httpx'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
