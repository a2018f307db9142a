"""What an operator reads of an elastic run (issue 20) through the REST API: how many
nodes each attempt trained on, its standby spares, and which incidents were planned
reshapes rather than failures. Through the real app, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

from testkit import job_spec

from orchestrator.store.models import Attempt


def _attempt(number: int, knobs: dict, num_nodes: int = 3) -> Attempt:
    return Attempt(
        job_id="", number=number, cloud="local", region="local", instance_type="cpu",
        num_nodes=num_nodes, spot=True, knobs=knobs, started_at=datetime.now(UTC),
        state="running", launcher="local",
    )  # fmt: skip


def test_a_shrunk_attempt_says_how_many_nodes_trained_and_what_became_of_its_spare(client):
    job = client.post("/v1/jobs", json=job_spec()).json()["id"]
    with client.app.state.sessionmaker() as s, s.begin():
        for a in (
            _attempt(1, {"verb": "launch"}),
            _attempt(2, {"verb": "shrink", "train_nodes": 2, "keep": ["x", "y"]}),
            _attempt(3, {"verb": "shrink", "train_nodes": 2, "spare_released": "never came"}),
        ):
            a.job_id = job
            s.add(a)
    full, shrunk, alone = client.get(f"/v1/jobs/{job}/attempts").json()["items"]
    assert (full["num_nodes"], full["training_nodes"], full["spare"]) == (3, 3, None)
    assert (shrunk["num_nodes"], shrunk["training_nodes"]) == (3, 2)
    assert shrunk["spare"] == {"count": 1, "released": None, "node_ids": []}
    assert alone["spare"] == {"count": 1, "released": "never came", "node_ids": []}
