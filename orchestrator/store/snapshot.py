"""The reconciler's snapshot of one job, read from the store (and the launcher).

``gather_snapshot`` builds the :class:`orchestrator.domain.reconcile.JobSnapshot`
that ``decide`` reads: the newest attempt with its nodes and ranks, the attempt's
failures, the open incident with what its steps decided, the job's earlier
incidents, the placement history of every job, and, only while a step needs them,
the checkpoint listing (CONFIRM) and the launcher's candidates (a placement to
choose). Those two are I/O against the checkpoint store and the provider's
catalog; a source that cannot be read is recorded as missing (an ``error``),
never as empty.

Nodes are read as the live view (``store.liveness``): a heartbeat this replica
accepted but has not flushed yet counts, so detection never sees a node as silent
because its beat sits in a batch; other replicas' beats are in SQL within their
flush interval.
Given a :class:`ProgressCache` (the reconciler keeps one across ticks), a node whose
row and beat are unchanged since the last snapshot keeps the view parsed then: at
2,048 nodes, decoding and parsing every node's progress on every tick was most of
the tick's time (``bench/tick.py``).

Read-only: nothing here writes to the store. A job's SkyPilot task reaches the
launcher as the text stored at submit (``jobs.task_yaml``, through a private copy:
``launchers.user_task.pin_stored_text``), never as the user's file again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Text, cast, select
from sqlalchemy.orm import Session

from orchestrator.contract import AttemptState, EventKind, NodeState
from orchestrator.domain import reconcile as rc
from orchestrator.domain.failures import FailureClass
from orchestrator.domain.plan import Placement, TrainingKnobs
from orchestrator.domain.planner import PLACEMENT_FAILURES, FailureRecord
from orchestrator.domain.protocol import ProtocolStep, StepOutcome
from orchestrator.domain.remedy import PastIncident
from orchestrator.domain.spec import JobSpec
from orchestrator.domain.status import JobStatus
from orchestrator.launchers.base import Launcher, LaunchHandle
from orchestrator.launchers.user_task import pin_stored_text
from orchestrator.store import intake, liveness, records, repo
from orchestrator.store.agents import held_ids
from orchestrator.store.models import Attempt, FailureEvent, Job, Node
from orchestrator.store.models import ProtocolStep as StepRow

log = logging.getLogger(__name__)

#: How far back the placement history reaches (the planner's weights decay long before).
HISTORY_WINDOW = timedelta(days=7)

#: A node's row as the snapshot reads it: columns, no ORM object, and the progress as
#: its stored text, decoded only when it changed (:class:`ProgressCache`).
NODE_COLUMNS = (
    Node.node_id,
    Node.node_rank,
    Node.attempt,
    Node.state,
    Node.address,
    Node.last_heartbeat_at,
    Node.registered_at,
    cast(Node.progress, Text).label("progress"),
)


#: One node as a snapshot saw it: what its progress view was made of (attempt, rank,
#: stored text, newer beat), what the rest of its view was made of, and the view.
_Seen = tuple[tuple[Any, ...], tuple[Any, ...], rc.NodeView]


class ProgressCache:
    """Each node's view as the last snapshot of its job parsed it, kept between ticks
    (the reconciler holds one): a node whose stored progress, attempt, rank and newer
    beat in memory are what they were is neither decoded nor parsed again.

    Measured (``bench/tick.py``, 2,048 nodes of 8 ranks): decoding every node's
    progress and building its ranks' views was most of a tick; a node beats once per
    period (8 s at that size), so most rows are unchanged from one tick to the next.
    The view is a function of that key alone, so reusing it changes no snapshot."""

    def __init__(self) -> None:
        self._jobs: dict[str, dict[str, _Seen]] = {}

    def of(self, job_id: str) -> dict[str, _Seen]:
        return self._jobs.get(job_id, {})

    def put(self, job_id: str, seen: dict[str, _Seen]) -> None:
        """The job's nodes as this snapshot read them (nodes gone are dropped with it)."""
        self._jobs[job_id] = seen

    def keep(self, job_ids: Iterable[str]) -> None:
        """Forget every job but these (the ones still reconciled)."""
        wanted = set(job_ids)
        for job_id in [j for j in self._jobs if j not in wanted]:
            del self._jobs[job_id]


def utc(dt: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; everything here is UTC."""
    if dt is None or dt.tzinfo is not None:
        return dt
    return dt.replace(tzinfo=UTC)


@dataclass
class Rows:
    """The rows the snapshot was built from, for the executors that write back."""

    job: Job
    spec: JobSpec
    attempt: Attempt | None


def handle_of(a: Attempt) -> LaunchHandle | None:
    h = a.handle
    if not h:
        return None
    return LaunchHandle(
        h["cluster_name"],
        h["launcher"],
        tuple(h.get("node_ids", ())),
        tuple(h.get("hosts", ())),
        str(h.get("request_id") or ""),
    )


def _handle(h: dict[str, Any], launcher: str) -> LaunchHandle:
    return LaunchHandle(
        h["cluster_name"],
        launcher,
        tuple(h.get("node_ids", ())),
        tuple(h.get("hosts", ())),
        str(h.get("request_id") or ""),
    )


def parts_of(a: Attempt) -> list[LaunchHandle]:
    """The launches an attempt runs on: one, or (the healthy nodes of the last attempt
    kept) the survivors restarted in place plus the replacements' launch."""
    h = a.handle
    if not h:
        return []
    parts = h.get("parts")
    if isinstance(parts, list) and parts:
        return [_handle(p, h["launcher"]) for p in parts if isinstance(p, dict)]
    return [_handle(h, h["launcher"])]


def handle_time(h: dict[str, Any] | None, key: str) -> datetime | None:
    """A time a launch handle records (``requested_at``, ``up_at``), or None."""
    raw = (h or {}).get(key)
    try:
        return utc(datetime.fromisoformat(raw)) if isinstance(raw, str) else None
    except ValueError:
        return None


def _progress(launcher: Launcher, parts: list[LaunchHandle], job_id: str) -> rc.LaunchProgress:
    """Every part's request, as one: up when all are, failed when one failed."""
    views = []
    for handle in parts:
        try:
            p = launcher.progress(handle)
        except Exception as e:  # the protocol says never raise; one that does is unread
            log.exception("job %s: launcher progress failed", job_id)
            return rc.LaunchProgress(rc.LaunchPhase.UNKNOWN, f"{type(e).__name__}: {e}")
        views.append(p)
    failed = next((v for v in views if v.phase is rc.LaunchPhase.FAILED), None)
    if failed is not None:
        return failed
    if views and all(v.phase is rc.LaunchPhase.UP for v in views):
        hosts = tuple(h for v in views for h in v.hosts)
        return rc.LaunchProgress(rc.LaunchPhase.UP, hosts=hosts)
    waiting = [v for v in views if v.phase is not rc.LaunchPhase.UP]
    return waiting[0] if waiting else rc.LaunchProgress(rc.LaunchPhase.UNKNOWN, "no launch")


def placement_of(a: Attempt) -> Placement:
    """The placement an attempt was recorded with (launching must not re-plan it)."""
    k = a.knobs or {}
    knobs = (
        TrainingKnobs(
            k["micro_batch"], k.get("grad_accum", 1), k.get("activation_checkpoint_every", 0)
        )
        if "micro_batch" in k
        else None
    )
    return Placement(
        cloud=a.cloud,
        region=a.region,
        instance_type=a.instance_type,
        accelerator=a.accelerator,
        accelerator_count=int(k.get("accelerator_count", 0)),
        num_nodes=a.num_nodes,
        spot=a.spot,
        zone=a.zone,
        gpu_memory_gib=k.get("gpu_memory_gib"),
        price_per_node_hour=a.price_per_node_hour,
        knobs=knobs,
    )


def attempt_row(s: Session, job_id: str, number: int) -> Attempt | None:
    return s.scalars(
        select(Attempt).where(Attempt.job_id == job_id, Attempt.number == number)
    ).first()


def _cls(value: str | None) -> FailureClass:
    try:
        return FailureClass(value or "unknown")
    except ValueError:
        return FailureClass.UNKNOWN


def gather_snapshot(
    s: Session,
    job_id: str,
    now: datetime,
    launcher: Launcher,
    parsed: ProgressCache | None = None,
) -> tuple[rc.JobSnapshot, Rows]:
    job = repo.get_job(s, job_id)
    # What was submitted, not what the file says now: edited or deleted after submit,
    # the YAML must change nothing of the job (its candidates and its launches).
    spec = pin_stored_text(JobSpec.model_validate(job.spec), job.task_yaml)
    attempt = s.scalars(
        select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number.desc())
    ).first()
    rows = Rows(job=job, spec=spec, attempt=attempt)
    view = None
    failures: tuple[rc.Failure, ...] = ()
    if attempt is not None:
        view = _attempt_view(s, job_id, attempt, now, launcher, parsed)
        ranks = {r.rank: n.node_id for n in view.nodes for r in n.ranks}
        failures = tuple(_failures(s, job_id, attempt.number, ranks))
        if view.spare is not None:
            # A spare's failures end the spare (``decide`` gives it back), never the
            # training group's attempt.
            ids, past = view.spare.node_ids, view.spare.past_ids
            view = replace(
                view,
                spare=replace(view.spare, failures=tuple(f for f in failures if f.node_id in ids)),
            )
            failures = tuple(f for f in failures if f.node_id not in ids | past)
    incident, past = _incidents(s, job_id)
    status = JobStatus(job.status)
    listing = None
    candidates: tuple[Any, ...] | None = None
    candidates_error = None
    if not status.is_terminal():
        nxt = _next_step(incident) if incident is not None else None
        if nxt is ProtocolStep.CONFIRM_CHECKPOINT:
            listing = _listing(spec.checkpoint.uri)
        needs_placement = (
            attempt is None
            or nxt is ProtocolStep.SELECT_REPLACEMENT
            or (view is not None and not view.launched and view.launch_failures)
        )
        if needs_placement:
            try:
                candidates = tuple(launcher.candidates(spec, replacement=attempt is not None))
            except Exception as e:  # an unreadable catalog is missing, not "no candidates"
                candidates_error = str(e) or type(e).__name__
    snap = rc.JobSnapshot(
        job_id=job_id,
        status=status,
        now=now,
        spec=spec,
        attempt=view,
        failures=failures,
        incident=incident,
        past_incidents=past,
        listing=listing,
        candidates=candidates,
        candidates_error=candidates_error,
        history=tuple(placement_history(s, now)),
        excluded_hosts=_excluded_hosts(s, job_id),
        poisoned=_poisoned(s, job_id),
        abilities=launcher.abilities,
        restarts_done=job.restart_count,
        blocking_save_s=_blocking_save_s(s, job_id),
        startup_s=_startups(s, job_id) + _validated_startups(s, job_id),
        provision_s=_provision_times(s, attempt) if attempt is not None else (),
        plain=_noticed_plain(s, job_id),
        degraded_noted=attempt is not None
        and intake.noted_degraded(s, job_id, utc(attempt.started_at) or now),
    )
    return snap, rows


def _provision_times(s: Session, a: Attempt, limit: int = 20) -> tuple[float, ...]:
    """Seconds from request to every node up of the newest fresh launches (any job's)
    in ``a``'s cloud and region: what a replacement there is expected to take."""
    out: list[float] = []
    rows = s.scalars(
        select(Attempt)
        .where(Attempt.cloud == a.cloud, Attempt.region == a.region)
        .order_by(Attempt.id.desc())
        .limit(limit * 4)
    )
    for r in rows:
        asked, up = handle_time(r.handle, "requested_at"), handle_time(r.handle, "up_at")
        if asked is None or up is None or records.launched_verb(r) is not rc.LaunchVerb.LAUNCH:
            continue
        out.append((up - asked).total_seconds())
        if len(out) >= limit:
            break
    return tuple(out)


def _int_or_none(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _startups(s: Session, job_id: str) -> tuple[float, ...]:
    """Each relaunch's measured start-up: LAUNCH's end (its nodes up) to VALIDATE's
    (every rank reported what it resumed from), for the job's validated relaunches."""
    ends: dict[int, dict[str, datetime]] = {}
    for r in s.scalars(
        select(StepRow).where(
            StepRow.job_id == job_id,
            StepRow.step.in_([str(ProtocolStep.LAUNCH), str(ProtocolStep.VALIDATE)]),
            StepRow.outcome == str(StepOutcome.OK),
        )
    ):
        at = utc(r.finished_at)
        # Only a VALIDATE that every rank's resume report ended measures a start-up (a
        # plain run's or a finished run's ends on something else).
        measured = (
            r.step != str(ProtocolStep.VALIDATE) or records.resume_validated(r.result) is not None
        )
        if at is not None and measured:
            ends.setdefault(r.incident_id, {})[r.step] = at
    out = []
    for e in ends.values():
        up, ok = e.get(str(ProtocolStep.LAUNCH)), e.get(str(ProtocolStep.VALIDATE))
        if up is not None and ok is not None and ok >= up:
            out.append((ok - up).total_seconds())
    return tuple(out)


def _validated_startups(s: Session, job_id: str) -> tuple[float, ...]:
    """Each validated attempt's start-up, the first one's included: its handle's
    ``up_at`` (every node up) to ``validated_at`` (every rank's resume report)."""
    out = []
    for a in s.scalars(select(Attempt).where(Attempt.job_id == job_id)):
        up, ok = handle_time(a.handle, "up_at"), handle_time(a.handle, "validated_at")
        if up is not None and ok is not None and ok >= up:
            out.append((ok - up).total_seconds())
    return tuple(out)


def _noticed_plain(s: Session, job_id: str) -> bool:
    return (
        s.scalars(
            select(FailureEvent.id)
            .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.PLAIN_SCRIPT)
            .limit(1)
        ).first()
        is not None
    )


def _blocking_save_s(s: Session, job_id: str) -> float | None:
    """The longest save that blocked training among the job's last five checkpoints."""
    saves = [
        float(e.details["blocking_s"])
        for e in s.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.CHECKPOINT)
            .order_by(FailureEvent.id.desc())
            .limit(5)
        )
        if isinstance((e.details or {}).get("blocking_s"), int | float)
    ]
    return max(saves) if saves else None


def _next_step(inc: rc.IncidentView) -> ProtocolStep | None:
    from orchestrator.domain.protocol import ORDER

    return next(
        (p for p in ORDER if inc.steps.get(p) is None or inc.steps[p].outcome is None), None
    )


def _listing(uri: str) -> rc.CheckpointListing:
    from orchestrator.cloud.storage import StorageError, list_checkpoints

    uri = uri.rstrip("/")
    try:
        found = list_checkpoints(uri)
    except (StorageError, OSError) as e:
        return rc.CheckpointListing(uri, error=str(e))
    complete = [c for c in found if c.complete]
    return rc.CheckpointListing(
        uri, tuple(c.step for c in complete), {c.step: c.digest for c in complete}
    )


def _progress_view(n: Any, prog: dict[str, Any]) -> rc.NodeView:
    """What a node's progress says (its ranks, its own checkpoint, its address) as a
    view of it; :func:`_attempt_view` fills in the rest on every tick."""
    ranks = tuple(
        rc.RankView(
            rank=int(r.get("rank", -1)),
            step=r.get("step"),
            resumed_step=(r.get("resumed") or {}).get("step"),
            resumed_digest=(r.get("resumed") or {}).get("manifest_digest"),
            report_age_s=r.get("report_age_s"),
            step_time=r.get("step_time") if isinstance(r.get("step_time"), int | float) else None,
            exit_code=r.get("exit_code") if isinstance(r.get("exit_code"), int) else None,
            signal=r.get("signal") if isinstance(r.get("signal"), str) else None,
            cpu_idle_s=r.get("cpu_idle_s")
            if isinstance(r.get("cpu_idle_s"), int | float)
            else None,
            max_steps=_int_or_none(r.get("max_steps")),
            regrouping=_int_or_none(r.get("regrouping")),
        )
        for r in prog.get("ranks", []) or []
        if isinstance(r, dict)
    )
    return rc.NodeView(
        node_id=n.node_id,
        node_rank=n.node_rank,
        last_heartbeat_at=None,
        alive=None,
        own_found=own.get("found")
        if isinstance(own := prog.get("own_checkpoint"), dict)
        and isinstance(own.get("found"), bool)
        else None,
        ranks=ranks,
        address=prog.get("client_ip") if isinstance(prog.get("client_ip"), str) else None,
    )


def _attempt_view(
    s: Session,
    job_id: str,
    a: Attempt,
    now: datetime,
    launcher: Launcher,
    parsed: ProgressCache | None = None,
) -> rc.AttemptView:
    handle = handle_of(a)
    plan = records.launch_plan_of(a)
    every_part = parts_of(a)
    # A shrunk attempt (``LaunchVerb.SHRINK``): its first ``train_nodes`` nodes train;
    # the launch named ``spare_cluster`` holds the standby replacements beside them.
    # An attempt placed on fewer nodes that asked for its replacements since is one too;
    # earlier tries' standby launches (``spare_past``, given back) are neither.
    train = plan.train_nodes if plan.spares_beside else None
    spare_parts = [
        p for p in every_part if train is not None and p.cluster_name == plan.spare_cluster
    ]
    past_parts = [p for p in every_part if p.cluster_name in plan.spare_past]
    parts = [p for p in every_part if p not in spare_parts and p not in past_parts]
    spare_ids = {x for p in spare_parts for x in p.node_ids}
    past_ids = {x for p in past_parts for x in p.node_ids}
    nodes = s.execute(
        select(*NODE_COLUMNS).where(Node.job_id == job_id, Node.attempt == a.number)
    ).all()
    # By the attempt the exit was reported in: a node a warm shrink carried keeps the
    # id it was launched with (``{job}-a1-n0`` in attempt 2).
    exits = {
        e.node_id: e
        for e in s.scalars(
            select(FailureEvent).where(
                FailureEvent.job_id == job_id,
                FailureEvent.kind == EventKind.NODE_EXIT,
                FailureEvent.node_id.in_([n.node_id for n in nodes]),
            )
        )
        if of_attempt(e, job_id, a.number)
    }
    up_at = handle_time(a.handle, "up_at")
    provision = None
    if handle is not None and up_at is None and a.state != AttemptState.ENDED:
        provision = _progress(launcher, parts, job_id)
    alive_ids: set[str] | None = None
    if handle is not None and up_at is not None and a.state != AttemptState.ENDED:
        try:
            alive_ids = set()
            for part in (*parts, *spare_parts):
                st = launcher.status(part)
                if st.state == "unknown":
                    alive_ids = None
                    break
                alive_ids.update(st.nodes_up)
        except Exception:  # a launcher that cannot be read is not a dead cluster
            alive_ids = None
            log.exception("job %s: launcher status failed", job_id)
    hosts = dict(zip(handle.node_ids, handle.hosts, strict=False)) if handle is not None else {}
    views = []
    # The live view: this replica's heartbeats not yet flushed are newer than SQL, and
    # a node must never look silent because its beat is sitting in a batch.
    live = liveness.live_of(s)
    held_warm = held_ids(a)
    seen: dict[str, _Seen] = {}
    last_seen = parsed.of(job_id) if parsed is not None else {}
    for n in nodes:
        sql_at = utc(n.last_heartbeat_at)
        beat = liveness.newer_beat(live, job_id, n.node_id, n.attempt, sql_at)
        ev = exits.get(n.node_id)
        last = (beat.at if beat is not None else sql_at) or utc(n.registered_at)
        alive = None if alive_ids is None else n.node_id in alive_ids
        exited = ev is not None or liveness.seen_state(n.state, beat) == NodeState.EXITED
        host = hosts.get(n.node_id) or n.address
        held = n.node_id in held_warm
        # What the view is made of: the progress (its stored text and any newer beat in
        # memory), then the rest (an exit event's row is never updated: its id names it).
        key = (n.attempt, n.node_rank, n.progress, beat)
        rest = (last, alive, exited, ev.id if ev is not None else None, host, held)
        known = last_seen.get(n.node_id)
        if known is not None and known[0] == key and known[1] == rest:
            view = known[2]  # unchanged since the last tick: 2,048 nodes a tick (issue 25)
        else:
            if known is not None and known[0] == key:
                base = known[2]  # the same progress: not decoded or parsed again
            else:
                stored = json.loads(n.progress) if n.progress else {}
                base = _progress_view(n, liveness.seen_progress(stored or {}, beat))
            view = replace(
                base,
                last_heartbeat_at=last,
                alive=alive,
                exited=exited,
                exit_code=(ev.details or {}).get("exit_code") if ev is not None else None,
                saved_step=_int_or_none((ev.details or {}).get("saved_step"))
                if ev is not None
                else None,
                exit_reason=str((ev.details or {}).get("reason") or ev.message or "")
                if ev is not None
                else "",
                host=host,
                held=held,
            )
        seen[n.node_id] = (key, rest, view)
        views.append(view)
    if parsed is not None:
        parsed.put(job_id, seen)
    beyond = [v for v in views if train is not None and v.node_rank >= train]
    first_spare = plan.first_spare_rank()
    spare_views = [v for v in beyond if v.node_rank >= first_spare]
    past_ids.update(v.node_id for v in beyond if v.node_rank < first_spare)
    views = [v for v in views if v not in beyond]
    spare_ids.update(v.node_id for v in spare_views)
    registered = {v.node_id for v in views} | spare_ids | past_ids
    vanished = tuple(
        n
        for n in (handle.node_ids if handle is not None else ())
        if alive_ids is not None and n not in alive_ids and n not in registered
    )
    failed_launches = tuple(
        rc.LaunchFailure(
            at=utc(e.occurred_at) or now,
            cloud=str((e.details or {}).get("cloud", "")),
            region=str((e.details or {}).get("region", "")),
            instance_type=str((e.details or {}).get("instance_type", "")),
            capacity=bool((e.details or {}).get("capacity")),
            message=e.message or "",
            retryable=(e.details or {}).get("retryable", True) is not False,
            verb=records.failed_verb(e.details or {}),
        )
        for e in s.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.LAUNCH_FAILED)
            .order_by(FailureEvent.id)
        )
        if (e.details or {}).get("attempt") == a.number
    )
    staged = tuple(
        rc.StagedView(
            node_id=str(d.get("node_id") or e.node_id or ""),
            ok=bool(d.get("ok")),
            step=d.get("step") if isinstance(d.get("step"), int) else None,
            detail=str(d.get("detail") or ""),
            bytes=int(d.get("bytes") or 0),
            seconds=float(d.get("seconds") or 0.0),
        )
        for e in s.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.STAGED)
            .order_by(FailureEvent.id)
        )
        for d in [e.details or {}]
        if d.get("attempt") == a.number
        and str(d.get("node_id") or e.node_id or "") not in spare_ids | past_ids
    )
    spare = None
    if train is not None:
        released = plan.spare_released is not None or not spare_parts
        progress = (
            None
            if released or a.state == AttemptState.ENDED
            else _progress(launcher, spare_parts, job_id)
        )
        up = progress is not None and progress.phase is rc.LaunchPhase.UP
        spare = rc.SpareView(
            count=plan.spare_count_of(a.num_nodes),
            nodes=tuple(sorted(spare_views, key=lambda v: v.node_rank)),
            progress=None if up else progress,
            up=up,
            released=released,
            node_ids=frozenset(spare_ids),
            tries=plan.tries,
            asked_at=plan.spare_asked_at,
            released_at=plan.spare_released_at,
            past_ids=frozenset(past_ids - spare_ids),
        )
    return rc.AttemptView(
        requested_at=handle_time(a.handle, "requested_at"),
        up_at=up_at,
        provision=provision,
        staged=staged,
        vanished=vanished,
        number=a.number,
        state=a.state,
        started_at=utc(a.started_at) or now,
        num_nodes=train if train is not None else a.num_nodes,
        full_nodes=train + spare.count if train is not None and spare is not None else None,
        spare=spare,
        ranks_per_node=int((a.knobs or {}).get("ranks_per_node", 1)),
        expected_step=a.resume_step,
        validated_step=a.validated_step,
        launched=handle is not None,
        nodes=tuple(sorted(views, key=lambda v: v.node_rank)),
        placement=placement_of(a),
        launch_failures=failed_launches,
        hosts=hosts,
        verb=plan.verb,
        keep=plan.keep,
        launches=max(1, len(parts)),
    )


def of_attempt(e: FailureEvent, job_id: str, number: int) -> bool:
    """Whether event ``e`` belongs to attempt ``number``: the attempt it was reported in
    (``details["attempt"]``); only an event without one is placed by its node id's
    ``-a{N}-`` (a node carried warm keeps the id of the attempt that launched it)."""
    named = (e.details or {}).get("attempt")
    if isinstance(named, int):
        return named == number
    return e.node_id is not None and e.node_id.startswith(f"{job_id}-a{number}-")


def _failures(
    s: Session, job_id: str, number: int, nodes_of_ranks: dict[int, str]
) -> list[rc.Failure]:
    rows = s.scalars(
        select(FailureEvent)
        .where(
            FailureEvent.job_id == job_id,
            FailureEvent.kind.in_(sorted(rc.FAILURE_KINDS)),
        )
        .order_by(FailureEvent.id)
    )
    out = []
    for e in rows:
        if not of_attempt(e, job_id, number):
            continue
        d = e.details or {}
        code = d.get("exit_code")
        if e.kind == EventKind.RANK_EXIT and code in rc.CLEAN_EXITS and not d.get("signal"):
            continue
        cls = _cls(e.failure_class)
        if e.kind == EventKind.HEALTH_CHECK and cls is not FailureClass.HEALTH_CHECK_FAILED:
            continue  # checks that passed
        if e.kind == EventKind.ANOMALY and e.failure_class is None:
            continue
        step = d.get("onset_step", d.get("step")) if e.kind == EventKind.ANOMALY else None
        rank, node_id = e.rank, e.node_id
        slow = (
            (d.get("detail") or {}).get("slow_rank") if isinstance(d.get("detail"), dict) else None
        )
        if cls is FailureClass.SLOW_PEER and isinstance(slow, int):
            # Rank 0 reports every straggler: the failure is the slow rank's, on its node.
            rank, node_id = slow, nodes_of_ranks.get(slow, node_id)
        out.append(
            rc.Failure(
                event_id=e.id,
                kind=e.kind,
                failure_class=cls,
                occurred_at=utc(e.occurred_at) or repo.utcnow(),
                node_id=node_id,
                rank=rank,
                exit_code=code if isinstance(code, int) else None,
                message=e.message or "",
                signature=d.get("signature") if isinstance(d.get("signature"), str) else None,
                step=step if isinstance(step, int) else None,
            )
        )
    return out


def _step_views(
    s: Session, incident_id: int
) -> tuple[dict[ProtocolStep, rc.StepView], dict[ProtocolStep, dict[str, Any]]]:
    """The incident's steps, and the stored result of each that has one."""
    views: dict[ProtocolStep, rc.StepView] = {}
    results: dict[ProtocolStep, dict[str, Any]] = {}
    for r in s.scalars(select(StepRow).where(StepRow.incident_id == incident_id)):
        step = ProtocolStep(r.step)
        views[step] = rc.StepView(
            started_at=utc(r.started_at) or repo.utcnow(),
            finished_at=utc(r.finished_at),
            outcome=StepOutcome(r.outcome) if r.outcome else None,
            detail=r.detail or "",
        )
        if r.result:
            results[step] = dict(r.result)
    return views, results


def _incidents(s: Session, job_id: str) -> tuple[rc.IncidentView | None, tuple[PastIncident, ...]]:
    """The open incident (VALIDATE not finished) and every earlier one."""
    rows = list(
        s.scalars(
            select(FailureEvent)
            .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.INCIDENT)
            .order_by(FailureEvent.id)
        )
    )
    past = []
    open_view = None
    for k, inc in enumerate(rows):
        d = inc.details or {}
        signature = d.get("signature") if isinstance(d.get("signature"), str) else None
        onset = d.get("onset_step") if isinstance(d.get("onset_step"), int) else None
        if k == len(rows) - 1:
            steps, results = _step_views(s, inc.id)
            validate = steps.get(ProtocolStep.VALIDATE)
            if validate is None or validate.finished_at is None:
                confirmed = results.get(ProtocolStep.CONFIRM_CHECKPOINT)
                selected = results.get(ProtocolStep.SELECT_REPLACEMENT)
                open_view = rc.IncidentView(
                    event_id=inc.id,
                    attempt=int(d.get("attempt", 0)),
                    failure_class=_cls(inc.failure_class),
                    steps=steps,
                    node_id=inc.node_id,
                    host=d.get("host") if isinstance(d.get("host"), str) else None,
                    signature=signature,
                    onset_step=onset,
                    confirmed=records.confirmed_from_json(confirmed) if confirmed else None,
                    selection=records.selection_from_json(selected) if selected else None,
                )
                continue
        past.append(PastIncident(_cls(inc.failure_class), signature, onset))
    return open_view, tuple(past)


def _excluded_hosts(s: Session, job_id: str) -> frozenset[str]:
    """Every host an earlier SELECT of this job excluded: a bad host stays bad."""
    out: set[str] = set()
    for r in s.scalars(
        select(StepRow).where(
            StepRow.job_id == job_id, StepRow.step == str(ProtocolStep.SELECT_REPLACEMENT)
        )
    ):
        if r.result:
            out.update(records.selection_from_json(r.result).exclude_hosts)
    return frozenset(out)


def _poisoned(s: Session, job_id: str) -> frozenset[tuple[int, str]]:
    """Checkpoints earlier rollbacks of this job went past (CONFIRM results)."""
    out: set[tuple[int, str]] = set()
    for r in s.scalars(
        select(StepRow).where(
            StepRow.job_id == job_id, StepRow.step == str(ProtocolStep.CONFIRM_CHECKPOINT)
        )
    ):
        if r.result:
            out.update(records.confirmed_from_json(r.result).poisoned.items())
    return frozenset(out)


def placement_history(s: Session, now: datetime) -> list[FailureRecord]:
    """Placement failures of every job in the window: incidents that took nodes away
    (preemptions, lost nodes) at the failed attempt's placement, and launches the
    provider refused for capacity. The planner weighs and cools regions with it, the
    same for ``skyresume plan`` (through the API) and the live SELECT."""
    since = now - HISTORY_WINDOW
    out: list[FailureRecord] = []
    attempts = {(a.job_id, a.number): a for a in s.scalars(select(Attempt))}
    for e in s.scalars(
        select(FailureEvent).where(
            FailureEvent.kind.in_([EventKind.INCIDENT, EventKind.LAUNCH_FAILED]),
            FailureEvent.occurred_at >= since,
        )
    ):
        d = e.details or {}
        at = utc(e.occurred_at) or now
        if e.kind == EventKind.LAUNCH_FAILED:
            if d.get("capacity"):
                out.append(
                    FailureRecord(
                        str(d.get("cloud", "")),
                        str(d.get("region", "")),
                        str(d.get("instance_type", "")),
                        at,
                        str(FailureClass.CAPACITY_UNAVAILABLE),
                        num_nodes=n if isinstance(n := d.get("num_nodes"), int) else None,
                    )
                )
            continue
        if e.failure_class not in PLACEMENT_FAILURES:
            continue
        a = attempts.get((e.job_id, int(d.get("attempt", 0))))
        if a is not None:
            out.append(FailureRecord(a.cloud, a.region, a.instance_type, at, str(e.failure_class)))
    return out
