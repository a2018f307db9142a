"""The local provisioner runs the same rendered SkyPilot task a cloud would, on nodes
that are hosts of their own, and its launches take time and fail like a cloud's.

Real processes throughout: the boot process, the task's run (the real agent from
the gpt-cpu template), network namespaces where we are root."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import secrets
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.contract import Env
from orchestrator.domain.plan import Placement
from orchestrator.domain.spec import TaskSpec
from orchestrator.launchers.base import LaunchPhase, LaunchRequest
from orchestrator.launchers.local import LocalLauncher, LocalLauncherConfig, node_pids
from orchestrator.launchers.netns import Fabric


def _request(job: str, *, nodes: int = 2, region: str = "local") -> LaunchRequest:
    return LaunchRequest(
        job_id=job,
        attempt=1,
        placement=Placement("local", region, "cpu-process", None, 0, nodes, True),
        command="python -m training.examples.train_gpt --max-steps 1 --note '$(touch /tmp/x)'",
        env={Env.SERVICE_URL: "http://10.255.255.1:9", Env.JOB_ID: job, Env.ATTEMPT: "1"},
        ranks_per_node=1,
        grace_s=5,
        task=TaskSpec(template="gpt-cpu", command="python -m training.examples.train_gpt"),
    )


def _wait(launcher: LocalLauncher, handle, phase: LaunchPhase, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = launcher.progress(handle)
        if p.phase is phase:
            return p
        if p.phase is LaunchPhase.FAILED:
            raise AssertionError(f"launch failed: {p.detail}")
        time.sleep(0.2)
    raise AssertionError(f"still {launcher.progress(handle)} after {timeout} s")


def _gone(job: str, node_ids: tuple[str, ...], within_s: float = 10.0) -> bool:
    """Nothing of the nodes runs any more (a SIGKILLed process takes a moment to go)."""
    deadline = time.monotonic() + within_s
    while any(node_pids(job, n) for n in node_ids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> str:
    """This checkout's agent wheel, as the service serves it (a path pip installs from)."""
    from orchestrator.package import WheelCache

    return str(WheelCache(tmp_path_factory.mktemp("dist")).wheel().path)


@pytest.fixture
def loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wheel: str):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SKYRESUME_TOKEN", "the-operator-token")  # must never reach a node
    launcher = LocalLauncher(
        tmp_path / "nodes", "http://10.255.255.1:9", lambda job, attempt: f"agent-token-{job}",
        LocalLauncherConfig(provision_delay_s=1.0, package=wheel),
    )  # fmt: skip
    yield launcher
    launcher.close()


def test_a_launch_is_a_request_that_provisions_then_runs_the_rendered_task(loopback):
    launcher = loopback
    handle = launcher.launch(_request("j1"))
    assert launcher.progress(handle).phase is LaunchPhase.PROVISIONING  # not waited on
    _wait(launcher, handle, LaunchPhase.UP)
    try:
        pids = {
            n: int((launcher.node_dir("j1", n) / "agent.pid").read_text()) for n in handle.node_ids
        }
        for k, (node, pid) in enumerate(pids.items()):
            env = _environ(pid)
            assert env["SKYPILOT_NODE_RANK"] == str(k)
            assert env["SKYPILOT_NUM_NODES"] == "2"
            assert env["SKYPILOT_NODE_IPS"].splitlines() == ["127.0.0.1", "127.0.0.1"]
            assert env["SKYPILOT_TASK_ID"].endswith("_j1-a1_1")
            assert env["SKYRESUME_AGENT_TOKEN"] == "agent-token-j1"  # a task secret
            assert "SKYRESUME_TOKEN" not in env  # nothing of the service's environment
            assert env[Env.SERVICE_URL] == "http://10.255.255.1:9"
            assert node_pids("j1", node)  # the run carries the node's marker
    finally:
        launcher.down(handle)
    assert _gone("j1", handle.node_ids)


def test_a_region_stocked_out_while_provisioning_fails_the_accepted_request_for_capacity(
    loopback,
):
    launcher = loopback
    handle = launcher.launch(_request("j2"))
    launcher.stockout("local", seconds=60)
    p = _wait_failed(launcher, handle)
    assert p.capacity and "InsufficientInstanceCapacity" in p.detail
    assert _gone("j2", handle.node_ids)


def _wait_failed(launcher: LocalLauncher, handle, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = launcher.progress(handle)
        if p.phase is LaunchPhase.FAILED:
            return p
        time.sleep(0.2)
    raise AssertionError(f"never failed: {launcher.progress(handle)}")


def test_a_failing_setup_fails_the_request_naming_the_node_and_its_log(loopback):
    launcher = loopback
    launcher.config = dataclasses.replace(
        launcher.config,
        package="http://10.255.255.1:9/v1/agent/dist/none.whl",  # unreachable
        pip_args="--no-index --no-deps --timeout 1 --retries 0",
    )
    handle = launcher.launch(_request("j3", nodes=1))
    p = _wait_failed(launcher, handle, timeout=60)
    assert "setup failed on j3-a1-n0" in p.detail and "setup.log" in p.detail
    assert not p.capacity


def test_a_user_s_own_task_yaml_runs_its_setup_and_hands_its_run_to_the_agent(loopback, tmp_path):
    task = tmp_path / "task.yaml"
    task.write_text(
        'setup: |\n  echo user-setup-ran > "$HOME/marker"\n'
        "run: |\n  echo rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES\n"
    )
    req = _request("j5", nodes=1)
    # as the reconciler asks for it: the YAML's run is the command, none of its own
    req = LaunchRequest(
        **{**req.__dict__, "command": "", "task": TaskSpec(skypilot_yaml=str(task))}
    )
    handle = loopback.launch(req)
    _wait(loopback, handle, LaunchPhase.UP)
    try:
        node = handle.node_ids[0]
        home = loopback.node_home("j5", node)
        assert (home / "marker").read_text().strip() == "user-setup-ran"  # after the agent's
        assert (home / "skyresume" / "pkg" / "orchestrator").is_dir()  # the agent installed
        env = _environ(int((loopback.node_dir("j5", node) / "agent.pid").read_text()))
        assert env["SKYRESUME_COMMAND"].startswith("bash -c ")
        assert "echo rank $SKYPILOT_NODE_RANK" in env["SKYRESUME_COMMAND"]
    finally:
        loopback.down(handle)


@pytest.mark.skipif(Fabric.unavailable_reason() is not None, reason="needs network namespaces")
def test_nodes_in_namespaces_are_hosts_of_their_own(tmp_path: Path, wheel: str):
    # A private bridge and subnet: the fabric's defaults are the emulated AWS's
    # (10.213.0.0/16), whose tests may run beside this one, and then the fabric refuses
    # the overlapping subnet (seen here while the emulator's loop e2e ran).
    fabric = Fabric(tmp_path / "nodes" / "fabric", bridge=f"srbrp{secrets.token_hex(2)}",
                    subnet=f"10.219.{random.randrange(256)}.0/24")  # fmt: skip
    fabric.up()
    launcher = LocalLauncher(
        tmp_path / "nodes", "http://10.255.255.1:9", lambda job, attempt: "t",
        LocalLauncherConfig(network="netns", package=wheel), fabric=fabric,
    )  # fmt: skip
    try:
        handle = launcher.launch(_request("j4"))
        _wait(launcher, handle, LaunchPhase.UP)
        pids = [
            int((launcher.node_dir("j4", n) / "agent.pid").read_text()) for n in handle.node_ids
        ]
        mine = os.readlink("/proc/self/ns/net")
        spaces = {os.readlink(f"/proc/{pid}/ns/net") for pid in pids}
        assert mine not in spaces and len(spaces) == 2
        ips = _environ(pids[0])["SKYPILOT_NODE_IPS"].splitlines()
        assert len(set(ips)) == 2 and all(not ip.startswith("127.") for ip in ips)
        assert _environ(pids[0])["SKYRESUME_METADATA_URL"] == ""  # the provider's own address
        launcher.down(handle)
        assert not launcher.fabric.hosts()  # the hosts went back with the nodes
    finally:
        fabric = launcher.fabric
        launcher.close()
        fabric.teardown()


def test_a_host_is_never_handed_out_twice_until_it_is_given_back(tmp_path: Path, wheel: str):
    """A cut-off node that was not given back still holds its machine: a replacement
    must land on another one, as a cloud gives a fresh VM."""
    from orchestrator.launchers.base import CapacityError

    launcher = LocalLauncher(
        tmp_path / "nodes", "http://10.255.255.1:9", lambda job, attempt: "t",
        LocalLauncherConfig(package=wheel, hosts_per_region=1),
    )  # fmt: skip
    try:
        first = launcher.launch(_request("j6", nodes=1))
        assert first.hosts == ("local-host0",)
        with pytest.raises(CapacityError, match="0 free hosts for 1 nodes"):
            launcher.launch(_request("j7", nodes=1))
        launcher.down(first)
        assert launcher.launch(_request("j7", nodes=1)).hosts == ("local-host0",)
    finally:
        for job in ("j6", "j7"):
            with contextlib.suppress(Exception):
                launcher.down(launcher_handle(launcher, job))
        launcher.close()


def launcher_handle(launcher: LocalLauncher, job: str):  # type: ignore[no-untyped-def]
    from orchestrator.launchers.base import LaunchHandle

    return LaunchHandle(f"{job}-a1", "local", (f"{job}-a1-n0",), ("local-host0",))


def _agent_of(job: str, node: str, within_s: float = 60.0) -> int:
    """The node's agent process (found by the node's marker and its module)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for pid in node_pids(job, node):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                # The python running the agent, not the run's shell (its script names it).
                is_python = b"python" in os.path.basename(argv[0])
                if is_python and b"orchestrator.agent" in b" ".join(argv):
                    return pid
        time.sleep(0.2)
    raise AssertionError(f"no agent of {node} found in {within_s} s")


def test_a_node_kept_across_attempts_keeps_its_disk_and_its_served_package(loopback):
    """As a cloud VM that stays keeps its disk: the kept machine's next run finds the
    script's own snapshot and the agent package its setup installed (a restart runs
    no setup), and its agent runs from that package, not the image's skyresume."""
    launcher = loopback
    first = launcher.launch(_request("j8", nodes=1))
    _wait(launcher, first, LaunchPhase.UP)
    (node,) = first.node_ids
    home = launcher.node_home("j8", node)
    served = home / "skyresume" / "pkg" / "orchestrator" / "agent" / "__main__.py"
    assert served.exists()  # the first launch's setup installed the served wheel
    (home / "snapshot.pt").write_bytes(b"epoch 1720")  # what the script saved there
    # The attempt ends; the machine stays (kept for the next attempt, not given back).
    launcher.kill_node("j8", node)
    assert _gone("j8", first.node_ids)

    second = launcher.restart(first, replace(_request("j8", nodes=1), attempt=2))
    try:
        _wait(launcher, second, LaunchPhase.UP)
        (kept,) = second.node_ids
        assert kept != node and second.hosts == first.hosts  # a new node id, the same machine
        new_home = launcher.node_home("j8", kept)
        assert (new_home / "snapshot.pt").read_bytes() == b"epoch 1720"
        env = _environ(_agent_of("j8", kept))
        assert Path(env["HOME"]).resolve() == home.resolve()
        pkg = env["PYTHONPATH"].split(":")[0]
        assert Path(pkg).resolve() == (home / "skyresume" / "pkg").resolve()
        assert (Path(pkg) / "orchestrator" / "agent" / "__main__.py").exists()
    finally:
        launcher.down(second)
        launcher.down(first)
    assert _gone("j8", (*first.node_ids, *second.node_ids))


def test_a_fresh_launch_gets_a_fresh_disk(loopback):
    launcher = loopback
    first = launcher.launch(_request("j9", nodes=1))
    _wait(launcher, first, LaunchPhase.UP)
    (launcher.node_home("j9", first.node_ids[0]) / "snapshot.pt").write_bytes(b"x")
    launcher.down(first)
    second = launcher.launch(replace(_request("j9", nodes=1), attempt=2))
    try:
        _wait(launcher, second, LaunchPhase.UP)
        assert not (launcher.node_home("j9", second.node_ids[0]) / "snapshot.pt").exists()
    finally:
        launcher.down(second)
