"""The agent routes through the real app on SQLite and PostgreSQL (the `client` fixture)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from conftest import add_attempt, set_attempt_state
from testkit import job_spec

from orchestrator import __version__
from orchestrator.api.auth import job_token
from orchestrator.contract import AGENT_PROTOCOL
from orchestrator.store import agents
from orchestrator.store.models import Checkpoint


@pytest.fixture
def job(client) -> str:
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201
    job_id = r.json()["id"]
    add_attempt(client.app.state.sessionmaker, job_id, 1)
    return job_id


def base(job_id: str, attempt: int = 1, node: str = "n0") -> str:
    return f"/v1/jobs/{job_id}/attempts/{attempt}/nodes/{node}"


#: What a current agent sends about itself (a body without it is refused: 409).
AGENT = {"agent_version": __version__, "agent_build": "source", "protocol": AGENT_PROTOCOL}


def register(client, job_id: str, attempt: int = 1, node: str = "n0", **kw: Any):
    body = {
        "node_rank": 0,
        "hostname": "h",
        "agent_pid": 42,
        "provider": "aws",
        "ranks": [],
        **AGENT,
    }
    return client.post(base(job_id, attempt, node) + "/register", json={**body, **kw})


def rank_row(rank: int, **kw: Any) -> dict[str, Any]:
    return {"rank": rank, "local_rank": rank, "pid": 1000 + rank, "alive": True, **kw}


def enqueue(client, job_id: str, type_: str, args: dict, attempt: int = 1, node_id=None) -> int:
    with client.app.state.sessionmaker() as s, s.begin():
        return agents.enqueue_command(s, job_id, attempt, type_, args, node_id=node_id).id


def test_register_then_heartbeat_stores_the_node_and_its_ranks(client, job):
    r = register(client, job, ranks=[{"rank": 0, "local_rank": 0, "pid": 11}])
    assert r.status_code == 200, r.text
    assert r.json() == {
        "heartbeat_s": 1.0,
        "command_cursor": 0,
        "agent_token": None,  # issued only for an enrolment token (test_enrolment.py)
        "service_version": __version__,
        "protocol": AGENT_PROTOCOL,
    }
    hb = {
        "state": "running",
        "ranks": [rank_row(0, step=7, loss=2.5, resumed={"step": 5, "manifest_digest": "ab"})],
        "last_checkpoint": {"step": 5, "path": "/d/step_5", "uploaded_uri": None},
        "acked_command": None,
    }
    assert client.post(base(job) + "/heartbeat", json=hb).status_code == 200
    with client.app.state.sessionmaker() as s:
        (node,) = agents.list_nodes(s, job, 1)
        assert node.state == "running" and node.node_id == "n0"
        assert node.progress["ranks"][0]["step"] == 7
        assert node.progress["ranks"][0]["resumed"] == {"step": 5, "manifest_digest": "ab"}
        assert node.progress["last_checkpoint"]["step"] == 5
        assert node.last_heartbeat_at is not None
        assert agents.list_nodes(s, job, 2) == []


def test_heartbeat_from_an_unregistered_node_is_404_so_the_agent_registers(client, job):
    r = client.post(base(job, node="ghost") + "/heartbeat", json={"state": "running"})
    assert r.status_code == 404 and "not registered" in r.json()["detail"]


@pytest.mark.parametrize(
    "make_stale",
    [
        pytest.param(lambda c, j: add_attempt(c.app.state.sessionmaker, j, 2), id="newer-attempt"),
        pytest.param(
            lambda c, j: set_attempt_state(c.app.state.sessionmaker, j, 1, "ended"), id="ended"
        ),
        pytest.param(lambda c, j: c.post(f"/v1/jobs/{j}/cancel"), id="job-cancelled"),
    ],
)
def test_a_superseded_attempt_gets_409_on_register_heartbeat_and_commands(client, job, make_stale):
    assert register(client, job).status_code == 200
    make_stale(client, job)
    assert register(client, job).status_code == 409
    assert client.post(base(job) + "/heartbeat", json={"state": "running"}).status_code == 409
    r = client.get(base(job) + "/commands", params={"wait": 0})
    assert r.status_code == 409 and "not the current attempt" in r.json()["detail"]


def test_unknown_job_is_404_and_an_attempt_that_never_existed_is_409(client, job):
    assert register(client, "j-nope").status_code == 404
    assert register(client, job, attempt=7).status_code == 409
    report = {"key": "k", "kind": "node_exit", "exit_code": 0, "reason": "done"}
    assert client.post(base(job, 7) + "/reports", json=report).status_code == 409


def test_job_token_opens_its_own_job_only(client, job):
    other = client.post("/v1/jobs", json=job_spec(name="other")).json()["id"]
    add_attempt(client.app.state.sessionmaker, other, 1)
    tok = job_token(client.app.state.token, job, 1)
    h = {"Authorization": f"Bearer {tok}"}
    body = {"node_rank": 0, "ranks": [], **AGENT}
    assert client.post(base(job) + "/register", json=body, headers=h).status_code == 200
    assert client.post(base(other) + "/register", json=body, headers=h).status_code == 401
    assert client.get("/v1/jobs", headers=h).status_code == 401  # not an operator token
    bad = {"Authorization": "Bearer nope"}
    assert client.post(base(job) + "/register", json=body, headers=bad).status_code == 401
    assert (
        client.post(base(job) + "/register", json=body, headers={"Authorization": ""}).status_code
        == 401
    )


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/register", {"node_rank": 0, "surprise": 1}, "surprise"),
        ("/register", {"node_rank": -1}, "node_rank"),
        ("/heartbeat", {"state": "dancing"}, "state"),
        ("/heartbeat", {"state": "running", "ranks": [{"rank": 0}]}, "local_rank"),
        ("/reports", {"key": "k", "kind": "gossip"}, "kind"),
        ("/reports", {"key": "k", "kind": "rank_exit", "rank": 0}, "local_rank"),
        ("/reports", {"key": "k", "kind": "anomaly", "rank": 0, "finding": "meh"}, "finding"),
    ],
    ids=["extra", "negative-rank", "bad-state", "rank-fields", "kind", "missing", "finding"],
)
def test_bad_bodies_get_a_422_that_names_the_field(client, job, path, body, field):
    register(client, job)
    r = client.post(base(job) + path, json=body)
    assert r.status_code == 422, r.text
    assert field in r.text


def test_nan_loss_is_refused_because_postgres_json_cannot_store_it(client, job):
    register(client, job)
    r = client.post(
        base(job) + "/heartbeat",
        content=b'{"state": "running", "ranks": '
        b'[{"rank": 0, "local_rank": 0, "alive": true, "loss": NaN}]}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422 and "loss" in r.text


def test_commands_for_all_nodes_and_for_one_node_after_the_cursor(client, job):
    register(client, job, node="n0")
    register(client, job, node="n1")
    c1 = enqueue(client, job, "set_checkpoint_every", {"every_steps": 20})
    c2 = enqueue(client, job, "stop", {"reason": "x"}, node_id="n1")
    c3 = enqueue(client, job, "checkpoint_and_stop", {"reason": "notice", "grace_s": 30})
    n0 = client.get(base(job, node="n0") + "/commands").json()["commands"]
    n1 = client.get(base(job, node="n1") + "/commands", params={"after": c1}).json()["commands"]
    assert [c["seq"] for c in n0] == [c1, c3]
    assert [c["seq"] for c in n1] == [c2, c3]
    assert n0[1] == {
        "seq": c3,
        "type": "checkpoint_and_stop",
        "args": {"reason": "notice", "grace_s": 30},
    }
    with client.app.state.sessionmaker() as s, pytest.raises(ValueError, match="command type"):
        agents.enqueue_command(s, job, 1, "reboot", {})


def test_long_poll_returns_a_command_enqueued_while_it_waits(client, job):
    register(client, job)
    timer = threading.Timer(0.3, lambda: enqueue(client, job, "stop", {"reason": "late"}))
    timer.start()
    r = client.get(base(job) + "/commands", params={"after": 0, "wait": 20})
    timer.join()
    assert r.status_code == 200
    assert [c["args"]["reason"] for c in r.json()["commands"]] == ["late"]


def test_long_poll_does_not_block_other_requests(client, job):
    register(client, job)
    result: dict[str, Any] = {}

    def wait() -> None:
        result["r"] = client.get(base(job) + "/commands", params={"wait": 2})

    t = threading.Thread(target=wait)
    t.start()
    hb = client.post(base(job) + "/heartbeat", json={"state": "running"})
    still_waiting = t.is_alive()
    t.join()
    assert hb.status_code == 200 and still_waiting
    assert result["r"].json() == {"commands": []}


def test_a_waiting_long_poll_gets_409_when_the_attempt_is_superseded(client, job):
    register(client, job)
    sm = client.app.state.sessionmaker
    timer = threading.Timer(0.3, lambda: add_attempt(sm, job, 2))
    timer.start()
    r = client.get(base(job) + "/commands", params={"wait": 20})
    timer.join()
    assert r.status_code == 409


def test_wait_over_30_s_is_refused(client, job):
    register(client, job)
    assert client.get(base(job) + "/commands", params={"wait": 31}).status_code == 422


def test_register_again_resumes_from_the_acknowledged_command(client, job):
    register(client, job)
    seq = enqueue(client, job, "stop", {})
    hb = {"state": "stopping", "acked_command": seq}
    assert client.post(base(job) + "/heartbeat", json=hb).status_code == 200
    # A heartbeat that acks nothing new keeps the cursor.
    assert client.post(base(job) + "/heartbeat", json={"state": "stopping"}).status_code == 200
    assert register(client, job).json()["command_cursor"] == seq


def test_crashed_rank_exit_is_classified_from_its_log_tail_and_recorded_once(client, job):
    register(client, job)
    report = {
        "key": "rank_exit:1",
        "kind": "rank_exit",
        "rank": 1,
        "local_rank": 1,
        "exit_code": 1,
        "signal": None,
        "log_tail": [
            "Traceback (most recent call last):",
            '  File "train.py", line 3, in <module>',
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        ],
    }
    first = client.post(base(job) + "/reports", json=report)
    again = client.post(base(job) + "/reports", json=report)
    assert first.status_code == 200 and first.json()["created"] is True
    assert again.json() == {"event_id": first.json()["event_id"], "created": False}
    (ev,) = client.get(f"/v1/jobs/{job}/events").json()["items"]
    assert ev["kind"] == "rank_exit" and ev["failure_class"] == "cuda_oom"
    assert ev["rank"] == 1 and ev["node_id"] == "n0"
    assert ev["details"]["classification"]["class"] == "cuda_oom"
    assert ev["details"]["log_tail"][-1].startswith("torch.OutOfMemoryError")


@pytest.mark.parametrize("code", [0, 75])
def test_clean_rank_exits_are_recorded_without_a_failure_class(client, job, code):
    register(client, job)
    report = {"key": "r0", "kind": "rank_exit", "rank": 0, "local_rank": 0, "exit_code": code}
    assert client.post(base(job) + "/reports", json=report).status_code == 200
    (ev,) = client.get(f"/v1/jobs/{job}/events").json()["items"]
    assert ev["failure_class"] is None


def test_the_same_key_from_two_nodes_is_two_events(client, job):
    for node in ("n0", "n1"):
        register(client, job, node=node)
        report = {"key": "node_exit", "kind": "node_exit", "exit_code": 75, "reason": "saved"}
        assert client.post(base(job, node=node) + "/reports", json=report).json()["created"]
    assert len(client.get(f"/v1/jobs/{job}/events").json()["items"]) == 2


def test_reports_notice_checkpoint_anomaly_node_exit(client, job):
    register(client, job)
    reports = [
        {
            "key": "n",
            "kind": "preemption_notice",
            "provider": "aws",
            "notice_kind": "terminate",
            "deadline": "2026-12-01T04:00:00+00:00",
            "detail": {"action": "terminate"},
        },
        {
            "key": "c",
            "kind": "checkpoint",
            "step": 40,
            "path": "/local/step_40",
            "uploaded_uri": None,
            "world_size": 4,
            "blocking_s": 0.25,
        },
        {
            "key": "c2",
            "kind": "checkpoint",
            "step": 40,
            "path": "/local/step_40",
            "uploaded_uri": "s3://b/run/step_40",
            "world_size": 4,
        },
        {
            "key": "a",
            "kind": "anomaly",
            "rank": 2,
            "finding": "nan_divergence",
            "step": 41,
            "detail": {"loss": None},
        },
        {"key": "x", "kind": "node_exit", "exit_code": 75, "reason": "saved", "saved_step": 40},
    ]
    for rep in reports:
        r = client.post(base(job) + "/reports", json=rep)
        assert r.status_code == 200, r.text
    events = client.get(f"/v1/jobs/{job}/events").json()["items"]
    assert events[1]["details"]["blocking_s"] == 0.25  # the interval advisor reads it
    assert [(e["kind"], e["failure_class"]) for e in events] == [
        ("preemption_notice", "preemption_notice"),
        ("checkpoint", None),
        ("checkpoint", None),
        ("anomaly", "nan_divergence"),
        ("node_exit", None),
    ]
    with client.app.state.sessionmaker() as s:
        (ck,) = s.query(Checkpoint).filter_by(job_id=job).all()
        assert (ck.step, ck.status, ck.uri, ck.world_size) == (
            40,
            "complete",
            "s3://b/run/step_40",
            4,
        )
        (node,) = agents.list_nodes(s, job)
        assert node.state == "exited"


def test_reports_from_a_past_attempt_are_still_history(client, job):
    register(client, job)
    add_attempt(client.app.state.sessionmaker, job, 2)
    report = {"key": "x", "kind": "node_exit", "exit_code": 1, "reason": "superseded"}
    r = client.post(base(job) + "/reports", json=report)
    assert r.status_code == 200 and r.json()["created"]


def test_is_current_attempt(client, job):
    sm = client.app.state.sessionmaker
    with sm() as s:
        assert agents.is_current_attempt(s, job, 1)
        assert not agents.is_current_attempt(s, job, 2)
    add_attempt(sm, job, 2, state="launching")
    with sm() as s:
        assert not agents.is_current_attempt(s, job, 1)
        assert agents.is_current_attempt(s, job, 2)
        with pytest.raises(agents.NotFound):
            agents.is_current_attempt(s, "j-none", 1)
