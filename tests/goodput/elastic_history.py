"""An elastic run's history (issue 20) as the reconciler writes it, through the models.

A 3-node job with ``min_nodes: 2`` (p4d.24xlarge spot, $11.57 a node-hour) loses a
node at 3,600 s. Its incident's SELECT chose a shrink: attempt 2 is placed for 3
nodes (``num_nodes``) and its first 2 train (``train_nodes``) while the replacement
launches beside them as a standby spare (``spare_cluster``, node rank 2, no ranks).
Then either

* ``grown_job``: the spare registered; at 5,000 s a grow (``elastic_grow``, a planned
  reshape) restarts the 3 nodes in place as attempt 3, which runs to 9,000 s;
* ``spare_lost_job``: the spare vanished at 4,000 s (an ``elastic`` event, the plan's
  ``spare_released``) and the 2 nodes train on shrunk to 9,000 s;
* ``spare_refused_job``: the standby launch was refused at once (no ``spare_cluster``):
  nothing was billed for it.

The run's series (``progress_samples``) has two ranks of attempts 1 and 2: 0.5 steps
a second on 3 nodes, 1/3 on 2 (the global batch kept: each step does half as much
again per rank). Attempt 3 has no samples, only its heartbeats' 1.9 s step time.

Times are seconds after ``goodput_history.T0``; every figure a test checks is derived
in the docstring of the constant it comes from.
"""

from __future__ import annotations

from collections.abc import Sequence

from goodput_history import JobHistory, at, steps_end
from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.domain import reconcile as rc
from orchestrator.domain.plan import Placement
from orchestrator.domain.policy import RecoveryAction
from orchestrator.domain.protocol import ProtocolStep
from orchestrator.domain.status import JobStatus
from orchestrator.store import records
from orchestrator.store.models import Attempt, Node, ProgressSample
from orchestrator.store.models import ProtocolStep as StepRow

P = ProtocolStep
PRICE = 11.57

#: The node loss that shrinks: nothing to signal, the survivors restart at once.
SHRINK_STEPS: tuple[tuple[ProtocolStep, float], ...] = (
    (P.DETECT, 30.0),
    (P.SIGNAL, 0.0),
    (P.CONFIRM_CHECKPOINT, 2.5),
    (P.SELECT_REPLACEMENT, 4.0),
    (P.STAGE, 0.0),
    (P.LAUNCH, 20.0),
    (P.VALIDATE, 9.5),
)
#: The grow: a save at the step boundary, every node restarted in place.
GROW_STEPS: tuple[tuple[ProtocolStep, float], ...] = (
    (P.DETECT, 0.5),
    (P.SIGNAL, 1.0),
    (P.CONFIRM_CHECKPOINT, 3.0),
    (P.SELECT_REPLACEMENT, 0.2),
    (P.STAGE, 0.0),
    (P.LAUNCH, 15.0),
    (P.VALIDATE, 8.0),
)

LOST_AT = 3600.0
#: Attempt 2 is recorded when SELECT finished (3,636.5 s); its group is up after the
#: survivors' restart (3,656.5 s) and trains once VALIDATE ended (3,666 s).
SHRUNK_START = steps_end(LOST_AT, SHRINK_STEPS[:4])
SHRUNK_UP = SHRUNK_START + 20.0
GROW_AT = 5000.0
#: Attempt 2 ends when the grow releases it, after its save (5,030 s).
SHRUNK_END = 5030.0
GROWN_START = steps_end(GROW_AT, GROW_STEPS[:4])  # 5,004.7 s
END = 9000.0
SPARE_LOST_AT = 4000.0


PLACEMENT = Placement("aws", "us-east-1", "p4d.24xlarge", "A100:8", 8, 3, True,
                      price_per_node_hour=PRICE)  # fmt: skip


def _select_result(session: Session, incident_id: int, selection: rc.Selection) -> None:
    """SELECT's result, stored as the reconciler stores it (``records.result_json``)."""
    row = session.scalars(
        select(StepRow).where(
            StepRow.incident_id == incident_id, StepRow.step == P.SELECT_REPLACEMENT.value
        )
    ).one()
    row.result = records.result_json(selection)
    session.flush()


def _samples(
    session: Session, h: JobHistory, attempt: int, times: Sequence[float], first: int, per: int
) -> None:
    """Two ranks' samples, rank 1 a step behind rank 0: ``per`` steps between samples."""
    for rank in (0, 1):
        for k, t in enumerate(times):
            session.add(
                ProgressSample(
                    job_id=h.id, attempt=attempt, node_id=f"{h.id}-a{attempt}-n0", rank=rank,
                    at=at(t), step=first + per * k - rank, step_time=None, loss=None,
                    grad_norm=None,
                )
            )  # fmt: skip


def _shrunk_start(session: Session, name: str) -> tuple[JobHistory, Attempt, int]:
    """Submitted, attempt 1 on 3 nodes, the node loss, attempt 2 shrunk to 2 + a spare."""
    h = JobHistory(session, name, num_nodes=3, min_nodes=2)
    h.status(JobStatus.PROVISIONING, 60)
    h.attempt(1, 100, LOST_AT + 20, nodes=3, up=160, end_reason="node lost", last_step=1700,
              step_time=2.0)  # fmt: skip
    h.status(JobStatus.RUNNING, 170)
    # 0.5 steps a second: 50 steps every 100 s from 200 s to 3,500 s.
    _samples(session, h, 1, [200.0 + 100 * k for k in range(34)], 50, 50)
    lost = h.incident(
        LOST_AT, "node_lost", SHRINK_STEPS, last_step=1700, attempt=1, cause_kind="node_lost",
        message="no heartbeat from node 2 for 30 s",
    )  # fmt: skip
    _select_result(session, lost.id, rc.Selection(
        RecoveryAction.REPLACE_NODE_BLOCK_REGION, PLACEMENT, rc.LaunchVerb.SHRINK,
        keep=(f"{h.id}-a1-n0", f"{h.id}-a1-n1"), train_nodes=2,
    ))  # fmt: skip
    h.status(JobStatus.RECOVERING, LOST_AT, "node lost")
    a2 = h.attempt(2, SHRUNK_START, None, nodes=2, resume_step=1650, validated_step=1650,
                   incident_id=lost.id, step_time=2.8, last_step=2100)  # fmt: skip
    h.status(JobStatus.RUNNING, steps_end(LOST_AT, SHRINK_STEPS))
    # 1/3 steps a second: 30 steps every 90 s from 3,700 s to 4,870 s.
    _samples(session, h, 2, [3700.0 + 90 * k for k in range(14)], 1660, 30)
    return h, a2, lost.id


def _as_shrunk(
    h: JobHistory, a2: Attempt, *, spare_launched: bool = True, released: str | None = None
) -> None:
    """Attempt 2 as a shrink records it: placed for 3, 2 training, a spare launch."""
    group = [f"{h.id}-a2-n0", f"{h.id}-a2-n1"]
    spare = [f"{h.id}-a2-n2"]
    a2.num_nodes = 3
    a2.knobs = {
        "micro_batch": 4, "verb": "shrink", "train_nodes": 2,
        "keep": [f"{h.id}-a1-n0", f"{h.id}-a1-n1"],
        **({"spare_cluster": "c-spare"} if spare_launched else {}),
        **({"spare_released": released} if released else {}),
    }  # fmt: skip
    parts = [{"cluster_name": "c-group", "node_ids": group, "hosts": ["h0", "h1"]}]
    if spare_launched:
        parts.append({"cluster_name": "c-spare", "node_ids": spare, "hosts": ["h2"]})
    a2.handle = {
        "verb": "shrink", "cluster_name": "c-group", "launcher": "fake",
        "node_ids": [n for p in parts for n in p["node_ids"]],
        "hosts": [x for p in parts for x in p["hosts"]],
        "requested_at": at(SHRUNK_START).isoformat(), "up_at": at(SHRUNK_UP).isoformat(),
        **({"parts": parts} if len(parts) > 1 else {}),
    }  # fmt: skip


def _spare_node(session: Session, h: JobHistory, registered: float, last: float) -> None:
    """The standby spare's agent: registered at node rank 2, no ranks."""
    session.add(
        Node(
            job_id=h.id, attempt=2, node_id=f"{h.id}-a2-n2", node_rank=2, address="10.0.2.2",
            state="running", last_heartbeat_at=at(last),
            progress={"state": "standby", "ranks": []}, registered_at=at(registered),
        )
    )  # fmt: skip


def grown_job(session: Session, name: str = "gpt-elastic") -> JobHistory:
    """3 -> 2 (+1 spare) -> 3 nodes; succeeded at 9,000 s."""
    h, a2, _ = _shrunk_start(session, name)
    _as_shrunk(h, a2)
    _spare_node(session, h, 3900, GROW_AT)
    h.event(GROW_AT - 10, "grow", "elastic_grow",
            message=f"replacement {h.id}-a2-n2 registered: growing from 2 to 3 nodes")  # fmt: skip
    grow = h.incident(
        GROW_AT, "elastic_grow", GROW_STEPS, last_step=2100, attempt=2, cause_kind="grow",
        message="replacement registered: growing from 2 to 3 nodes",
    )  # fmt: skip
    _select_result(session, grow.id, rc.Selection(
        RecoveryAction.GROW_BACK, PLACEMENT, rc.LaunchVerb.JOIN_SURVIVORS,
        keep=tuple(f"{h.id}-a2-n{k}" for k in range(3)),
    ))  # fmt: skip
    a2.ended_at, a2.state, a2.end_reason = at(SHRUNK_END), "ended", "grow: saved at step 2100"
    for n in session.scalars(select(Node).where(Node.job_id == h.id, Node.attempt == 2)):
        n.state = "exited"
    h.status(JobStatus.RECOVERING, GROW_AT, "elastic grow")
    h.attempt(3, GROWN_START, END, nodes=3, up=GROWN_START + 15, resume_step=2100,
              validated_step=2100, incident_id=grow.id, end_reason="succeeded",
              last_step=4200)  # fmt: skip
    h.status(JobStatus.RUNNING, steps_end(GROW_AT, GROW_STEPS))
    h.status(JobStatus.SUCCEEDED, END, "max steps reached")
    session.flush()
    return h


def spare_lost_job(session: Session, name: str = "gpt-spare-lost") -> JobHistory:
    """3 -> 2 (+1 spare, lost at 4,000 s) nodes; succeeded shrunk at 9,000 s."""
    h, a2, _ = _shrunk_start(session, name)
    why = f"{h.id}-a2-n2 is gone"
    _as_shrunk(h, a2, released=why)
    _spare_node(session, h, 3900, SPARE_LOST_AT - 30)
    h.event(SPARE_LOST_AT, "elastic", None,
            message=f"replacement lost: {why}; training goes on at 2 of 3 nodes (min_nodes 2)",
            details={"attempt": 2, "detected_by": "reconciler"})  # fmt: skip
    a2.ended_at, a2.state, a2.end_reason = at(END), "ended", "every rank exited 0"
    h.status(JobStatus.SUCCEEDED, END, "max steps reached")
    session.flush()
    return h


def spare_refused_job(session: Session, name: str = "gpt-spare-refused") -> JobHistory:
    """3 -> 2 nodes, the standby launch refused; succeeded shrunk at 9,000 s."""
    h, a2, _ = _shrunk_start(session, name)
    why = "the standby launch was refused: no capacity"
    _as_shrunk(h, a2, spare_launched=False, released=why)
    h.event(SHRUNK_START, "elastic", None, message=f"replacement lost: {why}",
            details={"attempt": 2, "detected_by": "reconciler"})  # fmt: skip
    a2.ended_at, a2.state, a2.end_reason = at(END), "ended", "every rank exited 0"
    h.status(JobStatus.SUCCEEDED, END, "max steps reached")
    session.flush()
    return h


SPARE_ASKED_AGAIN_AT = 4500.0


def spare_asked_again_job(session: Session, name: str = "gpt-spare-again") -> JobHistory:
    """3 -> 2 (+1 spare, lost at 4,000 s; asked for again at 4,500 s, node rank 3,
    held to the end) nodes; succeeded shrunk at 9,000 s (the second spare never
    registered: the grow is not part of this history)."""
    h, a2, _ = _shrunk_start(session, name)
    _as_shrunk(h, a2)
    _spare_node(session, h, 3900, SPARE_LOST_AT - 30)
    again = [f"{h.id}-a2-n3"]
    a2.knobs = {
        **(a2.knobs or {}), "spare_cluster": "c-spare-2", "spare_try": 2, "spare_base": 3,
        "spare_past": ["c-spare"], "spare_held_s": SPARE_LOST_AT - SHRUNK_START,
        "spare_asked_at": at(SPARE_ASKED_AGAIN_AT).isoformat(),
    }  # fmt: skip
    handle = dict(a2.handle or {})
    parts = [*handle["parts"], {"cluster_name": "c-spare-2", "node_ids": again, "hosts": ["h3"]}]
    handle.update(parts=parts, node_ids=[n for p in parts for n in p["node_ids"]])
    a2.handle = handle
    a2.ended_at, a2.state, a2.end_reason = at(END), "ended", "every rank exited 0"
    h.status(JobStatus.SUCCEEDED, END, "max steps reached")
    session.flush()
    return h
