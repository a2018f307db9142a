"""The typed records the reconciler keeps in JSON columns, read and written here only.

Protocol steps hand each other results (``domain.reconcile.StepResult``: SELECT's
``Selection``, CONFIRM's ``ConfirmedCheckpoint``, VALIDATE's ``ResumeValidated``),
stored in the step row's ``result`` column; an attempt's launch plan (its verb, where
its ranks resume from, the nodes it keeps) is stored in the attempt's ``knobs``.
``decide`` and the executors see only the dataclasses: nothing outside this module
reads those columns by key, so a field is renamed in one place, and a row that does
not parse is an error naming the field, never a silent default that would pick a
different launch verb.

Rows written before the verb existed (``in_place`` and ``keep`` instead) are read as
the verb the reconciler picked for them then.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from orchestrator.domain import reconcile as rc
from orchestrator.domain.plan import Placement
from orchestrator.domain.policy import RecoveryAction
from orchestrator.store.models import Attempt


class StoredRecordError(ValueError):
    """A stored record does not parse; the message names the row's field."""


def _strs(d: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    raw = d.get(key) or ()
    if not isinstance(raw, list | tuple) or not all(isinstance(x, str) for x in raw):
        raise StoredRecordError(f"{where}: {key!r} is not a list of strings: {raw!r}")
    return tuple(raw)


def _opt_int(d: dict[str, Any], key: str, where: str) -> int | None:
    raw = d.get(key)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise StoredRecordError(f"{where}: {key!r} is not an integer: {raw!r}")
    return raw


def _opt_time(d: dict[str, Any], key: str, where: str) -> datetime | None:
    raw = d.get(key)
    if raw is None:
        return None
    try:
        at = datetime.fromisoformat(raw) if isinstance(raw, str) else None
    except ValueError:
        at = None
    if at is None:
        raise StoredRecordError(f"{where}: {key!r} is not an ISO time: {raw!r}")
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _legacy_verb(d: dict[str, Any]) -> rc.LaunchVerb:
    """The verb a row from before verbs meant (the reconciler then picked a refill or
    a join from the launcher's class; a join is what every launcher can do)."""
    if d.get("in_place"):
        return rc.LaunchVerb.RESTART_IN_PLACE
    return rc.LaunchVerb.JOIN_SURVIVORS if d.get("keep") else rc.LaunchVerb.LAUNCH


def _verb(d: dict[str, Any], where: str) -> rc.LaunchVerb:
    raw = d.get("verb")
    if raw is None:
        return _legacy_verb(d)
    try:
        return rc.LaunchVerb(raw)
    except ValueError:
        known = ", ".join(v.value for v in rc.LaunchVerb)
        raise StoredRecordError(f"{where}: unknown launch verb {raw!r} (known: {known})") from None


# --- protocol step results ---------------------------------------------------------------


def result_json(result: rc.StepResult) -> dict[str, Any]:
    """The JSON a step row stores for ``result``."""
    match result:
        case rc.Selection():
            return {
                "remedy": str(result.remedy),
                "placement": result.placement.to_dict(),
                "verb": str(result.verb),
                "exclude_hosts": list(result.exclude_hosts),
                "keep": list(result.keep),
                "keep_hosts": list(result.keep_hosts),
                "train_nodes": result.train_nodes,
                "warm": result.warm,
            }
        case rc.ConfirmedCheckpoint():
            out: dict[str, Any] = {"step": result.step, "uri": result.uri}
            if result.poisoned:
                # JSON keys are strings: the step as its decimal.
                out["poisoned"] = {str(k): v for k, v in sorted(result.poisoned.items())}
            return out
        case rc.ResumeValidated():
            return {"resumed_step": result.resumed_step}


def selection_from_json(d: dict[str, Any]) -> rc.Selection:
    where = "select_replacement result"
    try:
        remedy = RecoveryAction(str(d.get("remedy")))
    except ValueError:
        raise StoredRecordError(f"{where}: unknown remedy {d.get('remedy')!r}") from None
    raw = d.get("placement")
    if not isinstance(raw, dict):
        raise StoredRecordError(f"{where}: 'placement' is missing or not an object")
    try:
        placement = Placement.from_dict(raw)
    except TypeError as e:
        raise StoredRecordError(f"{where}: 'placement' does not parse: {e}") from None
    return rc.Selection(
        remedy=remedy,
        placement=placement,
        verb=_verb(d, where),
        exclude_hosts=_strs(d, "exclude_hosts", where),
        keep=_strs(d, "keep", where),
        keep_hosts=_strs(d, "keep_hosts", where),
        train_nodes=_opt_int(d, "train_nodes", where),
        warm=d.get("warm") is True,
    )


def confirmed_from_json(d: dict[str, Any]) -> rc.ConfirmedCheckpoint:
    where = "confirm_checkpoint result"
    uri = d.get("uri")
    if uri is not None and not isinstance(uri, str):
        raise StoredRecordError(f"{where}: 'uri' is not a string: {uri!r}")
    raw = d.get("poisoned") or {}
    if not isinstance(raw, dict):
        raise StoredRecordError(f"{where}: 'poisoned' is not an object: {raw!r}")
    poisoned: dict[int, str] = {}
    for step, digest in raw.items():
        if not str(step).isdigit() or not isinstance(digest, str):
            raise StoredRecordError(f"{where}: 'poisoned' entry {step!r}: {digest!r}")
        poisoned[int(step)] = digest
    return rc.ConfirmedCheckpoint(_opt_int(d, "step", where), uri, poisoned)


# --- an attempt's launch plan --------------------------------------------------------------


@dataclass(frozen=True)
class LaunchPlan:
    """What an attempt was recorded to launch with, besides its placement
    (``RecordAttempt``): the executors read this, never the attempt's JSON."""

    verb: rc.LaunchVerb = rc.LaunchVerb.LAUNCH
    resume_from: str = "latest"
    stage_from: str | None = None
    collective_timeout_s: int | None = None
    skip_steps: tuple[int, int] | None = None
    exclude_hosts: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    keep_hosts: tuple[str, ...] = ()
    train_nodes: int | None = None
    """A shrink: the training group's node count (the rest are standby spares)."""
    spare_released: str | None = None
    """Why a shrunk attempt's spares were given back (None: they were not)."""
    spare_cluster: str | None = None
    """The launch (``LaunchHandle.cluster_name``) that holds a shrunk attempt's spares."""
    spare_count: int | None = None
    """Spares asked for beside an attempt placed on fewer nodes than the spec's (a
    shrink's are its placed size less ``train_nodes``)."""
    spare_try: int | None = None
    """The standby launches asked for, the current one included (None: a shrink's
    own standby only, the first)."""
    spare_asked_at: datetime | None = None
    """When the current standby launch was requested (None: with the attempt's)."""
    spare_released_at: datetime | None = None
    """When the current one was given back or refused."""
    spare_base: int | None = None
    """The current try's first node rank (None: ``train_nodes``, the first try's)."""
    spare_past: tuple[str, ...] = ()
    """Earlier tries' standby launches, given back: never the training group's."""
    spare_held_s: float = 0.0
    """Seconds those earlier standby launches were held (billed) before release."""
    warm: bool = False
    """A shrink whose kept nodes are carried warm (``regroup`` commands), not restarted."""

    @property
    def spares_beside(self) -> bool:
        """The attempt trains on ``train_nodes`` with standby spares beside it (a shrink,
        or an attempt placed on fewer nodes that asked for its replacements since)."""
        return self.train_nodes is not None and (
            self.verb is rc.LaunchVerb.SHRINK or self.spare_count is not None
        )

    def spare_count_of(self, placed_nodes: int) -> int:
        """How many spares: ``spare_count``, else the placed size less the group's."""
        if self.spare_count is not None:
            return self.spare_count
        return placed_nodes - (self.train_nodes or placed_nodes)

    @property
    def tries(self) -> int:
        """The standby launches asked for, the current one included."""
        return self.spare_try if self.spare_try is not None else 1

    def first_spare_rank(self) -> int:
        """The current try's first node rank (earlier tries' spares sit below it)."""
        if self.spare_base is not None:
            return self.spare_base
        return self.train_nodes or 0


def plan_json(action: rc.RecordAttempt) -> dict[str, Any]:
    """The launch-plan keys of an attempt's ``knobs`` for ``action``."""
    return {
        "verb": str(action.verb),
        "resume_from": action.resume_from,
        "exclude_hosts": list(action.exclude_hosts),
        "skip_steps": list(action.skip_steps) if action.skip_steps else None,
        "collective_timeout_s": action.collective_timeout_s,
        "stage_from": action.stage_from,
        "keep": list(action.keep),
        "keep_hosts": list(action.keep_hosts),
        "train_nodes": action.train_nodes,
        "warm": action.warm,
    }


def launch_plan_of(a: Attempt) -> LaunchPlan:
    k = a.knobs or {}
    where = f"attempt {a.number} of job {a.job_id}"
    skip = k.get("skip_steps")
    if skip is not None and not (
        isinstance(skip, list | tuple) and len(skip) == 2 and all(isinstance(x, int) for x in skip)
    ):
        raise StoredRecordError(f"{where}: 'skip_steps' is not [first, last]: {skip!r}")
    stage = k.get("stage_from")
    return LaunchPlan(
        verb=_verb(k, where),
        resume_from=str(k.get("resume_from") or "latest"),
        stage_from=str(stage) if stage else None,
        collective_timeout_s=_opt_int(k, "collective_timeout_s", where),
        skip_steps=(int(skip[0]), int(skip[1])) if skip else None,
        exclude_hosts=_strs(k, "exclude_hosts", where),
        keep=_strs(k, "keep", where),
        keep_hosts=_strs(k, "keep_hosts", where),
        train_nodes=_opt_int(k, "train_nodes", where),
        spare_released=str(k["spare_released"]) if k.get("spare_released") else None,
        spare_cluster=str(k["spare_cluster"]) if k.get("spare_cluster") else None,
        spare_count=_opt_int(k, "spare_count", where),
        spare_try=_opt_int(k, "spare_try", where),
        spare_asked_at=_opt_time(k, "spare_asked_at", where),
        spare_released_at=_opt_time(k, "spare_released_at", where),
        spare_base=_opt_int(k, "spare_base", where),
        spare_past=_strs(k, "spare_past", where),
        spare_held_s=float(held)
        if isinstance(held := k.get("spare_held_s"), int | float) and not isinstance(held, bool)
        else 0.0,
        warm=k.get("warm") is True,
    )


def failed_verb(details: dict[str, Any]) -> rc.LaunchVerb:
    """The verb of a recorded launch failure (one from before verbs: a fresh launch)."""
    raw = details.get("verb")
    try:
        return rc.LaunchVerb(raw) if raw is not None else rc.LaunchVerb.LAUNCH
    except ValueError:
        raise StoredRecordError(f"launch failure: unknown launch verb {raw!r}") from None


def launched_verb(a: Attempt) -> rc.LaunchVerb:
    """The verb the attempt's accepted request used (its handle's), else the one it
    was recorded with: they differ after a refill or restart fell back to a launch."""
    raw = (a.handle or {}).get("verb")
    if raw is None:
        return launch_plan_of(a).verb
    return _verb(a.handle or {}, f"attempt {a.number} of job {a.job_id}: handle")


def restarted_in_place(a: Attempt) -> bool:
    """Every node of the attempt is a node of the last one, restarted where it was."""
    verb = launched_verb(a)
    if verb is rc.LaunchVerb.JOIN_SURVIVORS:
        return len(launch_plan_of(a).keep) >= a.num_nodes
    return verb is rc.LaunchVerb.RESTART_IN_PLACE


def resume_validated(stored: dict[str, Any] | None) -> rc.ResumeValidated | None:
    """VALIDATE's result when every rank's resume report ended it (None: it ended on
    something else, a plain run or a finished one, which measures no start-up)."""
    raw = (stored or {}).get("resumed_step")
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise StoredRecordError(f"validate result: 'resumed_step' is not an integer: {raw!r}")
    return rc.ResumeValidated(raw)
