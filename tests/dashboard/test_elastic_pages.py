"""The dashboard of an elastic run (issue 20): a job page's phases say the nodes each
trained on and mark the shrunk one, a grow is labelled a planned reshape, and no view
that counts failures (the jobs list, the fleet) counts a grow.

Its own seeded app (the module's ``seeded_app`` in conftest holds jobs other tests
count): a job that shrank 3 -> 2 and grew back, and one whose spare was lost."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_seed import client, login, make_app  # puts tests/goodput on the path
from elastic_history import grown_job, spare_lost_job


def _seed(app: Any) -> dict[str, str]:
    with app.state.sessionmaker() as s:
        ids = {"grown": grown_job(s).id, "lost": spare_lost_job(s).id}
        s.commit()
    return ids


@pytest.fixture(scope="module")
def elastic_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("elastic-dash")
    application = make_app(f"sqlite:///{tmp / 'test.db'}", tmp / "home")
    application.state.seeded = _seed(application)
    yield application
    application.state.engine.dispose()


@pytest.fixture
def pages(elastic_app: Any) -> Iterator[Any]:
    with client(elastic_app) as c:
        login(c, elastic_app.state.token)
        yield c


def _section(page: str, name: str) -> str:
    found = re.search(rf'<section id="{name}">.*?</section>', page, re.S)
    assert found is not None, name
    return found.group(0)


def _row(html: str, row_id: str) -> str:
    found = re.search(rf'<tr id="{row_id}"[^>]*>.*?</tr>', html, re.S)
    assert found is not None, row_id
    return found.group(0)


def test_the_job_page_shows_the_nodes_each_phase_trained_on_and_marks_the_shrunk_one(
    pages, elastic_app
):
    job = elastic_app.state.seeded["grown"]
    attempts = _section(pages.get(f"/dashboard/jobs/{job}").text, "attempts")
    assert "Nodes trained" in attempts
    shrunk = _row(attempts, "attempt-2")
    assert 'class="shrunk-row"' in shrunk
    assert "2 of 3" in shrunk and '<span class="shrunk">shrunk</span>' in shrunk
    assert "+1 standby spare" in shrunk and "given back" not in shrunk
    assert "0.333" in shrunk  # steps per second, from the run's series
    assert "+0.39 spare" in shrunk  # the spare's node-hours, apart from the group's 0.77
    full = _row(attempts, "attempt-1")
    assert "shrunk" not in full and '<td class="num">3</td>' in full and "0.5" in full
    assert "from step time" in _row(attempts, "attempt-3")  # no samples: its heartbeats


def test_a_grow_is_labelled_a_planned_reshape_and_each_reshape_shows_its_nodes(pages, elastic_app):
    job = elastic_app.state.seeded["grown"]
    page = pages.get(f"/dashboard/jobs/{job}").text
    history = _section(page, "history")
    assert "1 failure, and 1 planned reshape" in history
    incidents = re.search(r'<table class="incidents">.*?</table>', history, re.S)
    assert incidents is not None
    rows = re.findall(r'<tr id="incident-\d+".*?</tr>', incidents.group(0), re.S)
    lost, grow = rows
    assert "node_lost" in lost and "planned reshape" not in lost
    assert "(shrink: 3 → 2 nodes)" in lost
    assert 'class="planned-row"' in grow and '<span class="planned">planned reshape</span>' in grow
    assert "(grow: 2 → 3 nodes)" in grow
    assert "(elastic_grow, a planned reshape): protocol steps" in history
    # The timeline's tooltips say the same.
    assert "2 of 3 nodes (shrunk, 1 standby spare)" in history
    assert "a planned reshape, not a failure" in history
    assert "1 of them planned reshape, not failures" in page  # the restarts fact


def test_the_goodput_section_shows_the_time_spent_shrunk_and_the_spares_node_hours(
    pages, elastic_app
):
    job = elastic_app.state.seeded["grown"]
    goodput = _section(pages.get(f"/dashboard/jobs/{job}").text, "goodput")
    shrunk = re.search(r'<tr id="shrunk-time">.*?</tr>', goodput, re.S)
    assert shrunk is not None and "fewer than 3 nodes" in shrunk.group(0)
    assert "22.2 min" in shrunk.group(0)  # 1,334 s
    assert re.search(r"Planned reshapes \(grows[^<]*</th><td class=\"num\">27.7 s", goodput)
    assert re.search(r"Node-hours \(standby spares\)</th><td class=\"num\">0.39<", goodput)


def test_a_given_back_spare_says_why_on_its_phase(pages, elastic_app):
    job = elastic_app.state.seeded["lost"]
    shrunk = _row(_section(pages.get(f"/dashboard/jobs/{job}").text, "attempts"), "attempt-2")
    assert f"(given back: {job}-a2-n2 is gone)" in shrunk


def test_the_jobs_list_counts_failures_and_shows_grows_apart(pages, elastic_app):
    ids = elastic_app.state.seeded
    jobs = pages.get("/dashboard/").text
    grown = re.search(rf'<a href="/dashboard/jobs/{ids["grown"]}">.*?</tr>', jobs, re.S)
    lost = re.search(rf'<a href="/dashboard/jobs/{ids["lost"]}">.*?</tr>', jobs, re.S)
    assert grown is not None and lost is not None
    assert re.search(r'<td class="num">1<span class="sub planned"> \+1 planned reshape</span>',
                     grown.group(0))  # fmt: skip
    assert "planned reshape" not in lost.group(0)


def test_the_fleet_counts_no_grow_as_a_failure(pages):
    fleet = pages.get("/dashboard/fleet?days=3650").text
    assert "2 incidents in 2 jobs" in fleet  # the two node losses
    assert "1 planned reshape (elastic grows back to full size)" in fleet
    by_class = _section(fleet, "by-class")
    assert "node_lost" in by_class and "elastic_grow" not in by_class
    assert '<option value="elastic_grow"' not in fleet  # not a failure class to filter by


@pytest.mark.postgres
def test_the_failure_counts_leave_grows_out_on_postgres(postgres_server_url: str, tmp_path: Path):
    from testkit import reset_postgres

    reset_postgres(postgres_server_url)
    application = make_app(postgres_server_url, tmp_path / "home")
    try:
        ids = _seed(application)
        with client(application) as c:
            login(c, application.state.token)
            jobs = c.get("/dashboard/").text
            assert jobs.count("+1 planned reshape") == 1, ids
            assert "2 incidents in 2 jobs" in c.get("/dashboard/fleet?days=3650").text
            page = c.get(f"/dashboard/jobs/{ids['grown']}").text
            assert "(shrink: 3 → 2 nodes)" in page and "(grow: 2 → 3 nodes)" in page
    finally:
        application.state.engine.dispose()
