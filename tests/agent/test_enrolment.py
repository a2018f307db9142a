"""A launched task carries a single-use enrolment token, not the attempt's agent token.

SkyPilot keeps a task's secrets in plaintext in its request database and returns them
from ``/api/status`` (SKYPILOT.md 1.13, defect 16). So what the task carries is spent
at each node's first register, which hands back the attempt's agent token; a replay,
another attempt's token, an expired one, or one presented anywhere but register is
401 naming why. Through the real app, on SQLite and PostgreSQL (the ``client`` fixture).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from conftest import add_attempt, set_attempt_state
from sqlalchemy import func, select
from test_agent_api import AGENT
from testkit import job_spec

from orchestrator.api.auth import node_token
from orchestrator.store.models import AgentEnrolment
from orchestrator.store.tokens import enrolment_token

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TTL = timedelta(hours=1)


@pytest.fixture
def job(client) -> str:
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201
    job_id = r.json()["id"]
    add_attempt(client.app.state.sessionmaker, job_id, 1)
    return job_id


def node(job: str, k: int = 0, attempt: int = 1) -> str:
    return f"/v1/jobs/{job}/attempts/{attempt}/nodes/{job}-a{attempt}-n{k}"


def enrol(client, job: str, token: str, k: int = 0, attempt: int = 1):
    body = {"node_rank": k, "ranks": [], **AGENT}
    return client.post(
        node(job, k, attempt) + "/register", json=body, headers={"Authorization": f"Bearer {token}"}
    )


def mint(client, job: str, attempt: int = 1, *, ttl: timedelta = TTL, now=None) -> str:
    return enrolment_token(client.app.state.token, job, attempt, ttl=ttl, now=now)


def test_the_first_register_exchanges_the_enrolment_for_the_attempts_agent_token(client, job):
    r = enrol(client, job, mint(client, job))
    assert r.status_code == 200, r.text
    issued = r.json()["agent_token"]
    # A token for this node's own routes (a node reports only as itself, #24).
    assert issued == node_token(client.app.state.token, job, 1, f"{job}-a1-n0")
    beat = client.post(
        node(job) + "/heartbeat",
        json={"state": "running"},
        headers={"Authorization": f"Bearer {issued}"},
    )
    assert beat.status_code == 200, beat.text


def test_a_replayed_enrolment_is_refused_naming_why(client, job):
    token = mint(client, job)
    assert enrol(client, job, token).status_code == 200
    again = enrol(client, job, token)
    assert again.status_code == 401
    assert f"already used by node {job}-a1-n0" in again.json()["detail"]
    assert "replay" in again.json()["detail"]


def test_each_node_of_the_attempt_enrols_once_and_no_node_beyond_it(client, job):
    with client.app.state.sessionmaker() as s, s.begin():
        from orchestrator.store.models import Attempt

        s.scalars(select(Attempt).where(Attempt.job_id == job)).one().num_nodes = 2
    token = mint(client, job)
    assert enrol(client, job, token, 0).status_code == 200
    assert enrol(client, job, token, 1).status_code == 200
    extra = enrol(client, job, token, 2)
    assert extra.status_code == 401 and "is not a node of attempt 1" in extra.json()["detail"]
    with client.app.state.sessionmaker() as s:
        assert s.scalar(select(func.count()).select_from(AgentEnrolment)) == 2


def test_a_standby_ranked_past_the_attempts_nodes_enrols_when_its_launch_named_it(client, job):
    """A standby asked for again (``LaunchSpare``) is ranked past every earlier try's
    nodes: node rank 3 of an attempt placed for 3. Its launch, in the handle, names it;
    a rank past the nodes that no launch named is still refused."""
    from orchestrator.store.models import Attempt

    with client.app.state.sessionmaker() as s, s.begin():
        a = s.scalars(select(Attempt).where(Attempt.job_id == job)).one()
        a.num_nodes = 3
        a.handle = {"node_ids": [f"{job}-a1-n0", f"{job}-a1-n1", f"{job}-a1-n3"]}
    token = mint(client, job)
    assert enrol(client, job, token, 3).status_code == 200
    unnamed = enrol(client, job, token, 4)
    assert unnamed.status_code == 401 and "is not a node of attempt 1" in unnamed.json()["detail"]


def test_an_expired_enrolment_opens_nothing(client, job):
    token = mint(client, job, ttl=timedelta(minutes=5), now=datetime.now(UTC) - timedelta(hours=1))
    r = enrol(client, job, token)
    assert r.status_code == 401 and "expired at" in r.json()["detail"]


@pytest.mark.parametrize("what", ["other-attempt", "forged"])
def test_an_enrolment_of_another_attempt_or_forged_is_refused(client, job, what):
    add_attempt(client.app.state.sessionmaker, job, 2)
    token = mint(client, job, 1)
    if what == "forged":
        token = token[:-4] + ("0000" if not token.endswith("0000") else "1111")
        r = enrol(client, job, token)
    else:
        r = enrol(client, job, token, attempt=2)
    assert r.status_code == 401 and "not for attempt" in r.json()["detail"]


def test_an_enrolment_opens_only_register(client, job):
    token = mint(client, job)
    h = {"Authorization": f"Bearer {token}"}
    beat = client.post(node(job) + "/heartbeat", json={"state": "running"}, headers=h)
    assert beat.status_code == 401 and "opens only register" in beat.json()["detail"]
    assert client.get("/v1/jobs", headers=h).status_code == 401  # never an operator token


def test_a_register_that_fails_leaves_the_enrolment_unspent(client, job):
    """A 409 (the attempt is not current) rolls the use back with the register: the
    enrolment is spent only by a register that took."""
    token = mint(client, job)
    set_attempt_state(client.app.state.sessionmaker, job, 1, "ended")
    assert enrol(client, job, token).status_code == 409
    set_attempt_state(client.app.state.sessionmaker, job, 1, "running")
    assert enrol(client, job, token).status_code == 200


def test_a_registered_agent_registers_again_with_its_agent_token(client, job):
    issued = enrol(client, job, mint(client, job)).json()["agent_token"]
    again = enrol(client, job, issued)
    assert again.status_code == 200 and again.json()["agent_token"] is None


def test_the_same_agent_asking_again_after_a_lost_answer_gets_its_token_again(client, job):
    """A register whose answer never reached the agent (the service was slow, the
    connection dropped) spent the enrolment all the same: the agent process asks again
    with the same token and its own instance id, and is answered again. Seen on the
    emulated AWS under load: refused as a replay, the node never beat again and was
    declared lost."""
    token = mint(client, job)
    me = {"instance": "a" * 32}
    body = {"node_rank": 0, "ranks": [], **AGENT, **me}
    auth = {"Authorization": f"Bearer {token}"}
    first = client.post(node(job) + "/register", json=body, headers=auth)
    again = client.post(node(job) + "/register", json=body, headers=auth)
    assert (first.status_code, again.status_code) == (200, 200), again.text
    assert again.json()["agent_token"] == first.json()["agent_token"]
    other = client.post(
        node(job) + "/register", json={**body, "instance": "b" * 32}, headers=auth
    )
    assert other.status_code == 401 and "replay" in other.json()["detail"]
