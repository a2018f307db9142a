"""Dashboard pages rendered through the real app on SQLite and PostgreSQL."""

from __future__ import annotations

import re
from urllib.parse import quote

import pytest
from dashboard_seed import EVIL, client, login

from orchestrator.dashboard.auth import COOKIE

PAGES = ["/dashboard/", "/dashboard/fleet", "/dashboard/jobs/j-anything", "/dashboard/?offset=50"]


@pytest.mark.parametrize("path", PAGES, ids=["jobs", "fleet", "job", "jobs-page-2"])
def test_every_page_without_the_cookie_is_a_303_to_the_login(anonymous, path):
    r = anonymous.get(path)
    assert r.status_code == 303
    assert r.headers["location"] == f"/dashboard/login?next={quote(path, safe='')}"


def test_the_bearer_header_alone_does_not_open_the_dashboard(anonymous, seeded_app):
    bearer = {"Authorization": f"Bearer {seeded_app.state.token}"}
    r = anonymous.get("/dashboard/", headers=bearer)
    assert r.status_code == 303


def test_login_keeps_a_session_id_in_an_httponly_strict_cookie(anonymous, seeded_app):
    app = seeded_app
    r = anonymous.post(
        "/dashboard/login", data={"token": app.state.token, "next": "/dashboard/fleet"}
    )
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/fleet"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    for attr in ("HttpOnly", "SameSite=strict", "Path=/dashboard", "Max-Age="):
        assert attr.lower() in cookie.lower()
    assert app.state.token not in cookie  # the cookie is not the API token
    assert anonymous.get("/dashboard/fleet").status_code == 200


def test_the_login_form_comes_back_to_the_page_asked_for(anonymous):
    r = anonymous.get("/dashboard/login?next=%2Fdashboard%2Fjobs%2Fj-1")
    assert r.status_code == 200
    assert 'name="next" value="/dashboard/jobs/j-1"' in r.text


@pytest.mark.parametrize(
    ("token", "status", "message"),
    [("wrong", 401, "unknown or revoked"), ("  ", 400, "enter the operator token")],
    ids=["wrong", "blank"],
)
def test_a_bad_token_is_refused_with_the_form_again(anonymous, token, status, message):
    r = anonymous.post("/dashboard/login", data={"token": token})
    assert r.status_code == status and message in r.text
    assert "set-cookie" not in r.headers
    assert anonymous.get("/dashboard/").status_code == 303


@pytest.mark.parametrize(
    "target", ["//evil.example/", "https://evil.example/", "/dashboard\\..\\x", "/v1/jobs"]
)
def test_login_never_redirects_off_the_dashboard(anonymous, seeded_app, target):
    token = seeded_app.state.token
    r = anonymous.post("/dashboard/login", data={"token": token, "next": target})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/"


def test_a_cookie_the_service_never_issued_is_refused(anonymous):
    anonymous.cookies.set(COOKIE, "srs_" + "x" * 43, path="/dashboard")
    assert anonymous.get("/dashboard/").status_code == 303


def test_logout_ends_the_session(browser_client):
    assert browser_client.get("/dashboard/").status_code == 200
    r = browser_client.post("/dashboard/logout")
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
    assert browser_client.get("/dashboard/").status_code == 303


#: The one script a page may carry: our own file, refreshing a running job's live part.
LIVE_SCRIPT = '<script src="/dashboard/static/live.js" defer></script>'


def test_pages_allow_only_our_own_script_file_and_no_caching(browser_client, seeded):
    paths = ("/dashboard/", f"/dashboard/jobs/{seeded['good']}", "/dashboard/fleet")
    for path in (*paths, f"/dashboard/jobs/{seeded['evil']}"):
        r = browser_client.get(path)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self';" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert r.headers["cache-control"] == "no-store"
        assert "<script" not in r.text.replace(LIVE_SCRIPT, "").lower(), path
    # A finished job's page does not refresh at all; a running one does, JS or not.
    assert LIVE_SCRIPT not in browser_client.get(f"/dashboard/jobs/{seeded['good']}").text
    running = browser_client.get(f"/dashboard/jobs/{seeded['evil']}").text
    assert LIVE_SCRIPT in running
    assert '<noscript><meta http-equiv="refresh" content="15"></noscript>' in running


def test_jobs_page_lists_status_restarts_incidents_and_goodput(browser_client, seeded):
    page = browser_client.get("/dashboard/").text
    row = re.search(
        rf"<tr>\s*<td><a href=\"/dashboard/jobs/{seeded['good']}\">.*?</tr>", page, re.S
    )
    assert row is not None
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(0), re.S)
    text = [re.sub(r"<[^>]+>", "", c).strip() for c in cells]
    # job, name, status, nodes, restarts, incidents, effective, lost, submitted, reason
    assert text[1:8] == ["gpt-7b-spot", "SUCCEEDED", "2", "2", "2", "93.2%", "$5.25"]
    assert "RUNNING" in page  # the other job


def test_status_filter_narrows_the_list(browser_client, seeded):
    page = browser_client.get("/dashboard/?status=succeeded").text
    assert seeded["good"] in page and seeded["evil"] not in page
    bad = browser_client.get("/dashboard/?status=sleeping")
    assert bad.status_code == 400 and "unknown status" in bad.text


def test_job_page_shows_each_incident_with_its_mttr_breakdown(browser_client, seeded):
    page = browser_client.get(f"/dashboard/jobs/{seeded['good']}").text
    assert '<strong id="effective">93.2%</strong>' in page
    chart = re.search(r'<svg[^>]*id="mttr-chart".*?</svg>', page, re.S)
    assert chart is not None
    segments = re.findall(r'<rect[^>]*class="seg"><title>([^<]*)</title>', chart.group(0))
    # Seven steps per incident, each with its duration, in protocol order.
    assert segments[:7] == [
        "detect: 0.4 s",
        "signal: 1.2 s",
        "confirm_checkpoint: 38.0 s",
        "select_replacement: 3.1 s",
        "launch: 5.2 min",
        "stage: 1.6 min",
        "validate: 12.3 s",
    ]
    assert segments[7:] == [
        "detect: 30.0 s",
        "signal: 0.0 s",
        "confirm_checkpoint: 2.5 s",
        "select_replacement: 4.0 s",
        "launch: 4.0 min",
        "stage: 1.0 min",
        "validate: 9.5 s",
    ]
    launch = r'width="([\d.]+)" height="18" fill="#59a14f"'  # the launch step's colour
    widths = [float(w) for w in re.findall(launch, chart.group(0))]
    assert widths[0] > widths[1]  # the 310 s launch is drawn longer than the 242 s one
    incidents = re.search(r'<table class="incidents">.*?</table>', page, re.S).group(0)
    assert "preemption_notice" in incidents and "node_lost" in incidents
    assert "63" in incidents and "last 4263, resumed 4200" in incidents
    assert "$2.96" in incidents and "$2.30" in incidents
    assert 'id="timeline"' in page and page.count('class="attempt"') == 3


def test_live_job_shows_its_open_incident_as_ongoing(browser_client, seeded):
    page = browser_client.get(f"/dashboard/jobs/{seeded['evil']}").text
    assert "ongoing" in page and " so far" in page


def test_every_user_supplied_string_is_escaped(browser_client, seeded):
    for path in ("/dashboard/", f"/dashboard/jobs/{seeded['evil']}", "/dashboard/fleet?days=3650"):
        page = browser_client.get(path).text.replace(LIVE_SCRIPT, "")
        assert "<script" not in page.lower(), path
        assert "<img" not in page.lower(), path
        assert "&lt;script&gt;" in page, path
    job = browser_client.get(f"/dashboard/jobs/{seeded['evil']}").text
    assert "raise ValueError(&#39;&lt;script&gt;" in job  # the log tail, escaped
    assert EVIL not in job


def test_fleet_counts_incidents_by_class_and_by_placement(browser_client, seeded):
    page = browser_client.get("/dashboard/fleet?days=3650").text
    assert "3 incidents in 2 jobs" in page
    by_class = re.search(r'<svg[^>]*id="fleet-classes".*?</svg>', page, re.S).group(0)
    titles = re.findall(r"<title>([^<]*)</title>", by_class)
    assert any(t.endswith("(week): preemption_notice: 1") for t in titles)
    assert any(t.endswith("(week): node_lost: 1") for t in titles)
    by_place = re.search(r'<svg[^>]*id="fleet-places".*?</svg>', page, re.S).group(0)
    assert "aws us-east-1 p4d.24xlarge" in by_place
    assert "gcp us-central1 a2-highgpu-8g" in by_place
    assert "aws eu-west-1 p5.48xlarge" in by_place
    # A short window buckets by day, and leaves these November incidents out.
    assert browser_client.get("/dashboard/fleet?days=1").status_code == 200


def test_unknown_job_is_a_404_page(browser_client):
    r = browser_client.get("/dashboard/jobs/j-nope")
    assert r.status_code == 404 and "job j-nope not found" in r.text


def test_stylesheet_is_served_without_login(anonymous):
    r = anonymous.get("/dashboard/static/dashboard.css")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/css")


@pytest.mark.postgres
def test_pages_render_on_postgres(postgres_app):
    ids = postgres_app.state.seeded
    with client(postgres_app) as c:
        login(c, postgres_app.state.token)
        jobs = c.get("/dashboard/").text
        assert re.search(r"<td class=\"num\">2</td>\s*<td class=\"num\">93.2%</td>", jobs)
        job = c.get(f"/dashboard/jobs/{ids['good']}")
        assert job.status_code == 200 and 'id="mttr-chart"' in job.text
        assert "3 incidents in 2 jobs" in c.get("/dashboard/fleet?days=3650").text
        # An offset PostgreSQL cannot take (past 64 bits) is the caller's error, not ours.
        assert c.get(f"/dashboard/?offset={2**63}").status_code == 422


def test_running_job_shows_nodes_with_address_heartbeat_and_the_open_protocol(
    browser_client, seeded
):
    page = browser_client.get(f"/dashboard/jobs/{seeded['evil']}").text
    live = re.search(r'<div id="live".*?</table>', page, re.S).group(0)
    nodes = re.search(r'<table class="nodes".*?</table>', page, re.S).group(0)
    assert "10.0.1.0" in nodes and "10.0.1.1" in nodes  # each node's address
    assert "r0: 70" in nodes and "r1: 69" in nodes  # each rank's own step
    ages = re.findall(r'<td class="num">([^<]*)</td>\s*<td>(?:-|<span)', nodes)
    assert len(ages) == 2 and all(a.endswith(" d") for a in ages)  # beat a month ago
    assert 'data-live="/dashboard/jobs/' in live
    protocol = re.search(r'<table class="protocol".*?</table>', page, re.S).group(0)
    # The seeded incident has finished 3 steps and is in its 4th.
    assert protocol.count('<tr class="done">') == 3
    assert protocol.count('<tr class="running">') == 1
    assert protocol.count('<tr class="pending">') == 3


def test_each_series_chart_draws_every_sample_with_incident_and_checkpoint_marks(
    browser_client, seeded
):
    from dashboard_seed import SAMPLE_TIMES

    page = browser_client.get(f"/dashboard/jobs/{seeded['evil']}/live").text
    for chart, per_rank in (
        ("series-loss", len(SAMPLE_TIMES)),
        ("series-grad-norm", len(SAMPLE_TIMES)),
        ("series-steps", len(SAMPLE_TIMES) - 1),  # a rate needs two samples
    ):
        svg = re.search(rf'<svg[^>]*id="{chart}".*?</svg>', page, re.S).group(0)
        assert svg.count('class="point"') == 2 * per_rank, chart
        assert svg.count("<polyline") == 2, chart  # rank 0 and rank 1
        assert svg.count("<rect x=") >= 1 and "incident #" in svg, chart
        assert "checkpoint step 20" in svg, chart
    steps = re.search(r'<svg[^>]*id="series-steps".*?</svg>', page, re.S).group(0)
    assert ": 0.2 steps/s</title>" in steps  # 2 steps per 10 s


def test_the_live_fragment_is_the_section_alone_and_needs_the_login(
    browser_client, anonymous, seeded
):
    r = browser_client.get(f"/dashboard/jobs/{seeded['evil']}/live")
    assert r.status_code == 200 and "<html" not in r.text and 'class="nodes"' in r.text
    assert "&lt;script&gt;" in r.text and EVIL not in r.text
    assert anonymous.get(f"/dashboard/jobs/{seeded['evil']}/live").status_code == 303
    done = browser_client.get(f"/dashboard/jobs/{seeded['good']}/live").text
    assert 'data-final="1"' in done  # live.js stops polling a finished job


def _svg(page: str, chart_id: str) -> str:
    return re.search(rf'<svg[^>]*id="{chart_id}".*?</svg>', page, re.S).group(0)


def test_fleet_filters_narrow_every_chart_and_stay_in_the_form(browser_client, seeded):
    everything = browser_client.get("/dashboard/fleet?from=2026-11-01&to=2026-11-30").text
    assert "3 incidents in 2 jobs" in everything
    # Preemptions: only the notice on aws us-east-1 (node_lost is not a preemption).
    table = re.search(r'<table id="preemption-table">.*?</table>', everything, re.S).group(0)
    assert "aws us-east-1 p4d.24xlarge" in table and "gcp" not in table
    # Effective training time: one point per submission day of the seeded jobs.
    assert _svg(everything, "fleet-effective").count('class="point"') == 1

    page = browser_client.get(
        "/dashboard/fleet?from=2026-11-01&to=2026-11-30&class=node_lost&cloud=gcp"
    ).text
    assert "1 incident in 1 job" in page
    assert "node_lost: 1" in _svg(page, "fleet-classes")
    assert "preemption_notice" not in _svg(page, "fleet-classes")
    # The form shows the filters the URL holds, so submitting it again keeps them.
    assert '<option value="node_lost" selected>' in page
    assert 'id="cloud" name="cloud" size="6" value="gcp"' in page
    assert 'id="from" name="from" value="2026-11-01"' in page

    by_job = browser_client.get(f"/dashboard/fleet?days=3650&job={seeded['good']}").text
    assert "2 incidents in 1 job" in by_job
    by_region = browser_client.get("/dashboard/fleet?days=3650&region=eu-west-1").text
    assert "1 incident in 1 job" in by_region
    assert (
        "0 incidents in 0 jobs"
        in browser_client.get("/dashboard/fleet?from=2026-10-01&to=2026-10-31").text
    )


@pytest.mark.parametrize(
    "query", ["from=2026-13-01", "from=2026-11-30&to=2026-11-01", "job=<script>"], ids=str
)
def test_fleet_refuses_a_bad_filter_with_a_status_not_a_crash(browser_client, query):
    r = browser_client.get(f"/dashboard/fleet?{query}")
    assert r.status_code in (400, 422)
    # A 422 is JSON (never rendered as a page); an HTML answer never carries the input raw.
    assert r.headers["content-type"].startswith("application/json") or "<script>" not in r.text
