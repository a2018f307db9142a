"""Operator roles: what a token may do. Pure vocabulary, shared by the store (a
token's row), the API (each route's check) and the CLI (``token create --role``)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """Each role may do everything the ones before it may."""

    viewer = "viewer"  # reads: every GET of the API, the dashboard
    operator = "operator"  # submit, cancel, chaos, events; the agents' routes
    admin = "admin"  # token and session management

    def allows(self, needed: Role) -> bool:
        return _RANK[self] >= _RANK[needed]


_RANK = {Role.viewer: 0, Role.operator: 1, Role.admin: 2}
