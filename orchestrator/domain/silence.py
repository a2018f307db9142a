"""Relative silence: a node is lost when it went quiet while the service was hearing.

A heartbeat timeout alone cannot tell a dead node from a service that stopped
listening. Measured here (issue 25): ``bench/heartbeats.py`` at 2,048 nodes on a busy
machine left 985 healthy nodes past their 30 s timeout; each would have been a false
``node_lost``, a recovery that stops a healthy node's training and adds load to the
service that caused it. Kubernetes' node lifecycle controller has the same problem and
the same answer: when many nodes go NotReady at once it slows evictions, and when all
of them do it stops, because the fault is far likelier on the control plane's side.

So silence only counts against a node for the time the service was hearing:

* **Intake.** Each reconciler tick records an :class:`IntakeSample`: how many of the
  fleet's live nodes the service heard from within the hearing window, against how
  many it expected. A sample whose share falls under ``deaf_share`` makes the time
  since the previous sample *deaf*: the service was late, starved or cut off from
  many nodes at once, and that time is forgiven to every node (up to
  ``max_forgiven_s``, so a real mass loss is acted on in the end). A fleet of fewer
  than ``deaf_min_nodes`` is never deaf by share: there one loss is a large share.
* **Heard around.** Deaf time is forgiven because a node's beats may have been sent
  and not taken in. That excuse ends once the service took in, since the node was
  last heard, as many beats per live node of the fleet as a healthy node sends in a
  timeout (``heard_around_beats``, from each sample's ``fresh``) and most of the
  node's own job's peers were heard after it (``heard_around_peers``): a starved
  service answering a fifth of the beats still hears every healthy node in turn,
  so one that stays quiet while the others keep arriving went quiet itself. Its
  silence then counts in full, stalls included, so a node killed amid a starved but
  hearing fleet is found at the timeout, or as soon as its peers were heard that
  often.
* **Stalls.** A gap between samples (or between the newest and ``now``) longer than
  ``stall_gap_s`` means the deciding service itself did not run (SIGSTOP, a VM pause,
  a starved process): like the time before ``heard_since``, nothing was heard and
  nothing is held against a node, without limit.
* **Disruption.** When more than ``disruption_share`` of a job's live nodes are silent
  past the timeout at once, and the job has at least ``disruption_min_nodes``, the
  service opens no recovery for them and records ``control_plane_degraded`` instead,
  for up to ``max_forgiven_s`` past the timeout. A node with a second witness is never
  waited for: the launcher saying it is gone (``NodeView.alive is False``) or its own
  preemption notice are failures of their own, decided before silence is looked at.

Pure: the samples come from the snapshot, ``now`` is the snapshot's.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

#: Seconds of an interval at which each node is heard once, the longest the service
#: tells an agent to wait between beats (the timeout divided by this, at most).
BEATS_PER_TIMEOUT = 3.0


@dataclass(frozen=True)
class IntakeSample:
    """What the service heard in the interval ending at ``at`` (one reconciler tick)."""

    at: datetime
    heard: int
    """Live nodes of the fleet whose newest beat is within the hearing window."""
    expected: int
    """Live nodes of the fleet (registered, not exited, of current attempts)."""
    fresh: int = 0
    """Live nodes whose newest beat is newer than at the previous sample: the beats the
    service took in over this interval (a node beats at most once per tick)."""

    @property
    def share(self) -> float:
        return 1.0 if self.expected <= 0 else self.heard / self.expected


@dataclass(frozen=True)
class SilenceConfig:
    deaf_share: float = 0.5
    """An interval in which the service heard fewer than this share of the fleet's live
    nodes is deaf: one lost node among healthy peers never makes it so (with two nodes
    one lost leaves a half, which is not under it)."""
    deaf_min_nodes: int = 4
    """Fleets of fewer live nodes are never deaf by share: when one of two or three
    nodes falls silent, the intake cannot tell the service's deafness from the node's
    loss (a stall still tells, and the launcher's word)."""
    stall_gap_s: float = 10.0
    """Samples further apart than this (the reconciler ticks every 0.5 s) mean the
    service itself did not run in between: that time is never held against a node."""
    max_forgiven_s: float = 300.0
    """Deaf time forgiven to a node, at most, and how long past the timeout a job in
    disruption waits: a zone that really went away is recovered after this even when
    no launcher can say so."""
    disruption_share: float = 0.5
    """More than this share of a job's live nodes silent past the timeout at once is a
    disruption: no recovery is opened for them while it lasts."""
    disruption_min_nodes: int = 3
    """Jobs with fewer nodes are never in disruption on their own (one lost node of two
    is a half: that is a node loss, and the fleet's intake still covers the service's
    own deafness)."""
    heard_around_beats: float = BEATS_PER_TIMEOUT
    """Beats per live node of the fleet taken in since a node was last heard after
    which its deaf time is no longer forgiven: a healthy node is heard about that often
    in a timeout, so at a fleet heard this often it would have been heard too."""
    heard_around_peers: float = 0.9
    """And at least this share of its job's other live nodes heard after it (a job of
    one node: the fleet's intake alone). A job most of whose nodes went quiet together
    is not heard around: that is a disruption, waited out as one."""


@dataclass(frozen=True)
class Span:
    start: datetime
    end: datetime

    def overlap_s(self, start: datetime, end: datetime) -> float:
        lo, hi = max(self.start, start), min(self.end, end)
        return max(0.0, (hi - lo).total_seconds())


@dataclass(frozen=True)
class Deafness:
    """The service's own blind time, from the intake samples."""

    stalls: tuple[Span, ...] = ()
    """The service did not run (forgiven without limit)."""
    deaf: tuple[Span, ...] = ()
    """The service ran and heard too little of the fleet (forgiven up to a cap)."""
    intervals_from: tuple[datetime, ...] = ()
    """The start of each sampled interval (the previous sample's time), oldest first."""
    taken_in: tuple[float, ...] = ()
    """``taken_in[i]``: beats per live node the service took in over the intervals from
    ``intervals_from[i]`` on, to the newest sample (a suffix sum)."""

    @property
    def degraded(self) -> bool:
        return bool(self.stalls or self.deaf)

    def beats_per_node_since(self, since: datetime) -> float:
        """Beats per live node of the fleet taken in over the intervals that began at
        or after ``since`` (an interval straddling it is not counted)."""
        i = bisect_left(self.intervals_from, since)
        return self.taken_in[i] if i < len(self.taken_in) else 0.0


def deafness(
    samples: Sequence[IntakeSample], now: datetime, cfg: SilenceConfig = SilenceConfig()
) -> Deafness:
    """The stalls and deaf intervals the samples (oldest first) show, up to ``now``."""
    stalls: list[Span] = []
    deaf: list[Span] = []
    starts: list[datetime] = []
    per_node: list[float] = []
    prev: IntakeSample | None = None
    for smp in samples:
        if prev is not None:
            starts.append(prev.at)
            per_node.append(smp.fresh / smp.expected if smp.expected > 0 else 0.0)
            gap = (smp.at - prev.at).total_seconds()
            if gap > cfg.stall_gap_s:
                _extend(stalls, prev.at, smp.at)
            elif smp.expected >= cfg.deaf_min_nodes and smp.share < cfg.deaf_share:
                _extend(deaf, prev.at, smp.at)
        prev = smp
    if prev is not None and (now - prev.at).total_seconds() > cfg.stall_gap_s:
        # The tick deciding started long after its last sample: it was stopped between.
        _extend(stalls, prev.at, now)
    suffix: list[float] = []
    total = 0.0
    for x in reversed(per_node):
        total += x
        suffix.append(total)
    suffix.reverse()
    return Deafness(tuple(stalls), tuple(deaf), tuple(starts), tuple(suffix))


def _extend(spans: list[Span], start: datetime, end: datetime) -> None:
    if spans and spans[-1].end >= start:
        spans[-1] = Span(spans[-1].start, max(spans[-1].end, end))
    else:
        spans.append(Span(start, end))


def _overlap(spans: Iterable[Span], start: datetime, end: datetime) -> float:
    return sum(sp.overlap_s(start, end) for sp in spans)


def relative_silence(
    last_heard: datetime | None,
    now: datetime,
    blind: Deafness,
    cfg: SilenceConfig = SilenceConfig(),
    *,
    peers_heard_after: float | None = None,
) -> float:
    """Seconds the node has been silent while the service was hearing: its silence
    since ``last_heard`` less the service's stalls and (up to the cap) deaf time.

    ``peers_heard_after``: the share of its job's other live nodes heard after it
    (None: it has none). Once the node is heard around (module docstring), neither
    deaf time nor a gap between samples is forgiven to it: a reconciler whose ticks
    are late (a starved one, 10 s and more apart, measured at 2,048 nodes) reads as a
    stall, but the beats its samples count say the service was taking them in."""
    if last_heard is None:
        return float("inf")
    raw = (now - last_heard).total_seconds()
    if raw <= 0 or not blind.degraded:
        return raw
    if heard_around(last_heard, blind, cfg, peers_heard_after):
        return raw  # the beats kept coming, from everyone but this node
    stalled = _overlap(blind.stalls, last_heard, now)
    deaf = min(cfg.max_forgiven_s, _overlap(blind.deaf, last_heard, now))
    return max(0.0, raw - stalled - deaf)


def heard_around(
    last_heard: datetime,
    blind: Deafness,
    cfg: SilenceConfig = SilenceConfig(),
    peers_heard_after: float | None = None,
) -> bool:
    """The service kept hearing the fleet, and the node's own job, after the node was
    last heard: as many beats per node as a healthy node sends in a timeout, and most
    of the job's other nodes. A node quiet since then went quiet on its own."""
    if peers_heard_after is not None and peers_heard_after < cfg.heard_around_peers:
        return False
    return blind.beats_per_node_since(last_heard) >= cfg.heard_around_beats


def peers_heard_after(
    last_heard: Mapping[str, datetime | None],
    blind: Deafness,
    cfg: SilenceConfig = SilenceConfig(),
) -> dict[str, float | None]:
    """For each node, the share of the other nodes (its job's live ones) heard after it
    that are still heard: a peer quiet through a turn of the fleet's intake itself
    (``heard_around_beats`` since its own last beat) does not count, so of a job that
    went quiet together the first silent node is not heard around by the others' last
    beats. None for a node with no other. One sort, no pairs (2,048 nodes a tick)."""
    current = sorted(
        t
        for t in last_heard.values()
        if t is not None and blind.beats_per_node_since(t) < cfg.heard_around_beats
    )
    others = len(last_heard) - 1
    out: dict[str, float | None] = {}
    for node, t in last_heard.items():
        if others <= 0:
            out[node] = None
        else:
            after = len(current) - (bisect_right(current, t) if t is not None else 0)
            out[node] = after / others
    return out


@dataclass(frozen=True)
class Disruption:
    """Many of a job's nodes went silent at once: the service waits instead of acting."""

    silent: tuple[str, ...]
    """The nodes silent past the timeout, silent longest first."""
    live: int
    """The job's live nodes."""
    waited_s: float
    """How long past the timeout the longest-silent one is."""

    def message(self, timeout_s: float) -> str:
        return (
            f"{len(self.silent)} of {self.live} nodes silent past the {timeout_s:.0f} s "
            f"heartbeat timeout at once (first {self.silent[0]}, {self.waited_s:.0f} s "
            "past it): waiting, no recovery opened; a node the launcher or a notice "
            "says is gone is still recovered"
        )


def disruption(
    silences: dict[str, float], timeout_s: float, cfg: SilenceConfig = SilenceConfig()
) -> Disruption | None:
    """A disruption of the job whose live nodes have these relative silences, or None.

    None also once the longest-silent node has waited ``max_forgiven_s`` past the
    timeout: the service never waits out a real mass loss forever."""
    live = len(silences)
    over = sorted(((s, n) for n, s in silences.items() if s > timeout_s), reverse=True)
    if live < cfg.disruption_min_nodes or len(over) <= cfg.disruption_share * live:
        return None
    waited = over[0][0] - timeout_s
    if waited > cfg.max_forgiven_s:
        return None
    return Disruption(tuple(n for _, n in over), live, waited)


def heartbeat_interval_s(
    fleet_nodes: int,
    *,
    base_s: float = 1.0,
    beats_per_s: float = 256.0,
    timeout_s: float = 30.0,
) -> float:
    """The period the service tells agents to beat at: ``base_s`` for a small fleet,
    longer as it grows so the fleet sends about ``beats_per_s`` (a fixed share of one
    core: ~1,250 beats/s fill one here), never so long that a node is heard fewer than
    :data:`BEATS_PER_TIMEOUT` times per ``timeout_s``."""
    want = max(base_s, fleet_nodes / beats_per_s) if beats_per_s > 0 else base_s
    return round(min(want, max(base_s, timeout_s / BEATS_PER_TIMEOUT)), 3)


def hearing_window_s(interval_s: float) -> float:
    """A node counts as heard in a sample when its newest beat is this recent: two of
    its periods (one late beat is no silence) plus the batch flush's second."""
    return 2.0 * interval_s + 2.0
