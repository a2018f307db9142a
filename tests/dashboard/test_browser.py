"""The dashboard in a real browser: Debian's chromium driven by Playwright, against
the app served by uvicorn on loopback (fixtures in conftest.py). Never downloads a
browser: without /usr/bin/chromium the test is skipped and says how to install it.

With a running job (the seeded one): a new event appears without a reload, each
chart draws its points, the fleet filters survive a reload, markup in a job name is
text, and no page logs a console error. Each page's screenshot is saved under the
artifacts folder (conftest.artifacts). One module, so one browser and one server."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from dashboard_seed import EVIL, SAMPLE_TIMES, client, login

from orchestrator.store import repo

pytestmark = pytest.mark.browser


def test_log_in_open_a_job_with_incidents_and_see_the_mttr_chart(chromium, live_url, seeded_app):
    job = seeded_app.state.seeded["good"]
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    try:
        page.goto(f"{live_url}/dashboard/jobs/{job}")
        assert page.url.startswith(f"{live_url}/dashboard/login?next=")

        page.fill("#token", "not-the-token")
        page.click("button[type=submit]")
        assert "unknown or revoked" in page.locator(".error").inner_text()
        problems.clear()  # the 401 itself is logged by the browser as a failed load

        page.fill("#token", seeded_app.state.token)
        page.click("button[type=submit]")
        page.wait_for_url(f"{live_url}/dashboard/jobs/{job}")

        chart = page.locator("#mttr-chart")
        chart.wait_for(state="visible")
        box = chart.bounding_box()
        assert box is not None and box["width"] > 300 and box["height"] > 40
        segments = chart.locator("rect.seg")
        assert segments.count() == 14  # 7 protocol steps x 2 incidents
        launch = chart.locator('rect.seg[fill="#edc948"]')  # the launch steps
        first, second = launch.nth(0).bounding_box(), launch.nth(1).bounding_box()
        assert first and second and first["width"] > second["width"] > 0  # 310 s vs 242 s
        assert page.locator("#effective").inner_text() == "93.2%"
        assert page.locator("table.incidents tbody tr").count() == 2

        # The stylesheet loaded under the CSP (no inline styles, no scripts).
        header_bg = page.eval_on_selector("header.top", "e => getComputedStyle(e).backgroundColor")
        assert header_bg == "rgb(29, 35, 48)"

        (cookie,) = [c for c in context.cookies() if c["name"] == "skyresume_dashboard"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # no script can read the session

        page.click("text=Fleet")
        page.wait_for_url(f"{live_url}/dashboard/fleet")
        assert page.locator("#fleet-classes").is_visible()

        page.click("text=Log out")
        page.wait_for_url(f"{live_url}/dashboard/login")
        page.goto(f"{live_url}/dashboard/jobs/{job}")
        assert "/dashboard/login" in page.url
        assert problems == []
    finally:
        context.close()


@pytest.fixture
def page(chromium, live_url, seeded_app) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    context = chromium.new_context(viewport={"width": 1280, "height": 1000})
    p = context.new_page()
    p.problems = []  # console errors, page errors and dialogs (an alert() is an injection)
    p.on("console", lambda m: p.problems.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: p.problems.append(str(e)))
    p.on("dialog", lambda d: (p.problems.append(f"dialog: {d.message}"), d.dismiss()))
    # Logged in through the form by an HTTP client, the session handed to the browser:
    # test_browser.py drives the login form itself; these tests are about the pages.
    with client(seeded_app) as c:
        login(c, seeded_app.state.token)
        cookie = c.cookies.get("skyresume_dashboard")
    assert cookie
    context.add_cookies([{"name": "skyresume_dashboard", "value": cookie, "url": live_url}])
    yield p
    context.close()


def test_a_new_event_appears_on_a_running_jobs_page_without_a_reload(
    page, live_url, seeded_app, artifacts: Path
):
    job = seeded_app.state.seeded["evil"]
    page.goto(f"{live_url}/dashboard/jobs/{job}")
    page.evaluate("window.__notReloaded = true")
    assert page.locator("#live-events").inner_text().count("brand-new") == 0
    now = datetime.now(UTC)
    with seeded_app.state.sessionmaker() as s:
        repo.record_event(
            s, job, idempotency_key="browser-new", kind="anomaly", failure_class="loss_spike",
            node_id="n1", message="brand-new event <b>bold?</b>", occurred_at=now, now=now,
        )  # fmt: skip
        s.commit()
    page.locator("#live-events", has_text="brand-new event").wait_for(timeout=15_000)
    assert page.evaluate("window.__notReloaded") is True  # swapped in, not reloaded
    assert "brand-new event <b>bold?</b>" in page.locator("#live-events").inner_text()
    assert page.locator("#live-events b").count() == 0  # the markup stayed text
    assert page.locator("#live").get_attribute("data-updated")
    page.screenshot(path=str(artifacts / "job-running.png"), full_page=True)
    assert page.problems == []


def test_each_chart_draws_its_points(page, live_url, seeded_app, artifacts: Path):
    job = seeded_app.state.seeded["evil"]
    page.goto(f"{live_url}/dashboard/jobs/{job}")
    for chart, per_rank in (
        ("#series-loss", len(SAMPLE_TIMES)),
        ("#series-grad-norm", len(SAMPLE_TIMES)),
        ("#series-steps", len(SAMPLE_TIMES) - 1),
    ):
        points = page.locator(f"{chart} circle.point")
        assert points.count() == 2 * per_rank, chart
        first, last = points.nth(0).bounding_box(), points.nth(per_rank - 1).bounding_box()
        assert first and last and last["x"] > first["x"], chart  # time runs left to right
        assert page.locator(f"{chart} rect.mark").count() == 1, chart  # the incident
    loss = page.locator("#series-loss circle.point")
    top, bottom = loss.nth(0).bounding_box(), loss.nth(len(SAMPLE_TIMES) - 1).bounding_box()
    assert top and bottom and bottom["y"] > top["y"]  # the loss falls: lower on the chart
    good = seeded_app.state.seeded["good"]
    page.goto(f"{live_url}/dashboard/jobs/{good}")
    assert page.locator("#mttr-chart rect.seg").count() == 14
    page.screenshot(path=str(artifacts / "job-finished.png"), full_page=True)
    page.goto(f"{live_url}/dashboard/fleet?from=2026-11-01&to=2026-11-30")
    assert page.locator("#fleet-classes rect.seg").count() == 3
    assert page.locator("#fleet-preemptions rect.seg").count() == 1
    assert page.locator("#fleet-places rect.seg").count() == 3
    assert page.locator("#fleet-effective circle.point").count() == 1
    page.screenshot(path=str(artifacts / "fleet.png"), full_page=True)
    page.goto(f"{live_url}/dashboard/")
    page.screenshot(path=str(artifacts / "jobs.png"), full_page=True)
    assert page.problems == []


def test_fleet_filters_survive_a_reload(page, live_url, artifacts: Path):
    page.goto(f"{live_url}/dashboard/fleet")
    page.fill("#from", "2026-11-01")
    page.fill("#to", "2026-11-30")
    page.select_option("#class", "node_lost")
    page.fill("#cloud", "gcp")
    page.click("#fleet-filter button[type=submit]")
    page.wait_for_url("**class=node_lost**")
    assert "cloud=gcp" in page.url and "from=2026-11-01" in page.url
    for _ in range(2):  # as shown, then after a reload
        assert page.locator("#class").input_value() == "node_lost"
        assert page.locator("#cloud").input_value() == "gcp"
        assert page.locator("#from").input_value() == "2026-11-01"
        assert "1 incident in 1 job" in page.locator("main").inner_text()
        page.reload()
    page.screenshot(path=str(artifacts / "fleet-filtered.png"), full_page=True)
    assert page.problems == []


def test_markup_in_a_job_name_is_shown_as_text(page, live_url, seeded_app, artifacts: Path):
    job = seeded_app.state.seeded["evil"]
    page.goto(f"{live_url}/dashboard/jobs/{job}")
    h1 = page.locator("h1").inner_text()
    assert h1.startswith("x<script>")  # the name's own characters, as text
    assert page.locator("main script, main img").count() == 0
    page.goto(f"{live_url}/dashboard/")
    assert "x<script>" in page.locator("main").inner_text()
    assert EVIL not in page.content()
    page.wait_for_timeout(2500)  # a live refresh has run: still nothing executed
    page.screenshot(path=str(artifacts / "jobs-hostile-name.png"), full_page=True)
    assert page.problems == []
