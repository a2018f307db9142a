"""Two emulators with hosts never run at once on one machine: each holds the hosts
lock for its life, and a second waits for it (an error after its wait). Before, a
default-run test's emulator (tests/awsemu/test_down.py, bridge mbr0) started and
stopped beside the long loop's and its ``down`` removed the loop's bridge mid-run:
every host made after that failed ("mbr0 ... Device does not exist", issue 19)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from orchestrator.awsemu import emulator


def test_a_second_holder_of_the_hosts_lock_waits_for_the_first_then_gets_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "hosts.lock"
    logged: list[str] = []
    first = emulator._hold_hosts_lock(logged.append, path, wait_s=1)
    with pytest.raises(emulator.EmulatorError, match="another emulator with hosts still runs"):
        emulator._hold_hosts_lock(logged.append, path, wait_s=0.3)
    assert any("waiting for another emulator" in m for m in logged)
    got: list[float] = []

    def second() -> None:
        f = emulator._hold_hosts_lock(logged.append, path, wait_s=10)
        got.append(time.monotonic())
        f.close()

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.5)
    assert not got  # still waiting: the first holds it
    released = time.monotonic()
    first.close()
    t.join(10)
    assert got and got[0] >= released

