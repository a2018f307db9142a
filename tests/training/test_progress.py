"""Progress reports reach a listening agent and cost nothing without one."""

from __future__ import annotations

import json
import socket

from training.progress import ProgressReporter


def test_report_arrives_as_one_json_datagram():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as agent:
        agent.bind(("127.0.0.1", 0))
        agent.settimeout(5)
        port = agent.getsockname()[1]
        ProgressReporter(f"127.0.0.1:{port}", rank=3).progress(
            step=7, step_time=0.5, loss=2.5, grad_norm=1.25, samples_per_s=16.0
        )
        doc = json.loads(agent.recv(8192))
    assert doc["type"] == "progress" and doc["rank"] == 3
    assert (doc["step"], doc["loss"], doc["grad_norm"]) == (7, 2.5, 1.25)


def test_no_agent_listening_is_skipped_and_reporting_resumes_once_one_listens():
    """Best effort: a rank's steps never wait on, or fail for, a missing agent (an
    agent restarting), and the next datagram after it is back arrives."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nobody listens there
    r = ProgressReporter(f"127.0.0.1:{port}")
    for step in range(100):  # the port answers ICMP unreachable; the error is dropped
        r.send("progress", step=step)
    assert r.enabled
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as agent:
        agent.bind(("127.0.0.1", port))
        agent.settimeout(5)
        r.send("progress", step=100)
        doc = json.loads(agent.recv(65536))
    assert (doc["type"], doc["step"]) == ("progress", 100)


def test_unset_or_garbage_address_disables_reporting(monkeypatch):
    monkeypatch.delenv("SKYRESUME_RUN_PROGRESS_ADDR", raising=False)
    assert not ProgressReporter().enabled
    assert not ProgressReporter("not-an-address").enabled
    ProgressReporter("nope").send("progress", step=1)
