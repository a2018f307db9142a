"""The dashboard's pages, mounted on the service at ``/dashboard``.

Server-rendered HTML (Jinja2, autoescaped) with inline SVG charts and one CSS file:
no JavaScript and nothing fetched from another origin, so it works on an air-gapped
cluster and its Content-Security-Policy can forbid scripts outright.

Pages (all but the login and the stylesheet need the session cookie; without it they
answer 303 to the login form, which comes back to the page asked for):

* ``/dashboard/`` jobs with status, restarts, incidents and effective training time;
* ``/dashboard/jobs/{id}`` one job: its wall-time split, a timeline of attempts and
  incidents, each incident's MTTR by protocol step (stacked bars), steps lost and
  cost, and every failure event;
* ``/dashboard/fleet`` incidents of every job by class and by region / instance type
  over time.

Elastic runs: each attempt is a phase with the nodes it trained on (a shrunk one
marked, with its standby spares), and an ``elastic_grow`` incident is a planned
reshape: shown, labelled as one, and left out of every count of failures (the jobs
list's incidents, the fleet's failures by class and by place).

Reads only; the figures come from :mod:`orchestrator.store.goodput`, the incidents
from the one read model of them, :mod:`orchestrator.store.incidents`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from sqlalchemy import select

from orchestrator.api.deps import SessionDep
from orchestrator.api.schemas import MAX_OFFSET
from orchestrator.dashboard import auth, charts
from orchestrator.domain.failures import FailureClass
from orchestrator.domain.status import JobStatus
from orchestrator.store import repo
from orchestrator.store.goodput import JobGoodput, job_goodput
from orchestrator.store.incidents import (
    fleet_incident_records,
    fleet_incidents,
    incidents,
    is_planned,
)
from orchestrator.store.live_view import job_live
from orchestrator.store.models import FailureEvent, Job
from orchestrator.store.series import JobSeries, job_series

_HERE = Path(__file__).resolve().parent
_env = Environment(
    loader=FileSystemLoader(_HERE / "templates"),
    autoescape=select_autoescape(["html"]),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters["duration"] = charts.format_duration
_env.filters["pct"] = lambda x: "-" if x is None else f"{x:.1%}"
_env.filters["usd"] = lambda x: "unpriced" if x is None else f"${x:,.2f}"
_env.filters["dt"] = lambda d: "-" if d is None else _utc(d).strftime("%Y-%m-%d %H:%M:%S")
_env.globals["class_colour"] = charts.class_colour

#: Scripts only from our own origin (one file, live.js, which refreshes the live
#: section; no inline script, no eval); styles only from our own stylesheet; fetches
#: and form posts only here.
_CSP = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self'; "
    "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # same-origin, not no-referrer: under no-referrer a browser sends ``Origin: null``
    # on our own login form's POST, which the login-CSRF check must refuse (auth.py);
    # other sites still get no Referer at all.
    "Referrer-Policy": "same-origin",
}
_MAX_FORM_BYTES = 8192

#: A shrunk phase's bar on the timeline (the full-size ones are blue).
_SHRUNK_COLOUR = "#b07aa1"

#: Colours of the wall-time split.
_SPLIT_COLOURS = {
    "productive": "#59a14f",
    "failure (restart protocol)": "#e15759",
    "lost work (steps redone)": "#f28e2b",
    "checkpoint blocking": "#76b7b2",
    "idle (no attempt up)": "#bab0ac",
}


def _utc(d: datetime) -> datetime:
    return d if d.tzinfo else d.replace(tzinfo=UTC)


def _render(name: str, status_code: int = 200, **ctx: Any) -> HTMLResponse:
    html = _env.get_template(name).render(**ctx)
    return HTMLResponse(html, status_code=status_code, headers=_HEADERS)


def require_login(request: Request) -> None:
    if not auth.is_logged_in(request):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise HTTPException(
            303,
            "login required",
            headers={"Location": f"/dashboard/login?next={quote(target, safe='')}"},
        )


LoginDep = Depends(require_login)
public = APIRouter(prefix="/dashboard", include_in_schema=False)
pages = APIRouter(prefix="/dashboard", include_in_schema=False, dependencies=[LoginDep])


@public.get("/static/dashboard.css")
def stylesheet() -> Response:
    css = (_HERE / "static" / "dashboard.css").read_text()
    return Response(css, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


@public.get("/static/live.js")
def live_script() -> Response:
    js = (_HERE / "static" / "live.js").read_text()
    return Response(
        js,
        media_type="text/javascript",
        headers={"Cache-Control": "max-age=3600", "X-Content-Type-Options": "nosniff"},
    )


@public.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str | None = None) -> Response:
    if auth.is_logged_in(request):
        return RedirectResponse(auth.safe_next(next), 303)
    return _render("login.html", next=auth.safe_next(next), error=None)


@public.post("/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    if (foreign := auth.foreign_origin(request)) is not None:  # login CSRF (auth.py)
        refused = f"a login posted from another site ({foreign}) is refused"
        return _render("login.html", 403, next="/dashboard/", error=refused)
    body = await request.body()
    if len(body) > _MAX_FORM_BYTES:
        return _render("login.html", 413, next="/dashboard/", error="the form is too large")
    form = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True)
    token = (form.get("token") or [""])[0]
    target = auth.safe_next((form.get("next") or [""])[0])
    if not token.strip():
        return _render("login.html", 400, next=target, error="enter the operator token")
    session_id = auth.open_session(request, token)
    if session_id is None:
        return _render("login.html", 401, next=target, error="that token is unknown or revoked")
    response = RedirectResponse(target, 303)
    auth.set_session(request, response, session_id)
    return response


@pages.post("/logout")
def logout(request: Request) -> Response:
    """Ends the session on the server too: the old cookie opens nothing afterwards."""
    auth.end_session(request)
    response = RedirectResponse("/dashboard/login", 303)
    auth.clear_session(request, response)
    return response


@pages.get("/", response_class=HTMLResponse)
def jobs_page(
    session: SessionDep,
    status: Annotated[str | None, Query()] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> Response:
    chosen: JobStatus | None = None
    if status:
        try:
            chosen = JobStatus(status.upper())
        except ValueError:
            return _render(
                "error.html",
                400,
                title="unknown status",
                message=f"unknown status {status!r}; one of {', '.join(JobStatus)}",
            )
    limit = 50
    page = repo.list_jobs(session, status=chosen, limit=limit, offset=offset)
    ids = [j.id for j in page.items]
    # Failures and planned reshapes (elastic grows) apart: a grow is no failure.
    counts: Counter[str] = Counter()
    reshapes: Counter[str] = Counter()
    for r in fleet_incident_records(session, job_ids=ids):
        if r.has_protocol_steps:
            (reshapes if is_planned(r.event.failure_class) else counts)[r.event.job_id] += 1
    now = datetime.now(UTC)
    rows = []
    for j in page.items:
        report = job_goodput(session, j.id, now=now)
        rows.append(
            {
                "job": j,
                "nodes": (j.spec or {}).get("num_nodes", ""),
                "incidents": counts.get(j.id, 0),
                "reshapes": reshapes.get(j.id, 0),
                "effective": report.effective_training_fraction,
                "lost_usd": report.lost_usd,
            }
        )
    return _render(
        "jobs.html",
        rows=rows,
        total=page.total,
        offset=offset,
        limit=limit,
        status=chosen.value if chosen else "",
        statuses=[s.value for s in JobStatus],
        nav="jobs",
    )


def _job_charts(report: JobGoodput) -> dict[str, Any]:
    split = charts.split_bar(
        [
            (label, seconds, _SPLIT_COLOURS[label])
            for label, seconds in (
                ("productive", report.productive_seconds),
                ("failure (restart protocol)", report.failure_seconds),
                ("lost work (steps redone)", report.lost_work_seconds),
                ("checkpoint blocking", report.checkpoint_seconds),
                ("idle (no attempt up)", report.idle_seconds),
            )
        ]
    )
    attempts = []
    for a in report.attempts:
        end = a.ended_at or report.ended_at
        up = charts.format_duration((end - a.started_at).total_seconds())
        nodes = (
            f"{a.training_nodes} of {a.num_nodes} nodes (shrunk, {a.spare_nodes} standby "
            f"spare{'s' if a.spare_nodes > 1 else ''})"
            if a.shrunk
            else f"{a.num_nodes} x"
        )
        attempts.append(
            charts.Span(
                a.started_at,
                end,
                f"#{a.number} {a.cloud}"
                + (f" {a.training_nodes}/{a.num_nodes}" if a.shrunk else ""),
                _SHRUNK_COLOUR if a.shrunk else "#4e79a7" if a.ended_at else "#2f5d8a",
                f"attempt {a.number}: {a.cloud} {a.region} {nodes} {a.instance_type}, "
                f"up {up}" + (f", ended: {a.end_reason}" if a.end_reason else ", running"),
            )
        )
    incidents = [
        charts.Span(
            i.started_at,
            i.started_at + timedelta(seconds=i.mttr_seconds),
            i.failure_class + (" (planned)" if i.planned else ""),
            charts.class_colour(i.failure_class),
            f"incident {i.id}: {i.failure_class}"
            + (", a planned reshape, not a failure" if i.planned else "")
            + f", MTTR {charts.format_duration(i.mttr_seconds)}",
        )
        for i in report.incidents
    ]
    timeline = charts.timeline(attempts, incidents, report.started_at, report.ended_at)
    mttr = charts.mttr_chart(
        [
            charts.MttrRow(f"#{i.id} {i.failure_class}", i.mttr_seconds, i.step_seconds, i.ongoing)
            for i in report.incidents
        ]
    )
    return {"split": split, "timeline": timeline, "mttr": mttr if report.incidents else None}


#: Points per drawn series: more would only blur the line and slow the page.
_MAX_POINTS = 300
#: Above this many ranks, the charts draw the mean over ranks instead of each.
_MAX_RANK_LINES = 8


def _thin(pts: list[tuple[datetime, float]]) -> list[tuple[datetime, float]]:
    if len(pts) <= _MAX_POINTS:
        return pts
    stride = -(-len(pts) // _MAX_POINTS)
    return pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])


def _series_charts(data: JobSeries, start: datetime, end: datetime) -> dict[str, Any]:
    """Steps/s, loss and grad norm over the job's wall time, one line per rank (or the
    mean over ranks past 8), incidents and checkpoints marked on the same axis."""
    by_rank: dict[int, list[Any]] = defaultdict(list)
    for p in data.points:
        by_rank[p.rank].append(p)
    rate: dict[int, list[tuple[datetime, float]]] = defaultdict(list)
    for rank, pts in by_rank.items():
        for a, b in pairwise(pts):
            dt = (b.at - a.at).total_seconds()
            if b.attempt == a.attempt and dt > 0 and b.step >= a.step:
                rate[rank].append((b.at, (b.step - a.step) / dt))
            elif b.step_time:
                rate[rank].append((b.at, 1.0 / b.step_time))

    def lines(values: dict[int, list[tuple[datetime, float]]]) -> dict[str, list[Any]]:
        if len(values) <= _MAX_RANK_LINES:
            return {f"rank {r}": _thin(v) for r, v in sorted(values.items())}
        sums: dict[datetime, list[float]] = defaultdict(list)
        for v in values.values():
            for t, x in v:
                sums[t.replace(microsecond=0)].append(x)
        mean = [(t, sum(xs) / len(xs)) for t, xs in sorted(sums.items())]
        return {f"mean of {len(values)} ranks": _thin(mean)}

    def field(name: str) -> dict[int, list[tuple[datetime, float]]]:
        out: dict[int, list[tuple[datetime, float]]] = {}
        for rank, pts in by_rank.items():
            v = [(p.at, getattr(p, name)) for p in pts if getattr(p, name) is not None]
            if v:
                out[rank] = v
        return out

    marks = [charts.Band(m.at, m.end, m.kind, m.label) for m in data.marks]
    n = len(by_rank)
    return {
        "ranks": "" if not n else f"each of {n} ranks" if n <= _MAX_RANK_LINES else "mean",
        "steps": charts.line_chart(
            lines(rate), start, end, marks, "series-steps", "steps per second", " steps/s"
        ),
        "loss": charts.line_chart(lines(field("loss")), start, end, marks, "series-loss", "loss"),
        "grad_norm": charts.line_chart(
            lines(field("grad_norm")), start, end, marks, "series-grad-norm", "grad norm"
        ),
    }


def _live_context(session: Any, job: Any, report: JobGoodput) -> dict[str, Any]:
    recent = list(
        session.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job.id)
            .order_by(FailureEvent.occurred_at.desc(), FailureEvent.id.desc())
            .limit(10)
        )
    )
    data = job_series(session, job.id)
    # The axis spans what there is to draw (samples and marks), not the job's whole
    # life: a month-old job's last hour would otherwise be a sliver at the edge.
    times = [p.at for p in data.points] + [m.at for m in data.marks]
    times += [m.end for m in data.marks if m.end is not None]
    start = min(times, default=_utc(job.created_at))
    end = max(max(times, default=report.ended_at), start + timedelta(seconds=1))
    return {
        "live": job_live(session, job.id),
        "final": JobStatus(job.status).is_terminal(),
        "series": _series_charts(data, start, end),
        "recent": recent,
    }


@pages.get("/jobs/{job_id}/live", response_class=HTMLResponse)
def job_live_fragment(job_id: str, session: SessionDep) -> Response:
    """The live section alone, for live.js (the same template the page includes)."""
    try:
        job = repo.get_job(session, job_id)
    except repo.NotFound as e:
        return _render("error.html", 404, title="job not found", message=str(e))
    return _render("_live.html", **_live_context(session, job, job_goodput(session, job_id)))


@pages.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, session: SessionDep) -> Response:
    try:
        job = repo.get_job(session, job_id)
    except repo.NotFound as e:
        return _render("error.html", 404, title="job not found", message=str(e))
    report = job_goodput(session, job_id)
    # The remedy each incident got and what else it caused, from the incidents read model.
    recovered = {i["id"]: i for i in incidents(session, job_id)}
    events = list(
        session.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job_id)
            .order_by(FailureEvent.occurred_at, FailureEvent.id)
            .limit(2000)
        )
    )
    return _render(
        "job.html",
        job=job,
        spec=job.spec or {},
        transitions=repo.list_transitions(session, job_id),
        report=report,
        events=events,
        recovered=recovered,
        step_colours=charts.STEP_COLOURS,
        nav="jobs",
        **_job_charts(report),
        **_live_context(session, job, report),
    )


#: The classes a spot reclaim shows up as (with a notice, or the VM simply gone).
PREEMPTION_CLASSES = frozenset(
    {FailureClass.PREEMPTION_NOTICE.value, FailureClass.EXTERNAL_TERMINATION.value}
)
_DAY = r"^\d{4}-\d{2}-\d{2}$"
_FILTER_TEXT = r"^[A-Za-z0-9._\-]*$"


def _day(value: str | None) -> datetime | None:
    return None if not value else datetime.strptime(value, "%Y-%m-%d").replace(tzinfo=UTC)


@pages.get("/fleet", response_class=HTMLResponse)
def fleet_page(
    session: SessionDep,
    days: Annotated[int, Query(ge=1, le=3650)] = 30,
    start: Annotated[str | None, Query(alias="from", pattern=_DAY)] = None,
    until: Annotated[str | None, Query(alias="to", pattern=_DAY)] = None,
    job: Annotated[str | None, Query(max_length=63, pattern=_FILTER_TEXT)] = None,
    cls: Annotated[str | None, Query(alias="class", max_length=64, pattern=_FILTER_TEXT)] = None,
    cloud: Annotated[str | None, Query(max_length=32, pattern=_FILTER_TEXT)] = None,
    region: Annotated[str | None, Query(max_length=64, pattern=_FILTER_TEXT)] = None,
) -> Response:
    """Every filter is a query parameter of a GET form, so the URL is the view: a
    reload, a bookmark or a link shows the same page. ``from``/``to`` (days, UTC)
    override ``days``; ``job`` is a job id or name; class, cloud and region narrow
    the incidents (the effective-time chart follows the job filter only: a job has
    no single cloud)."""
    now = datetime.now(UTC)
    try:
        since = _day(start) or (now - timedelta(days=days)).replace(
            hour=0, minute=0, second=0, microsecond=0
        )
        last = _day(until)
        end = now if last is None else last + timedelta(days=1)
    except ValueError as e:
        return _render("error.html", 400, title="bad date", message=str(e))
    if end <= since:
        return _render("error.html", 400, title="bad range", message="'to' is before 'from'")
    span_days = max((end - since).days, 1)
    job_ids: list[str] | None = None
    if job:
        job_ids = list(
            session.scalars(select(Job.id).where((Job.id == job) | (Job.name == job)).limit(100))
        )
    every = [
        r
        for r in fleet_incidents(session, since=since, job_ids=job_ids)
        if r.occurred_at < end
        and (not cls or r.failure_class == cls)
        and (not cloud or r.cloud == cloud)
        and (not region or r.region == region)
    ]
    # An elastic grow is a planned reshape: counted apart, never as a failure.
    rows = [r for r in every if not is_planned(r.failure_class)]
    reshapes = len(every) - len(rows)
    width = timedelta(days=1 if span_days <= 62 else 7)
    n = int((end - since) / width) + 1
    buckets = [since + k * width for k in range(n)]

    def bucket(d: datetime) -> int:
        return min(max(int((d - since) / width), 0), n - 1)

    by_class: dict[str, list[int]] = {}
    present = {r.failure_class for r in rows}
    for c in [str(c) for c in FailureClass if str(c) in present] + sorted(
        present - {str(c) for c in FailureClass}
    ):
        by_class[c] = [0] * n
    for r in rows:
        by_class[r.failure_class][bucket(r.occurred_at)] += 1

    def place(r: Any) -> str:
        if r.region is None:
            return "unplaced"
        return f"{r.cloud} {r.region} {r.instance_type}"

    def by_place_of(selected: list[Any]) -> tuple[dict[str, list[int]], Counter[str]]:
        totals = Counter(place(r) for r in selected)
        top = [p for p, _ in totals.most_common(8)]
        out: dict[str, list[int]] = {p: [0] * n for p in top}
        if len(totals) > len(top):
            out["other"] = [0] * n
        for r in selected:
            p = place(r)
            out[p if p in top else "other"][bucket(r.occurred_at)] += 1
        return out, totals

    by_place, totals = by_place_of(rows)
    preempted = [r for r in rows if r.failure_class in PREEMPTION_CLASSES]
    by_preempt, preempt_totals = by_place_of(preempted)

    per_place: dict[str, Counter[str]] = defaultdict(Counter)
    for r in rows:
        per_place[place(r)][r.failure_class] += 1
    label = "day" if width.days == 1 else "week"
    class_chart = charts.stacked_columns(
        buckets,
        by_class,
        {c: charts.class_colour(c) for c in by_class},
        label,
        "fleet-classes",
        "incidents by class over time",
    )
    place_chart = charts.stacked_columns(
        buckets,
        by_place,
        charts.series_colours(list(by_place)),
        label,
        "fleet-places",
        "incidents by region and instance type over time",
    )
    preempt_chart = charts.stacked_columns(
        buckets,
        by_preempt,
        charts.series_colours(list(by_preempt)),
        label,
        "fleet-preemptions",
        "preemptions by region and instance type over time",
    )
    # Effective training time of the jobs submitted in each bucket: productive
    # seconds over wall seconds, summed (a long job weighs what it ran).
    jobs_q = select(Job.id).where(Job.created_at >= since, Job.created_at < end)
    if job_ids is not None:
        jobs_q = jobs_q.where(Job.id.in_(job_ids or [""]))
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for jid in session.scalars(jobs_q.order_by(Job.created_at).limit(500)):
        rep = job_goodput(session, jid, now=now)
        k = bucket(rep.started_at)
        sums[k][0] += rep.productive_seconds
        sums[k][1] += rep.wall_seconds
    effective = [
        (buckets[k] + width / 2, 100.0 * p / w) for k, (p, w) in sorted(sums.items()) if w > 0
    ]
    effective_chart = charts.line_chart(
        {"effective training time": effective},
        since,
        end,
        [],
        "fleet-effective",
        "effective training time over time (jobs by submission)",
        " %",
    )
    filters = {
        "days": days,
        "from": start or "",
        "to": until or "",
        "job": job or "",
        "class": cls or "",
        "cloud": cloud or "",
        "region": region or "",
    }
    return _render(
        "fleet.html",
        days=days,
        since=since,
        end=end,
        total=len(rows),
        jobs=len({r.job_id for r in rows}),
        reshapes=reshapes,
        class_chart=class_chart,
        place_chart=place_chart,
        preempt_chart=preempt_chart,
        effective_chart=effective_chart,
        preemptions=len(preempted),
        preempt_totals=preempt_totals.most_common(),
        class_totals=Counter(r.failure_class for r in rows).most_common(),
        place_totals=[(p, c, per_place[p].most_common()) for p, c in totals.most_common()],
        bucket=label,
        filters=filters,
        classes=[str(c) for c in FailureClass if not is_planned(str(c))],
        nav="fleet",
    )


router = APIRouter()
router.include_router(public)
router.include_router(pages)
