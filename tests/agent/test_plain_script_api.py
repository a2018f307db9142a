"""The heartbeat fields a plain script's evidence travels in (issue 27), through the
real app on SQLite and PostgreSQL: each rank's ``cpu_idle_s`` and what the agent found
of ``checkpoint.own``, stored as the node's progress; bad values are a 422 naming them."""

from __future__ import annotations

import pytest
from conftest import add_attempt
from testkit import job_spec

from orchestrator import __version__
from orchestrator.contract import AGENT_PROTOCOL
from orchestrator.store import agents


@pytest.fixture
def node(client) -> str:
    job_id = client.post("/v1/jobs", json=job_spec()).json()["id"]
    add_attempt(client.app.state.sessionmaker, job_id, 1)
    url = f"/v1/jobs/{job_id}/attempts/1/nodes/n0"
    body = {"node_rank": 0, "hostname": "h", "agent_pid": 42, "provider": "aws", "ranks": []}
    who = {"agent_version": __version__, "agent_build": "source", "protocol": AGENT_PROTOCOL}
    assert client.post(url + "/register", json={**body, **who}).status_code == 200
    return url


def _rank(**kw):  # type: ignore[no-untyped-def]
    return {"rank": 0, "local_rank": 0, "pid": 1000, "alive": True, **kw}


def test_a_heartbeat_keeps_each_rank_s_cpu_idle_time_and_the_own_checkpoint_found(client, node):
    hb = {
        "state": "running",
        "ranks": [_rank(cpu_idle_s=0.8)],
        "own_checkpoint": {"path": "/shared/snapshot.pt", "found": True},
    }
    assert client.post(node + "/heartbeat", json=hb).status_code == 200
    job_id = node.split("/")[3]
    with client.app.state.sessionmaker() as s:
        (n,) = agents.list_nodes(s, job_id, 1)
        assert n.progress["ranks"][0]["cpu_idle_s"] == 0.8
        assert n.progress["own_checkpoint"] == {"path": "/shared/snapshot.pt", "found": True}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"ranks": [_rank(cpu_idle_s=-1)]}, "cpu_idle_s"),
        ({"own_checkpoint": {"path": "/s.pt"}}, "found"),
        ({"own_checkpoint": {"path": "/s.pt", "found": True, "bytes": 3}}, "bytes"),
    ],
    ids=["negative-idle", "own-without-found", "own-unknown-field"],
)
def test_a_bad_plain_script_field_is_a_422_naming_it(client, node, body, field):
    r = client.post(node + "/heartbeat", json={"state": "running", **body})
    assert r.status_code == 422 and field in r.text
