"""What every CLI command shares: output format, consoles, errors, the REST client.

This is the one module that ``orchestrator.cli`` and the command modules in
``orchestrator.commands`` import helpers from. It imports nothing of theirs, so the
import graph stays a DAG (cli -> commands.* -> common): a command module that
reached back into ``orchestrator.cli`` would import the whole Typer app, and every
other command module with it, before its own code ran. The incident table that the
demos print too lives below both, in ``orchestrator.incident_report``: the
``demo`` command runs the demos, so a demo importing this package made a circle.

Heavy modules (httpx, pydantic, SQLAlchemy, the API's auth) are imported inside the
functions that need them, so ``skyresume --help`` starts fast.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console

if TYPE_CHECKING:
    from orchestrator.settings import Settings

#: Characters shown by name instead of sent to the terminal: C0/C1 controls (ESC
#: starts clear-screen and OSC sequences, CR overwrites a line) and the bidirectional
#: overrides that reorder what a reader sees. Tab and newline are layout, kept.
_HIDDEN = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (9, 10)}
_HIDDEN |= {c: f"\\u{c:04x}" for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
                                       *range(0x2066, 0x206A))}  # fmt: skip


def visible(text: str) -> str:
    """``text`` with every control character spelled out (``\\x1b``), so stored text
    (an event's message, a node's hostname: an agent token can write both) cannot
    clear the operator's screen, retitle the window or hide a line."""
    return text.translate(_HIDDEN)


class TextConsole(Console):
    """A console that shows every string as text: no Rich markup (an event message
    holding ``[/path]`` crashed ``skyresume events``), no emoji codes, and control
    characters made :func:`visible`. Table cells and titles are strings rendered
    here too, so no command can forget it.

    Its width follows ``COLUMNS`` (or the terminal) at each print: Rich reads
    ``COLUMNS`` once, when a console is made, and these two are made at import, so a
    process that imported the CLI under one ``COLUMNS`` would keep that width."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        if kw.get("width") is None:
            self._width = None  # Console.size reads COLUMNS and the terminal each time

    def render_str(self, text: str, **kw: Any) -> Any:
        kw.update(markup=False, emoji=False)
        return super().render_str(visible(text), **kw)


console = TextConsole()
err_console = TextConsole(stderr=True)


class Output(StrEnum):
    """How a command prints its result: a table for people, JSON for scripts."""

    table = "table"
    json = "json"


OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table or json")]

#: HTTP statuses that mean "the request was wrong" (exit 2), not "the service failed".
OPERATOR_ERROR_STATUSES = frozenset({400, 404, 409, 413, 415, 422})


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one ``error:`` line and exit: the operator can fix this, no traceback.

    Exit 2 for input the operator can correct, 1 for everything else."""
    # No markup, emoji or wrapping: the message may hold paths, URIs and brackets,
    # and scripts match on the single line.
    err_console.print(
        f"error: {message}", markup=False, highlight=False, emoji=False, soft_wrap=True
    )
    raise typer.Exit(code)


def load_settings(**overrides: Any) -> Settings:
    """The service settings (environment, then ``overrides``); a bad value exits with
    one line naming the setting instead of pydantic's multi-line report."""
    from pydantic import ValidationError

    from orchestrator.settings import Settings

    try:
        return Settings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        if not first["loc"]:  # a check across settings (TLS pair): its message names them
            fail(f"bad settings: {first['msg'].removeprefix('Value error, ')}", 2)
        fail(f"bad setting SKYRESUME_{str(first['loc'][0]).upper()}: {first['msg']}", 2)


def describe_error(r: Any) -> str:
    """One line for an HTTP error response: the API's ``detail``, or FastAPI's
    validation errors joined as ``field: message`` (the job spec's fields)."""
    try:
        detail = r.json().get("detail")
    except ValueError:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    if isinstance(detail, list):
        parts = []
        for d in detail:
            loc = ".".join(str(p) for p in d.get("loc", []) if p != "body")
            parts.append(f"{loc}: {d.get('msg')}" if loc else str(d.get("msg")))
        # A route's own check (no field named) reads as its message alone.
        named = any(d.get("loc") for d in detail if isinstance(d, dict))
        return ("invalid job spec: " if named else "") + "; ".join(parts)
    return str(detail)


class Client:
    """The REST client: one place that turns HTTP failures into operator messages."""

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        import httpx

        from orchestrator.api.auth import read_client_token

        settings = load_settings()
        self.url = (url or settings.effective_service_url).rstrip("/")
        self.token = token or read_client_token(settings)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            verify = settings.client_verify()
        except ValueError as e:
            fail(str(e), 2)
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30, verify=verify)

    def request(self, method: str, path: str, *, retries: int = 0, **kw: Any) -> Any:
        """``retries``: send again after a timeout or a dropped connection (only for a
        request that is safe to repeat, such as a submit with an ``Idempotency-Key``)."""
        import time

        import httpx

        try:
            for n in range(retries + 1):
                try:
                    r = self.http.request(method, path, **kw)
                    break
                except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError):
                    if n == retries:
                        raise
                    time.sleep(0.5 * 2**n)
        except httpx.ConnectError as e:
            if "CERTIFICATE_VERIFY_FAILED" in str(e):
                fail(
                    f"the service at {self.url} presented a certificate this machine does "
                    f"not trust (set SKYRESUME_CA_BUNDLE to its CA): {e}"
                )
            fail(
                f"cannot reach the skyresume service at {self.url} (is `skyresume serve` running?)"
            )
        except httpx.TimeoutException:
            fail(f"the skyresume service at {self.url} did not answer in time")
        except httpx.HTTPError as e:
            fail(f"request to {self.url} failed: {e}")
        if r.status_code == 401:
            hint = "set SKYRESUME_TOKEN" if not self.token else "check SKYRESUME_TOKEN"
            fail(f"the service rejected the token ({hint}; local mode keeps it in <home>/token)")
        if r.status_code >= 400:
            fail(describe_error(r), 2 if r.status_code in OPERATOR_ERROR_STATUSES else 1)
        return r.json()


def print_json(data: Any) -> None:
    """Indented JSON on stdout (plain write: rich would colour and wrap it)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def redact_url(url: str) -> str:
    """A database URL fit to print: the password hidden, or a placeholder when the
    URL cannot be parsed (printing it raw could leak the password)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable URL>"


def attempt_progress(attempt: dict[str, Any]) -> str:
    """What an attempt of ``GET /v1/jobs/{id}/attempts`` is known to have trained, in
    words: where it resumed and the highest step its ranks reported, or that its ranks
    sent no progress reports (a plain script), never a bare ``None``."""
    steps = [r["step"] for n in attempt["nodes"] for r in n["ranks"] if r.get("step") is not None]
    resumed = attempt.get("validated_step")
    if resumed is None:
        resumed = attempt.get("resume_step")
    start = "from scratch" if resumed is None else f"from step {resumed}"
    if not steps:
        ranks = sum(len(n["ranks"]) for n in attempt["nodes"])
        if not ranks:
            return f"{start}; no rank has reported yet"
        return f"{start}; without progress reports"
    low, high = min(steps), max(steps)
    span = f"step {high}" if low == high else f"steps {low}-{high}"
    return f"{start}; ranks at {span}"
