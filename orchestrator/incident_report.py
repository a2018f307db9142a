"""A job's incidents as an operator reads them in a terminal: the table of classes,
remedies and seconds per protocol step, and each step's evidence in words.

``skyresume incidents`` (``orchestrator.commands.recovery``) and the demos
(``orchestrator.demo``, ``demo_elastic``, ``demo_skypilot``) print the same table.
It lives here, below both, because the ``demo`` command imports the demos: a demo
that imported it from ``orchestrator.commands`` made the two a package circle
(``tests/test_import_layers.py``). It imports nothing of either, and Rich only
inside the function, so ``skyresume --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table


def incident_table(items: list[dict[str, Any]]) -> Table:
    """The incidents of ``GET /v1/jobs/{id}/incidents``: class, remedy, node, steps lost, MTTR
    and seconds per protocol step (``skyresume incidents`` and the demo print it)."""
    from rich.table import Table

    from orchestrator.domain.protocol import ProtocolStep

    short = {"confirm_checkpoint": "confirm", "select_replacement": "select"}
    cols = [short.get(s.value, s.value) for s in ProtocolStep]
    t = Table(
        "#",
        "CLASS",
        "REMEDY",
        "NODE",
        "LOST",
        "MTTR s",
        *cols,
        title="incidents (seconds per protocol step)",
    )
    for inc in items:
        secs = {s["step"]: s["seconds"] for s in inc["steps"]}
        t.add_row(
            str(inc["id"]),
            inc["failure_class"] or "",
            inc.get("remedy") or "",
            (inc.get("node_id") or "").rsplit("-", 1)[-1],
            "" if inc["steps_lost"] is None else str(inc["steps_lost"]),
            "" if inc["mttr_s"] is None else f"{inc['mttr_s']:.1f}",
            *("" if secs.get(s.value) is None else f"{secs[s.value]:.1f}" for s in ProtocolStep),
        )
    return t


def incident_evidence(items: list[dict[str, Any]]) -> list[str]:
    """Each incident's steps, one line each with the detail the step's evidence gave
    (the nodes' exit reports, the ranks' resume reports, the store's listing): what
    ``skyresume incidents`` prints under its table, so no claim is in the JSON only."""
    lines = []
    for inc in items:
        lines.append(
            f"incident {inc['id']} ({inc['failure_class'] or 'unknown'}): {inc['message']}"
        )
        for s in inc["steps"]:
            if s.get("detail"):
                lines.append(f"  {s['step']} [{s.get('outcome') or 'running'}]: {s['detail']}")
    return lines
