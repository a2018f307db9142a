"""What an operator reads of an elastic run through the real app, on SQLite and
PostgreSQL: the attempts (the nodes each trained on, its spares by node id), the
incidents (a shrink's nodes before and after, the grow planned), goodput's phases and
time spent shrunk, and ``skyresume goodput``'s table of them."""

from __future__ import annotations

import pytest
from elastic_history import SHRINK_STEPS, grown_job, spare_refused_job
from goodput_history import steps_end
from testkit import cli_through


def _seed(app, build=grown_job) -> str:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        h = build(s)
        s.commit()
        return h.id


def test_attempts_say_the_nodes_that_trained_and_a_shrunk_ones_spares_by_node_id(client, app):
    job = _seed(app)
    items = client.get(f"/v1/jobs/{job}/attempts").json()["items"]
    assert [(a["num_nodes"], a["training_nodes"]) for a in items] == [(3, 3), (3, 2), (3, 3)]
    full, shrunk, grown = items
    assert full["spare"] is None and grown["spare"] is None
    assert shrunk["spare"] == {"count": 1, "released": None, "node_ids": [f"{job}-a2-n2"]}
    # The spare registered beside the group, with no ranks of its own.
    spare_node = next(n for n in shrunk["nodes"] if n["node_id"] == f"{job}-a2-n2")
    assert spare_node["node_rank"] == 2 and spare_node["ranks"] == []


def test_a_refused_standby_launch_is_a_spare_with_no_node_and_its_reason(client, app):
    job = _seed(app, spare_refused_job)
    shrunk = client.get(f"/v1/jobs/{job}/attempts").json()["items"][1]
    assert shrunk["training_nodes"] == 2
    assert shrunk["spare"] == {
        "count": 1,
        "released": "the standby launch was refused: no capacity",
        "node_ids": [],
    }


def test_the_node_loss_that_shrank_says_nodes_before_and_after_and_the_grow_is_planned(client, app):
    job = _seed(app)
    lost, grow = client.get(f"/v1/jobs/{job}/incidents").json()["items"]

    def said(i: dict) -> tuple:  # type: ignore[type-arg]
        return i["failure_class"], i["planned"], i["reshape"]

    assert said(lost) == ("node_lost", False, "shrink")
    assert (lost["nodes_before"], lost["nodes_after"], lost["train_nodes"]) == (3, 2, 2)
    assert lost["launch_verb"] == "shrink"
    assert said(grow) == ("elastic_grow", True, "grow")
    assert (grow["nodes_before"], grow["nodes_after"]) == (2, 3)
    assert (grow["remedy"], grow["launch_verb"]) == ("grow_back", "join_survivors")


def test_an_ordinary_incident_is_neither_planned_nor_a_reshape(client, app):
    from goodput_history import two_incident_job

    job = _seed(app, two_incident_job)
    for i in client.get(f"/v1/jobs/{job}/incidents").json()["items"]:
        assert (i["planned"], i["reshape"], i["nodes_before"], i["nodes_after"]) == (
            False, None, 2, 2,
        )  # fmt: skip


def test_goodput_reports_each_phases_nodes_time_throughput_and_the_time_spent_shrunk(client, app):
    job = _seed(app)
    doc = client.get(f"/v1/jobs/{job}/goodput").json()
    shrunk = doc["attempts"][1]
    assert (shrunk["training_nodes"], shrunk["num_nodes"], shrunk["shrunk"]) == (2, 3, True)
    assert shrunk["spare_nodes"] == 1 and shrunk["spare_released"] is None
    assert shrunk["training_seconds"] == pytest.approx(5000 - steps_end(3600, SHRINK_STEPS))
    assert shrunk["steps_per_second"] == pytest.approx(1 / 3, abs=1e-6)
    assert shrunk["throughput_source"] == "progress_samples"
    assert shrunk["spare_node_hours"] == pytest.approx(1393.5 / 3600, abs=1e-4)
    assert doc["shrunk_seconds"] == pytest.approx(1334.0)
    assert doc["reshape_seconds"] == pytest.approx(27.7)
    assert [i["planned"] for i in doc["incidents"]] == [False, True]


def test_the_goodput_table_marks_the_shrunk_phase_and_the_planned_grow(client, app, monkeypatch):
    from typer.testing import CliRunner

    job = _seed(app)
    from orchestrator.commands import common
    from orchestrator.commands import goodput as goodput_command

    cli = cli_through(client, monkeypatch)
    # The command module holds its own name for the client: answered by the app too.
    monkeypatch.setattr(goodput_command, "Client", common.Client)
    monkeypatch.setenv("COLUMNS", "200")
    r = CliRunner().invoke(cli.app, ["goodput", job])
    assert r.exit_code == 0, r.output
    assert "2 restarts (1 of them planned reshapes)" in r.stdout
    assert "2 of 3, shrunk, +1 spare" in r.stdout
    assert "elastic_grow (planned reshape)" in r.stdout
    assert "time spent shrunk 22.2m" in r.stdout  # 1,334 s
    assert "0.526 (step time)" in r.stdout  # attempt 3: from its heartbeats
