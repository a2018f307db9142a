"""An attempt's shape: how many of the nodes it was placed for trained, and its spares.

An elastic run that lost a node shrinks (``LaunchVerb.SHRINK``): the new attempt is
recorded at the FULL size (``attempts.num_nodes``, the size it was placed for), its
launch plan says how many of those nodes train (``train_nodes``), and the rest are
standby spares launched beside the group (``spare_cluster``), registered with no ranks,
until the group grows back onto them or they are given back (``spare_released``).

The attempts API, goodput, the incidents read model and the dashboard all read an
attempt's node counts from :func:`attempt_shape`, the way the reconciler's snapshot
splits it (``store.snapshot._attempt_view``: the first ``train_nodes`` node ranks
train, the rest and the spare launch's node ids are the spares), so no view counts a
spare as a training node while another does not.

An attempt placed on fewer nodes than the spec's has the same shape once it asked for
its replacements (``spare_count``), and a shrunk one whose spares were given back may
ask again: the current try's launch is ``spare_cluster``, its nodes ranked from
``spare_base``; earlier tries' launches (``spare_past``) were given back and bill only
``spare_held_s``.

When the spares were given back is ``spare_released_at``; rows from before it was
recorded take the ``elastic`` event the reconciler recorded in the same round as the
release ("replacement lost: ...", or the standby launch refused), the attempt's first.

Read-only: nothing here writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.contract import EventKind
from orchestrator.store import records
from orchestrator.store.models import Attempt, FailureEvent, Node
from orchestrator.store.snapshot import parts_of, utc


@dataclass(frozen=True)
class Spares:
    """A shrunk attempt's standby replacements."""

    count: int
    """How many were asked for (the placed size less the training group's)."""
    node_ids: tuple[str, ...]
    """The spares' node ids: the standby launch's, then any registered beyond them."""
    launched: bool
    """The launcher accepted the standby launch (False: refused, nothing was billed)."""
    released: str | None
    """Why they were given back (None: they were not, or the group grew onto them)."""
    released_at: datetime | None
    """When they were given back (the ``elastic`` event recorded with the release)."""
    asked_at: datetime | None = None
    """When the current try's launch was requested (None: with the attempt's)."""
    held_before_s: float = 0.0
    """Seconds earlier tries' spares were held before they were given back."""


@dataclass(frozen=True)
class AttemptShape:
    number: int
    placed_nodes: int
    """The size it was placed for (``attempts.num_nodes``)."""
    training_nodes: int
    """The nodes whose ranks trained: ``train_nodes`` of a shrink, else every node."""
    spare: Spares | None = None
    """A shrunk attempt's spares; None for every other attempt."""

    @property
    def shrunk(self) -> bool:
        return self.spare is not None


def attempt_shape(
    a: Attempt, nodes: Iterable[Node] = (), released_at: datetime | None = None
) -> AttemptShape:
    """The shape of ``a`` from its launch plan, its handle and its registered ``nodes``
    (rows of this attempt: a spare's agent registers at a node rank past the group's)."""
    plan = records.launch_plan_of(a)
    if not plan.spares_beside or plan.train_nodes is None:
        return AttemptShape(a.number, a.num_nodes, a.num_nodes)
    train = plan.train_nodes
    launched = [
        x
        for p in parts_of(a)
        if plan.spare_cluster is not None and p.cluster_name == plan.spare_cluster
        for x in p.node_ids
    ]
    first = plan.first_spare_rank()
    registered = [n.node_id for n in sorted(nodes, key=lambda n: n.node_rank)
                  if n.node_rank >= first]  # fmt: skip
    ids = tuple(dict.fromkeys([*launched, *registered]))
    released = plan.spare_released
    return AttemptShape(
        a.number,
        a.num_nodes,
        train,
        Spares(
            count=plan.spare_count_of(a.num_nodes),
            node_ids=ids,
            launched=plan.spare_cluster is not None,
            released=released,
            released_at=(plan.spare_released_at or released_at) if released is not None else None,
            asked_at=plan.spare_asked_at,
            held_before_s=plan.spare_held_s,
        ),
    )


def spare_releases(s: Session, job_id: str) -> dict[int, datetime]:
    """attempt number -> when its spares were given back: the first ``elastic`` event
    naming the attempt (only read for attempts whose plan says they were released)."""
    out: dict[int, datetime] = {}
    for e in s.scalars(
        select(FailureEvent)
        .where(FailureEvent.job_id == job_id, FailureEvent.kind == EventKind.ELASTIC)
        .order_by(FailureEvent.occurred_at, FailureEvent.id)
    ):
        number = (e.details or {}).get("attempt")
        at = utc(e.occurred_at)
        if isinstance(number, int) and not isinstance(number, bool) and at is not None:
            out.setdefault(number, at)
    return out


def job_shapes(s: Session, job_id: str) -> dict[int, AttemptShape]:
    """attempt number -> shape, for every attempt of the job (three queries)."""
    nodes: dict[int, list[Node]] = {}
    for n in s.scalars(select(Node).where(Node.job_id == job_id)):
        nodes.setdefault(n.attempt, []).append(n)
    released = spare_releases(s, job_id)
    return {
        a.number: attempt_shape(a, nodes.get(a.number, ()), released.get(a.number))
        for a in s.scalars(select(Attempt).where(Attempt.job_id == job_id))
    }
