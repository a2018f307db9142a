"""The local launcher finds every process of a node, even ones torchrun put in a
session of their own and orphans whose parent was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from orchestrator.launchers.local import NODE_MARKER, node_pids

# A "torchrun": starts a "worker" in a session of its own, prints its pid, sleeps.
PARENT = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(w.pid, flush=True)
time.sleep(60)
"""


def _wait_gone(pids: list[int], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not node_pids("job", "n1"):
            return True
        time.sleep(0.05)
    return False


def test_a_node_is_every_process_with_its_marker_whatever_session_it_is_in():
    env = {**os.environ, NODE_MARKER: "job/n1"}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        worker = int(parent.stdout.readline())
        assert os.getsid(worker) != os.getsid(parent.pid)  # its own session, as torchrun does
        assert sorted(node_pids("job", "n1")) == sorted([parent.pid, worker])
        assert node_pids("job", "n2") == []
        parent.kill()  # the parent dies; the worker is an orphan now
        parent.wait()
        assert node_pids("job", "n1") == [worker]
        os.kill(worker, signal.SIGKILL)
        assert _wait_gone([worker])
    finally:
        parent.kill()
        for pid in node_pids("job", "n1"):
            os.kill(pid, signal.SIGKILL)
