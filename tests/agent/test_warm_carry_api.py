"""A node held warm (elastic shrink, issue 20) through the real app on SQLite and
PostgreSQL: its agent is answered after its attempt ended, its ``regroup`` command
comes with the next attempt's token for that node alone, and its register there
moves the node and ends the hold."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from conftest import add_attempt, set_attempt_state
from test_agent_api import AGENT, base, enqueue, register
from testkit import FakeLauncher, job_spec

from orchestrator.api.auth import node_token
from orchestrator.contract import CommandType
from orchestrator.store import agents
from orchestrator.store.snapshot import _failures, gather_snapshot


@pytest.fixture
def job_id(client) -> str:
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201
    add_attempt(client.app.state.sessionmaker, r.json()["id"], 1)
    return str(r.json()["id"])


def hold(client, job: str, attempt: int, *nodes: str) -> None:
    with client.app.state.sessionmaker() as s, s.begin():
        agents.hold_nodes(s, job, attempt, nodes)


def test_a_held_node_of_an_ended_attempt_is_answered_not_superseded(client, job_id):
    job = job_id
    assert register(client, job, node="n0").status_code == 200
    assert register(client, job, node="n1").status_code == 200
    hold(client, job, 1, "n0")
    set_attempt_state(client.app.state.sessionmaker, job, 1, "ended")
    r = client.post(base(job, node="n0") + "/heartbeat", json={"state": "running"})
    assert r.status_code == 200 and r.json() == {"held": True}
    assert client.get(base(job, node="n0") + "/commands", params={"wait": 0}).status_code == 200
    # the node that was not held is told its attempt is over, as before
    beat = client.post(base(job, node="n1") + "/heartbeat", json={"state": "running"})
    assert beat.status_code == 409
    assert client.get(base(job, node="n1") + "/commands", params={"wait": 0}).status_code == 409


def test_a_held_node_of_a_job_that_ended_is_superseded(client, job_id):
    job = job_id
    assert register(client, job).status_code == 200
    hold(client, job, 1, "n0")
    client.post(f"/v1/jobs/{job}/cancel")
    assert client.post(base(job) + "/heartbeat", json={"state": "running"}).status_code == 409


def test_a_regroup_carries_the_next_attempts_token_for_its_own_node_only(client, job_id):
    job = job_id
    assert register(client, job, node="n0").status_code == 200
    hold(client, job, 1, "n0")
    set_attempt_state(client.app.state.sessionmaker, job, 1, "ended")
    add_attempt(client.app.state.sessionmaker, job, 2)
    enqueue(client, job, CommandType.REGROUP, {"attempt": 2, "membership": {}}, node_id="n0")
    (cmd,) = client.get(base(job, node="n0") + "/commands", params={"wait": 0}).json()["commands"]
    token = cmd["args"]["agent_token"]
    assert token == node_token(client.app.state.token, job, 2, "n0")
    with client.app.state.sessionmaker() as s:  # never stored with the command
        (row,) = agents.commands_after(s, job, 1, "n0", 0)
        assert "agent_token" not in row.args

    agent = {"Authorization": f"Bearer {token}"}
    other = client.post(base(job, 2, "n1") + "/heartbeat", json={"state": "running"}, headers=agent)
    assert other.status_code == 401  # another node's routes stay closed to it
    body = {"node_rank": 0, "hostname": "h", "ranks": [], **AGENT}
    moved = client.post(base(job, 2, "n0") + "/register", json=body, headers=agent)
    assert moved.status_code == 200, moved.text
    with client.app.state.sessionmaker() as s:
        (node,) = agents.list_nodes(s, job, 2)
        assert node.node_id == "n0"
        assert not agents.is_held(s, job, 1, "n0")
    # moved on: the attempt it left is over for it
    assert client.get(base(job, node="n0") + "/commands", params={"wait": 0}).status_code == 409


def test_a_carried_node_s_exit_and_crash_count_in_the_attempt_it_is_in_now(
    client, job_id, tmp_path
):
    """The node keeps the id it was launched with (``{job}-a1-n0``) in attempt 2: what it
    reports there is attempt 2's (its exit makes it exited in attempt 2's view, its
    crash is attempt 2's failure), never attempt 1's."""
    job = job_id
    nid = f"{job}-a1-n0"
    assert register(client, job, node=nid).status_code == 200
    hold(client, job, 1, nid)
    set_attempt_state(client.app.state.sessionmaker, job, 1, "ended")
    add_attempt(client.app.state.sessionmaker, job, 2)
    agent = {"Authorization": f"Bearer {node_token(client.app.state.token, job, 2, nid)}"}
    body = {"node_rank": 0, "hostname": "h", "ranks": [], **AGENT}
    assert client.post(base(job, 2, nid) + "/register", json=body, headers=agent).status_code == 200
    crash = {"key": "rank_exit:0", "kind": "rank_exit", "rank": 0, "local_rank": 0,
             "exit_code": 1, "signal": None, "log_tail": ["RuntimeError: boom"]}  # fmt: skip
    done = {"key": "node_exit", "kind": "node_exit", "exit_code": 1, "reason": "ranks failed"}
    for report in (crash, done):
        r = client.post(base(job, 2, nid) + "/reports", json=report, headers=agent)
        assert r.status_code == 200, r.text
    with client.app.state.sessionmaker() as s:
        snap, _ = gather_snapshot(s, job, datetime.now(UTC), FakeLauncher(root=tmp_path))
        assert snap.attempt is not None and snap.attempt.number == 2
        (node,) = snap.attempt.nodes
        assert node.node_id == nid and node.exited
        assert [f.node_id for f in _failures(s, job, 2, {})] == [nid]
        assert _failures(s, job, 1, {}) == []
