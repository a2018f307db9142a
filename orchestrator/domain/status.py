"""Job statuses and the transition table, as data.

``ALLOWED[a]`` is the set of statuses a job in ``a`` may move to. Everything else is
refused by :func:`transition` (the store logs the refusal and applies nothing).

Typical sequences::

    PENDING -> PROVISIONING -> RUNNING -> SUCCEEDED
    RUNNING -> RECOVERING (preempted) -> PROVISIONING (replacement) -> RUNNING
    RUNNING -> RECOVERING -> FAILED (restart limit reached)
    PENDING -> CANCELLED
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    PENDING = "PENDING"  # accepted, nothing launched yet
    PROVISIONING = "PROVISIONING"  # a launch (first or replacement) is in flight
    RUNNING = "RUNNING"  # every node is training
    RECOVERING = "RECOVERING"  # a failure was detected; the restart protocol runs
    SUCCEEDED = "SUCCEEDED"  # training finished; terminal
    FAILED = "FAILED"  # could not finish or recover; the reason is recorded; terminal
    CANCELLED = "CANCELLED"  # stopped by an operator; terminal

    def is_terminal(self) -> bool:
        return self in TERMINAL


TERMINAL: frozenset[JobStatus] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}
)

_S = JobStatus
ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    _S.PENDING: frozenset({_S.PROVISIONING, _S.FAILED, _S.CANCELLED}),
    _S.PROVISIONING: frozenset({_S.RUNNING, _S.RECOVERING, _S.FAILED, _S.CANCELLED}),
    _S.RUNNING: frozenset({_S.RECOVERING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED}),
    _S.RECOVERING: frozenset({_S.PROVISIONING, _S.RUNNING, _S.FAILED, _S.CANCELLED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, current: JobStatus, target: JobStatus) -> None:
        allowed = ", ".join(sorted(ALLOWED[current])) or "nothing (terminal)"
        super().__init__(f"illegal transition {current} -> {target}; allowed: {allowed}")
        self.current = current
        self.target = target


def can_transition(current: JobStatus, target: JobStatus) -> bool:
    return target in ALLOWED[current]


def transition(current: JobStatus, target: JobStatus) -> JobStatus:
    """Return ``target`` if the move is legal, else raise IllegalTransition."""
    if target not in ALLOWED[current]:
        raise IllegalTransition(current, target)
    return target
