"""The dashboard in a real browser: Debian's chromium driven by Playwright, against
the app served by uvicorn on loopback (fixtures in conftest.py). Never downloads a
browser: without /usr/bin/chromium the test is skipped and says how to install it."""

from __future__ import annotations

import pytest

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
