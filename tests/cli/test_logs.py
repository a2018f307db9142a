"""Node log tails through the real app (SQLite and PostgreSQL): an agent's upload is
stored per source and replaced by the next; the operator reads them by attempt,
node and rank, and asks the current attempt's agents for fresh ones. Plus the
pieces of ``skyresume logs`` and of the agent's uploader that decide what is shown
and sent."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from testkit import job_spec

from orchestrator import __version__
from orchestrator.agent.logtail import LogUploader, RingHandler, collect
from orchestrator.api.auth import job_token
from orchestrator.commands.operator import _new_lines, _printable
from orchestrator.contract import AGENT_PROTOCOL
from orchestrator.store.models import Attempt, NodeCommand

AGENT = {"agent_version": __version__, "agent_build": "source", "protocol": AGENT_PROTOCOL}


@pytest.fixture(scope="module")
def sqlite_client(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One SQLite app for the module: the routes' checks, not the store's SQL (the
    first test runs that on both backends)."""
    from orchestrator.app import create_app
    from orchestrator.settings import Settings
    from orchestrator.store import db

    tmp = tmp_path_factory.mktemp("logs")
    url = f"sqlite:///{tmp / 'logs.db'}"
    db.upgrade(url)
    app = create_app(Settings(home=tmp / "home", database_url=url))
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {app.state.token}"
        yield c
    app.state.engine.dispose()


def make_job(client: TestClient) -> str:
    r = client.post("/v1/jobs", json=job_spec(num_nodes=1))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    with client.app.state.sessionmaker() as s, s.begin():  # type: ignore[attr-defined]
        s.add(
            Attempt(
                job_id=job_id, number=1, cloud="local", region="local", instance_type="cpu",
                num_nodes=1, spot=True, knobs={}, started_at=datetime.now(UTC),
                state="running", launcher="local",
            )
        )  # fmt: skip
    node = f"/v1/jobs/{job_id}/attempts/1/nodes/n0"
    r = client.post(f"{node}/register", json={"node_rank": 0, "hostname": "10.0.0.7", **AGENT})
    assert r.status_code == 200, r.text
    return job_id


@pytest.fixture
def job(client: TestClient) -> str:
    return make_job(client)


@pytest.fixture
def sjob(sqlite_client: TestClient) -> str:
    return make_job(sqlite_client)


def put_logs(client: TestClient, job: str, body: dict, node: str = "n0") -> int:  # type: ignore[type-arg]
    token = job_token(client.app.state.token, job, 1)  # type: ignore[attr-defined]
    r = client.put(
        f"/v1/jobs/{job}/attempts/1/nodes/{node}/logs",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
    )
    return r.status_code


def test_an_upload_is_stored_per_source_and_the_next_replaces_it(client, job):
    first = {
        "reason": "periodic",
        "logs": [
            {"source": "agent", "rank": None, "lines": ["agent up"]},
            {"source": "rank0", "rank": 0, "lines": ["step 1", "step 2"]},
            {"source": "rank1", "rank": 1, "lines": ["step 1"]},
        ],
    }
    assert put_logs(client, job, first) == 200
    second = {"reason": "exit", "logs": [{"source": "rank0", "rank": 0, "lines": ["step 3"]}]}
    assert put_logs(client, job, second) == 200
    items = client.get(f"/v1/jobs/{job}/logs").json()["items"]
    by_source = {i["source"]: i for i in items}
    assert by_source["rank0"]["lines"] == ["step 3"] and by_source["rank0"]["reason"] == "exit"
    assert by_source["rank1"]["lines"] == ["step 1"]  # an upload keeps what it did not name
    assert by_source["agent"]["lines"] == ["agent up"]
    only = client.get(f"/v1/jobs/{job}/logs", params={"rank": 1, "node": "n0", "attempt": 1})
    assert [i["source"] for i in only.json()["items"]] == ["rank1"]
    assert client.get(f"/v1/jobs/{job}/logs", params={"attempt": 2}).json()["items"] == []


@pytest.mark.parametrize(
    "body",
    [
        {"reason": "periodic", "logs": [{"source": "../etc", "lines": []}]},
        {"reason": "periodic", "logs": [{"source": "agent", "lines": ["x"] * 501}]},
        {"reason": "whenever", "logs": []},
    ],
    ids=["bad-source", "too-many-lines", "bad-reason"],
)
def test_an_upload_outside_the_limits_is_refused(sqlite_client, sjob, body):
    client, job = sqlite_client, sjob
    assert put_logs(client, job, body) == 422


def test_an_unknown_node_or_another_jobs_token_is_refused(sqlite_client, sjob):
    client, job = sqlite_client, sjob
    assert put_logs(client, job, {"reason": "exit", "logs": []}, node="n9") == 404
    other = client.post("/v1/jobs", json=job_spec(num_nodes=1)).json()["id"]
    r = client.put(
        f"/v1/jobs/{other}/attempts/1/nodes/n0/logs",
        json={"reason": "exit", "logs": []},
        headers={"Authorization": f"Bearer {job_token(client.app.state.token, job, 1)}"},
    )
    assert r.status_code == 401


def test_asking_for_logs_queues_one_upload_command_for_the_current_attempt(sqlite_client, sjob):
    client, job = sqlite_client, sjob
    r = client.post(f"/v1/jobs/{job}/logs/request")
    assert r.status_code == 200 and r.json()["attempt"] == 1
    with client.app.state.sessionmaker() as s:
        cmd = s.get(NodeCommand, r.json()["command"])
        assert (cmd.type, cmd.attempt, cmd.node_id) == ("upload_logs", 1, None)
    live = client.get(f"/v1/jobs/{job}/live").json()
    assert live["nodes"][0]["address"] == "10.0.0.7"
    assert (
        client.get(f"/v1/jobs/{job}/attempts").json()["items"][0]["nodes"][0]["address"]
        == "10.0.0.7"
    )


@pytest.mark.parametrize(
    ("before", "after", "new"),
    [
        ([], ["a", "b"], ["a", "b"]),
        (["a", "b", "c"], ["b", "c", "d", "e"], ["d", "e"]),  # the window slid by one
        (["a", "b"], ["a", "b"], []),
        (["x"], ["a", "b"], ["a", "b"]),  # nothing in common: all of it is new
    ],
)
def test_follow_prints_only_the_lines_past_what_it_printed(before, after, new):
    assert _new_lines(before, after) == new


def test_a_terminal_escape_in_a_log_line_is_shown_not_obeyed():
    assert _printable("ok\x1b[2J\x07\x9b done\tend") == "ok?[2J?? done\tend"


def test_the_uploader_sends_when_asked_and_periodically_only_on_change():
    sent: list[dict] = []  # type: ignore[type-arg]
    ring = RingHandler(3)
    log = logging.getLogger("test-logtail")
    log.addHandler(ring)
    log.setLevel(logging.INFO)
    up = LogUploader(sent.append, lambda: collect(ring, [], None), every_s=3600)
    for i in range(5):
        log.info("line %d", i)
    assert up.upload("periodic", force=False)
    assert sent[-1]["logs"][0]["lines"] == ["line 2", "line 3", "line 4"]  # the last 3
    assert not up.upload("periodic", force=False)  # unchanged: nothing sent
    assert up.upload("request")  # asked for: sent even unchanged
    log.info("line 5")
    up.stop()  # the exit upload
    assert sent[-1]["reason"] == "exit" and sent[-1]["logs"][0]["lines"][-1] == "line 5"
    log.removeHandler(ring)


def test_a_failed_upload_never_raises_into_the_agent():
    def down(_body: dict) -> None:  # type: ignore[type-arg]
        raise OSError("connection refused")

    assert LogUploader(down, lambda: []).upload("exit") is False
