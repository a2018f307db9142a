"""Stored text reaches the operator's terminal as text: an event message (which an
agent token can write) holding Rich markup or raw escape sequences is printed with
its brackets as they are and its control characters spelled out, through the CLI
against a real service on SQLite and PostgreSQL."""

from __future__ import annotations

import os

from testkit import job_spec, served
from typer.testing import CliRunner

from orchestrator.cli import app as cli

#: Markup that crashed ``skyresume events`` ([/...] closes a tag never opened), a
#: clear-screen, a window-title OSC and a right-to-left override.
HOSTILE = "saved to [/ckpt/step-9] [bold]x \x1b[2J\x1b]0;owned\x07 \u202edone"


def test_events_print_stored_markup_and_escapes_as_visible_text(app, settings, tmp_path):
    with served(app, settings) as url:
        import httpx

        auth = {"Authorization": f"Bearer {app.state.token}"}
        job_id = httpx.post(f"{url}/v1/jobs", json=job_spec(), headers=auth, timeout=30).json()[
            "id"
        ]
        event = {"idempotency_key": "e1", "kind": "checkpoint", "message": HOSTILE}
        r = httpx.post(f"{url}/v1/jobs/{job_id}/events", json=event, headers=auth, timeout=30)
        assert r.status_code == 201, r.text
        clean = {k: None for k in os.environ if k.startswith("SKYRESUME_")}
        env = {**clean, "SKYRESUME_HOME": str(tmp_path / "cli"), "SKYRESUME_SERVICE_URL": url,
               "SKYRESUME_TOKEN": app.state.token, "COLUMNS": "400"}  # fmt: skip
        result = CliRunner().invoke(cli, ["events", job_id], env=env)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "[/ckpt/step-9]" in out and "[bold]x" in out  # brackets shown, not parsed
    assert "\\x1b[2J" in out and "\\x1b]0;owned\\x07" in out and "\\u202edone" in out
    assert not any(c in out for c in "\x1b\x07\u202e")  # nothing raw reached the terminal


def test_the_cli_console_takes_the_width_of_the_moment_not_of_its_import(monkeypatch):
    # Rich fixes a console's width from COLUMNS when the console is made; the CLI's are
    # made at import (pytest-xdist's workers import it under COLUMNS=80).
    from orchestrator.commands.common import TextConsole

    monkeypatch.setenv("COLUMNS", "80")
    made = TextConsole()
    monkeypatch.setenv("COLUMNS", "200")
    assert made.width == 200
    assert TextConsole(width=100).width == 100  # an explicit width stays
