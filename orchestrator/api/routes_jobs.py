"""/v1/jobs and /v1/jobs/{id}/events."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from pydantic import BaseModel

from orchestrator.api.deps import OperatorDep, SessionDep
from orchestrator.api.limits import TOO_DEEP
from orchestrator.api.schemas import (
    MAX_CURSOR,
    MAX_OFFSET,
    EventIn,
    EventOut,
    EventPage,
    JobDetail,
    JobOut,
    JobPage,
)
from orchestrator.api.strict import StrictQueryRoute
from orchestrator.contract import EventKind
from orchestrator.domain.spec import (
    MAX_SPEC_BYTES,
    JobSpec,
    SpecError,
    load_yaml_document,
    task_spot_note,
    validate_job_spec,
    with_task_num_nodes,
)
from orchestrator.domain.status import IllegalTransition, JobStatus
from orchestrator.settings import Settings
from orchestrator.store import repo, submissions

router = APIRouter(prefix="/v1", dependencies=[OperatorDep], route_class=StrictQueryRoute)


def _spec_error(e: SpecError) -> HTTPException:
    detail = [{"loc": ["body", *filter(None, loc.split("."))], "msg": msg} for loc, msg in e.errors]
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)


class RenderOut(BaseModel):
    """``POST /v1/jobs/render``: the SkyPilot task a job's first launch would submit."""

    cluster_name: str
    placement: str
    task_yaml: str


@router.post("/jobs/render", response_model=RenderOut)
async def render_job(request: Request) -> RenderOut:
    """The SkyPilot task YAML the job's first launch would submit, as SkyPilot reads it
    (resources pinned to the planner's placement; the user's image, disk and ports
    kept): ``skyresume submit --dry-run``. Stores nothing, asks SkyPilot's API server
    nothing; 422 for a spec that is invalid, or that the launcher would refuse."""
    from starlette.concurrency import run_in_threadpool

    from orchestrator.launchers.base import LaunchError
    from orchestrator.launchers.skypilot import render_job as render
    from orchestrator.launchers.user_task import pin_stored_text

    read = await _read_spec(request)
    # The text just read, as a launch of the stored job would run it.
    spec = pin_stored_text(read.spec, read.task_yaml)
    state = request.app.state
    try:  # the catalog, planner and SkyPilot's Task (seconds): off the event loop
        out = await run_in_threadpool(
            render, spec, launcher=state.launcher, settings=state.settings
        )
    except LaunchError as e:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": ["body", "task"], "msg": str(e)}]
        ) from None
    return RenderOut(cluster_name=out.cluster_name, placement=out.placement,
                     task_yaml=out.task_yaml)  # fmt: skip


@dataclass(frozen=True)
class _Spec:
    """A submitted spec as the job stores it."""

    spec: JobSpec
    """Validated; a SkyPilot task's ``num_nodes`` filled in where the spec gave none."""
    task_yaml: str | None = None
    """The SkyPilot task's text as read now: what every launch of the job runs."""
    notes: tuple[str, ...] = ()
    """Which of the spec and the YAML decided nodes and spot, and each field of the
    task skyresume does not run: one line each, recorded as the job's events."""


async def _read_spec(request: Request) -> _Spec:
    """The request's job spec: JSON, or YAML with ``Content-Type: application/yaml``;
    413, 415 or 422 (naming the field) when it is not one."""
    body = await request.body()
    if len(body) > MAX_SPEC_BYTES:
        raise HTTPException(413, f"job spec is {len(body)} bytes; the limit is {MAX_SPEC_BYTES}")
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
    try:
        if ctype in ("application/yaml", "application/x-yaml", "text/yaml"):
            doc = load_yaml_document(body)
        elif ctype == "application/json":
            try:
                doc = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SpecError([("", f"unreadable JSON: {e}")]) from None
            except RecursionError:  # json.loads recurses: ~1,000 levels was a 500
                raise HTTPException(400, TOO_DEEP) from None
        else:
            raise HTTPException(415, f"unsupported content type {ctype!r}; use JSON or YAML")
        spec = validate_job_spec(doc)
    except SpecError as e:
        raise _spec_error(e) from None
    path = _confine_task_file(spec, request.app.state.settings)
    if path is None:
        return _Spec(spec)
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(_read_task_file, spec, path)  # imports sky


def _read_task_file(spec: JobSpec, path: Path) -> _Spec:
    """The spec's SkyPilot task, read once from ``path`` (the file the confinement
    checked, symlinks resolved) and checked with SkyPilot's own parser (a task
    SkyPilot rejects is never stored, so nothing of it is ever launched: #26 defect
    10); 422 naming ``task.skypilot_yaml`` when it cannot be, or naming ``num_nodes``
    when the YAML's count does not fit the spec's ``min_nodes``."""
    from orchestrator.launchers.base import LaunchError
    from orchestrator.launchers.user_task import check_task_text, read_task_text

    where = str(spec.task.skypilot_yaml)[:200]
    try:
        text = read_task_text(path, where)
        checked = check_task_text(
            text, where, envs=dict(spec.task.envs), secrets=dict(spec.task.secrets)
        )
    except LaunchError as e:
        raise _spec_error(SpecError([("task.skypilot_yaml", str(e)[:500])])) from None
    try:
        spec, nodes = with_task_num_nodes(spec, checked.num_nodes)
    except SpecError as e:
        raise _spec_error(e) from None
    # Stored as it was read: the absolute path names the file the text came from.
    spec = spec.model_copy(
        update={"task": spec.task.model_copy(update={"skypilot_yaml": str(path)})}
    )
    return _Spec(spec, checked.text, (nodes, task_spot_note(spec), *checked.notes))


def _confine_task_file(spec: JobSpec, settings: Settings) -> Path | None:
    """The resolved path of ``task.skypilot_yaml`` (None for a template job); 422
    unless it lies in ``settings.skypilot_yaml_dir`` once symlinks are resolved: the
    service reads that file, and a submitter must not make it read ``/etc/shadow`` or
    another user's task."""
    path = spec.task.skypilot_yaml if spec.task is not None else None
    if not path:
        return None
    root = settings.effective_skypilot_yaml_dir.resolve()
    try:
        resolved = Path(path).resolve()  # relative: against the service's cwd, once
    except (OSError, RuntimeError, ValueError) as e:
        raise _spec_error(SpecError([("task.skypilot_yaml", f"unusable path: {e}")])) from None
    if not resolved.is_relative_to(root):
        msg = (f"{path[:200]!r} is outside {root}, the directory task files are read from "
               "(SKYRESUME_SKYPILOT_YAML_DIR)")  # fmt: skip
        raise _spec_error(SpecError([("task.skypilot_yaml", msg)]))
    return resolved


#: What an ``Idempotency-Key`` may be: printable ASCII, at most 128 characters.
IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,128}$")


@router.post("/jobs", status_code=201, response_model=JobOut)
async def create_job(
    request: Request,
    session: SessionDep,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            pattern=IDEMPOTENCY_KEY.pattern,
            description="the same key and spec again (a retry) returns the job made then, "
            "with 200; the same key with another spec is 409",
        ),
    ] = None,
) -> JobOut:
    """Submit a job spec as JSON, or as YAML with ``Content-Type: application/yaml``.
    201: made; 200: the job an earlier submit with this ``Idempotency-Key`` made."""
    read = await _read_spec(request)
    try:
        done = submissions.submit_job(session, read.spec, idempotency_key,
                                      task_yaml=read.task_yaml)  # fmt: skip
    except submissions.KeyReused as e:
        raise HTTPException(409, str(e)) from None
    if done.created:
        for i, note in enumerate(read.notes):  # in the job's own transaction
            repo.record_event(session, done.job.id, idempotency_key=f"submit-note-{i}",
                              kind=EventKind.TASK_NOTE, message=note)  # fmt: skip
    else:
        response.status_code = 200
    return JobOut.model_validate(done.job, from_attributes=True)


@router.get("/jobs", response_model=JobPage)
def list_jobs(
    session: SessionDep,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> JobPage:
    page = repo.list_jobs(session, status=status_, limit=limit, offset=offset)
    items = [JobOut.model_validate(j, from_attributes=True) for j in page.items]
    return JobPage(items=items, total=page.total, limit=limit, offset=offset)


def _job_or_404(session: SessionDep, job_id: str):  # type: ignore[no-untyped-def]
    try:
        return repo.get_job(session, job_id)
    except repo.NotFound as e:
        raise HTTPException(404, str(e)) from None


@router.get("/jobs/{job_id}", response_model=JobDetail)
def get_job(job_id: str, session: SessionDep) -> JobDetail:
    job = _job_or_404(session, job_id)
    transitions = [
        {"from_status": t.from_status, "to_status": t.to_status, "reason": t.reason, "at": t.at}
        for t in repo.list_transitions(session, job_id)
    ]
    base = JobOut.model_validate(job, from_attributes=True).model_dump()
    return JobDetail(**base, transitions=transitions)


@router.post("/jobs/{job_id}/cancel", response_model=JobOut)
def cancel_job(job_id: str, session: SessionDep) -> JobOut:
    _job_or_404(session, job_id)
    try:
        job = repo.set_status(session, job_id, JobStatus.CANCELLED, reason="cancelled by operator")
    except IllegalTransition as e:
        raise HTTPException(409, str(e)) from None
    return JobOut.model_validate(job, from_attributes=True)


@router.get("/jobs/{job_id}/events", response_model=EventPage)
def list_events(
    job_id: str,
    session: SessionDep,
    after: Annotated[
        int, Query(ge=0, le=MAX_CURSOR, description="cursor: only events with a larger id")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventPage:
    _job_or_404(session, job_id)
    events = repo.list_events(session, job_id, after=after, limit=limit)
    items = [EventOut.model_validate(e, from_attributes=True) for e in events]
    return EventPage(items=items, next_cursor=items[-1].id if items else after)


@router.post(
    "/jobs/{job_id}/events",
    response_model=EventOut,
    status_code=201,
    responses={
        200: {
            "model": EventOut,
            "description": "The idempotency key was recorded before: the stored event",
        }
    },
)
def post_event(job_id: str, body: EventIn, session: SessionDep, response: Response) -> EventOut:
    """Record an event. Re-posting an idempotency key returns the stored event with 200."""
    _job_or_404(session, job_id)
    event, created = repo.record_event(session, job_id, **body.model_dump())
    if not created:
        response.status_code = 200
    return EventOut.model_validate(event, from_attributes=True)


@router.get("/events", response_model=EventPage)
def list_all_events(
    session: SessionDep,
    after: Annotated[
        int, Query(ge=0, le=MAX_CURSOR, description="cursor: only events with a larger id")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventPage:
    """Events of every job, oldest first."""
    items = [
        EventOut.model_validate(e, from_attributes=True)
        for e in repo.list_all_events(session, after=after, limit=limit)
    ]
    return EventPage(items=items, next_cursor=items[-1].id if items else after)
