"""Three ``skyresume serve`` replicas on one PostgreSQL database: the leader is taken
out (SIGKILL, SIGSTOP) in the middle of recoveries, another takes the lease within its
TTL, no attempt is launched twice, and every incident completes
(``bench/failover.py``; real service processes, real nodes on loopback)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.postgres,
    pytest.mark.timeout(1800),
]

_ROOT = Path(__file__).resolve().parents[2]


def _failover():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(_ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_failover", _ROOT / "bench/failover.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_leader_taken_out_mid_recovery_is_replaced_within_the_ttl_and_never_doubles_a_launch(
    tmp_path: Path, postgres_server_url: str
) -> None:
    doc = _failover().run(replicas=3, incidents=4, seed=3, home=tmp_path)
    assert doc["ok"], doc["problems"]
    assert len(doc["rounds"]) == 4
    assert {r["leader_out"] for r in doc["rounds"]} == {"SIGKILL", "SIGSTOP"}
    assert doc["takeover_s_max"] <= doc["ttl_s"] + 1.0
    assert doc["launch_keys"] == sorted(f"{doc['job']}-a{k}" for k in range(1, 6))
