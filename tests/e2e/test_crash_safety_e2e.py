"""The service SIGKILLed inside the restart protocol comes back on the same home and
database and finishes the incident with exactly one relaunch, losing and repeating no
event: ``bench/crashsafe.py``'s kill points, on SQLite and PostgreSQL (real service
processes, real nodes on loopback; a kill point is about 80 s)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1800)]

_ROOT = Path(__file__).resolve().parents[2]


def _crashsafe():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_crashsafe", _ROOT / "bench/crashsafe.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "db,points",
    [
        ("sqlite", ["detect", "signal", "confirm_checkpoint", "select_replacement"]),
        ("sqlite", ["launch", "provisioning", "launch-accepted", "stage", "validate"]),
        pytest.param("postgres", ["signal", "launch", "launch-accepted", "validate"],
                     marks=pytest.mark.postgres),
    ],
    ids=["sqlite-early-steps", "sqlite-launch-and-after", "postgres"],
)  # fmt: skip
def test_a_service_killed_at_each_protocol_step_relaunches_exactly_once(
    db: str, points: list[str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if db == "postgres":
        request.getfixturevalue("postgres_server_url")  # skips (or fails in CI) without one
    results = _crashsafe().run([db], points, home=tmp_path)
    bad = {r.point: r.problems for r in results if not r.ok}
    assert not bad, bad
    for r in results:
        assert r.attempts == [1, 2] and r.launch_keys == [f"{r.job}-a1", f"{r.job}-a2"]
