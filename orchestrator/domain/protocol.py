"""The seven steps of the restart protocol, in order (see DESIGN.md, "Data flow").

STAGE follows LAUNCH here, while DESIGN.md lists it first: the node stages the
checkpoint itself, before torchrun starts, so it can only begin once the node is up.

The store keeps one ``protocol_steps`` row per (incident, step) with its start and
end, so every incident has an MTTR breakdown and a restarted service resumes at
the first step without an ``ok`` or ``skipped`` outcome.
"""

from __future__ import annotations

from enum import StrEnum


class ProtocolStep(StrEnum):
    DETECT = "detect"  # record the event, classify it
    SIGNAL = "signal"  # every surviving rank is told to checkpoint
    CONFIRM_CHECKPOINT = "confirm_checkpoint"  # manifest + COMMIT on every rank, before release
    SELECT_REPLACEMENT = "select_replacement"  # placement and knobs for the relaunch
    LAUNCH = "launch"  # the relaunch asked for, until its nodes are provisioned and up
    STAGE = "stage"  # each node copies the checkpoint to its disk, before torchrun starts
    VALIDATE = "validate"  # every rank loaded the same step before the first optimizer step


class StepOutcome(StrEnum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"  # e.g. SIGNAL after a node vanished without notice


ORDER: tuple[ProtocolStep, ...] = tuple(ProtocolStep)


def next_step(
    done: dict[ProtocolStep, StepOutcome | None],
) -> ProtocolStep | None:
    """The first step that has not finished ok/skipped; None when the protocol is done.

    ``done`` maps steps already started to their outcome (None = started, not
    finished). A FAILED step is returned again: retrying it is the caller's call.
    """
    for step in ORDER:
        outcome = done.get(step)
        if outcome not in (StepOutcome.OK, StepOutcome.SKIPPED):
            return step
    return None
