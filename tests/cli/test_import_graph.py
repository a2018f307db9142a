"""The CLI's imports run one way: cli -> commands.* / server -> commands.common.

A command module (or the demo) that reached back into ``orchestrator.cli`` would
load the whole Typer app, and every other command module with it, before its own
code ran: the import circle this layout exists to prevent.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import orchestrator.commands

ROOT = Path(__file__).resolve().parents[2]
COMMAND_MODULES = sorted(
    f"orchestrator.commands.{m.name}" for m in pkgutil.iter_modules(orchestrator.commands.__path__)
)
#: Everything the CLI is built from; none of it may need the CLI module.
BELOW_THE_CLI = list(
    dict.fromkeys(["orchestrator.commands.common", "orchestrator.server", *COMMAND_MODULES])
)
HEAVY = ("torch", "sky", "boto3", "google.cloud.storage", "sqlalchemy", "fastapi", "uvicorn")


def test_command_modules_server_and_demo_import_without_the_cli() -> None:
    modules = [*BELOW_THE_CLI, "orchestrator.demo", "orchestrator.demo_elastic"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print('orchestrator.cli' in sys.modules)\n"
        f"print(sorted(set({HEAVY!r}) & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    cli_loaded, heavy = out.stdout.splitlines()
    assert cli_loaded == "False"
    # The CLI imports all of these at startup, so they must stay as light as --help.
    assert heavy == "[]"


def _imports_of(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_no_module_below_the_cli_imports_it_even_lazily() -> None:
    # The import test above only sees module-level imports; a `from orchestrator.cli
    # import ...` inside a function is the same circle, closed later.
    for name in [*BELOW_THE_CLI, "orchestrator.demo", "orchestrator.demo_elastic"]:
        path = ROOT / (name.replace(".", "/") + ".py")
        assert "orchestrator.cli" not in _imports_of(path), f"{name} imports orchestrator.cli"


def test_the_command_modules_found_are_the_real_ones() -> None:
    # Guards the two tests above against an empty discovery passing vacuously.
    assert {"orchestrator.commands.recovery", "orchestrator.commands.plan"} <= set(COMMAND_MODULES)
