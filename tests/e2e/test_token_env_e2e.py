"""Tokens stay where they belong, in a real run: ``skyresume serve`` with the local
launcher, real agents, torchrun and CPU ranks. While the ranks train, every process
of every node (found by the local launcher's inherited marker, SKYRESUME_LOCAL_NODE)
is read from /proc: no operator token and no agent token is in the environment or
the command line of any of them but the agent itself, and none is in any log.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from orchestrator.api.auth import job_token, node_token
from orchestrator.demo import DemoService, api_get, api_post, job_spec, wait_for
from orchestrator.launchers.localboot import NODE_MARKER

# ~50 s measured here (2 cores, shared): over the default run's 30 s, so -m long;
# test_token_env_agent.py keeps the agent-side claim in it.
pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(600)]


def node_processes(job: str) -> dict[int, tuple[bytes, bytes]]:
    """pid -> (environ, cmdline) of every live process marked as a node of ``job``."""
    mark = f"{NODE_MARKER}={job}/".encode()
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{entry.name}/environ").read_bytes()
            if any(v.startswith(mark) for v in env.split(b"\0")):
                cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                out[int(entry.name)] = (env, cmd)
    return out


def shown(cmdline: bytes) -> str:
    return cmdline.replace(b"\0", b" ")[:100].decode(errors="replace")


def is_agent(cmdline: bytes) -> bool:
    # ``-m orchestrator.agent``, or the templates' ``-c '...run_module("orchestrator.agent"...'``
    # run by a python (the run's shell holds the same text in its script)
    argv = cmdline.split(b"\0")
    return b"python" in argv[0].rsplit(b"/", 1)[-1] and any(
        a == b"orchestrator.agent" or b'run_module("orchestrator.agent"' in a for a in argv
    )


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.fixture
def service(tmp_path):  # type: ignore[no-untyped-def]
    svc = DemoService(tmp_path)
    http = svc.wait_ready()
    yield svc, http
    svc.stop()


def test_no_node_process_but_the_agent_holds_a_token_and_no_log_line_does(service, tmp_path):
    svc, http = service
    bootstrap = (svc.home / "token").read_text().strip()
    stored = api_post(http, "/v1/tokens", {"name": "ops", "role": "operator"})["token"]
    spec = {**job_spec(tmp_path, 400), "ranks_per_node": 1}  # 2 nodes x 1 rank: cheap
    job = api_post(http, "/v1/jobs", spec)["id"]
    end = time.monotonic() + 400
    st = wait_for(http, job, "step 3", lambda st, n, v, step: v is not None and step >= 3, end)
    assert st[0] == "RUNNING", st

    agent_token = job_token(bootstrap, job, 1)
    secrets = {"the bootstrap token": bootstrap.encode(), "a stored operator token":
               stored.encode(), "the agent token": agent_token.encode()}  # fmt: skip
    for k in range(2):  # what register hands each node: a token for its own routes
        secrets[f"node {k}'s token"] = node_token(bootstrap, job, 1, f"{job}-a1-n{k}").encode()
    procs = node_processes(job)
    agents = [p for p, (_, cmd) in procs.items() if is_agent(cmd)]
    others = {p: v for p, v in procs.items() if p not in agents}
    ranks = [p for p, (env, _) in others.items()
             if any(v.startswith(b"LOCAL_RANK=") for v in env.split(b"\0"))]  # fmt: skip
    # The scan sees the real thing: both agents, torchrun and the ranks.
    assert len(agents) == 2 and len(ranks) >= 2, [shown(c) for _, c in procs.values()]
    # The task carries a single-use enrolment token (SkyPilot stores task secrets in
    # plaintext): the agents started with it, and hold the attempt's token in memory only.
    assert all(b"SKYRESUME_AGENT_TOKEN=sre_" in procs[p][0] for p in agents), "enrolment tokens"
    assert not any(agent_token.encode() in procs[p][0] for p in agents)
    # Only the agent and the run's shell that started it (its environment is fixed at
    # its exec) ever held the enrolment token: nothing the agent starts does.
    holders = {*agents, *(parent(p) for p in agents)}
    assert not [
        shown(cmd) for p, (env, cmd) in procs.items()
        if p not in holders and b"SKYRESUME_AGENT_TOKEN=" in env
    ]  # fmt: skip
    leaks = [
        f"pid {pid} ({shown(cmd)}) holds {what} in its {where}"
        for pid, (env, cmd) in others.items()
        for what, secret in secrets.items()
        for where, blob in (("environment", env), ("command line", cmd))
        if secret in blob
    ]
    leaks += [
        f"the agent {pid} holds {what} on its command line"
        for pid in agents
        for what, secret in secrets.items()
        if secret in procs[pid][1]
    ]
    assert leaks == []

    api_post(http, f"/v1/jobs/{job}/cancel", {})
    wait_for(http, job, "the end", lambda st, n, v, step: st == "CANCELLED", end)
    logs = [svc.home / "service.log", *(svc.home / "local-nodes").rglob("*.log")]
    logged = [
        f"{path.relative_to(svc.home)} holds {what}"
        for path in logs
        if path.is_file()
        for what, secret in secrets.items()
        if secret in path.read_bytes()
    ]
    assert len(logs) > 4 and logged == []
    assert api_get(http, "/v1/whoami") == {"name": "bootstrap", "role": "admin"}
