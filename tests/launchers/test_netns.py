"""The fabric, on the real kernel: namespaces, a bridge, veths, tbf, link state.

Every test builds its own fabric on a bridge and /24 that a demo run (``srbr0``,
10.213.0.0/16) never uses, and tears it down in the fixture's finalizer. Processes
"on a node" are real ones started through :meth:`Fabric.exec_prefix`.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cloud.simulator import MetadataSimulator
from orchestrator.launchers.netns import Fabric, FabricError, Host, parse_rate

REASON = Fabric.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network fabric: {REASON}")

# Echoes one line per connection; prints "ready" once bound.
ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        with c:
            c.sendall(c.recv(100))
    """
)
# Exits 0 when it can talk to HOST:PORT, 1 when it cannot (within argv[3] seconds: a
# working link answers in milliseconds, so a short wait cannot hide a leaky partition).
ECHO_CLIENT = textwrap.dedent(
    """
    import socket, sys
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=timeout) as c:
            c.sendall(b"hello")
            sys.exit(0 if c.recv(100) == b"hello" else 2)
    except OSError:
        sys.exit(1)
    """
)


def _clean_env() -> dict[str, str]:
    # A proxy setting would send the node's metadata reads somewhere else entirely.
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


def on_node(fabric: Fabric, host: Host, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*fabric.exec_prefix(host), sys.executable, "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=_clean_env())


@pytest.fixture
def make_fabric(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """Bridge, subnet and state dir for one test; whatever was built on them is torn down."""
    if REASON is not None:
        pytest.skip(f"no network fabric: {REASON}")
    bridge = f"srbrt{secrets.token_hex(2)}"
    subnet = f"10.214.{random.randrange(256)}.0/24"
    state = tmp_path / "fabric"
    yield bridge, subnet, state
    Fabric(state, bridge=bridge, subnet=subnet).teardown()


@pytest.fixture
def fabric(make_fabric: tuple[str, str, Path]) -> Fabric:
    bridge, subnet, state = make_fabric
    f = Fabric(state, bridge=bridge, subnet=subnet)
    f.up()
    return f


@pytest.fixture
def echo_servers() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def start_echo(
    procs: list[subprocess.Popen[str]], prefix: list[str], ip: str, port: int
) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [*prefix, sys.executable, "-c", ECHO_SERVER, ip, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_two_hosts_get_distinct_ips_and_reach_each_other_and_the_gateway(
    fabric: Fabric, echo_servers: list[subprocess.Popen[str]]
) -> None:
    a, b = fabric.add_host("node-a"), fabric.add_host("node-b")
    assert a.ip != b.ip and a.netns != b.netns and a.veth != b.veth
    assert all(len(h.veth) <= 15 and len(h.ifname) <= 15 for h in (a, b))

    start_echo(echo_servers, fabric.exec_prefix(a), a.ip, 7001)
    start_echo(echo_servers, [], fabric.gateway, 7002)  # the host, on the bridge
    assert on_node(fabric, b, ECHO_CLIENT, a.ip, "7001").returncode == 0
    assert on_node(fabric, b, ECHO_CLIENT, fabric.gateway, "7002").returncode == 0
    assert on_node(fabric, a, ECHO_CLIENT, fabric.gateway, "7002").returncode == 0
    # ...and a's server is not on b: the nodes are separate hosts, not one loopback.
    assert on_node(fabric, b, ECHO_CLIENT, "127.0.0.1", "7001", "0.3").returncode == 1


METADATA_READER = textwrap.dedent(
    """
    import json, urllib.request
    def get(url, method="GET", **headers):
        req = urllib.request.Request(url, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
    aws = "http://169.254.169.254"
    _, token = get(aws + "/latest/api/token", "PUT",
                   **{"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    out = {
        "aws_no_token": get(aws + "/latest/meta-data/spot/instance-action"),
        "aws": get(aws + "/latest/meta-data/spot/instance-action",
                   **{"X-aws-ec2-metadata-token": token}),
        "gcp": get("http://metadata.google.internal/computeMetadata/v1/instance/preempted",
                   **{"Metadata-Flavor": "Google"}),
        "gcp_no_flavor": get(
            "http://metadata.google.internal/computeMetadata/v1/instance/preempted"),
        "azure": get(aws + "/metadata/scheduledevents?api-version=2020-07-01", Metadata="true"),
    }
    print(json.dumps(out))
    """
)


def test_a_node_reads_what_the_simulator_was_told_for_it_at_the_real_addresses(
    fabric: Fabric,
) -> None:
    a, b = fabric.add_host("node-a"), fabric.add_host("node-b")
    with MetadataSimulator(fabric.gateway, 0) as sim:
        for h in (a, b):
            fabric.start_metadata(h, sim.node_url(h.name))
        sim.schedule_notice("node-a", "aws", "terminate", 120)
        seen_a = json.loads(on_node(fabric, a, METADATA_READER).stdout)
        sim.schedule_notice("node-a", "gcp", "preempt", 30)
        seen_a_gcp = json.loads(on_node(fabric, a, METADATA_READER).stdout)
        seen_b = json.loads(on_node(fabric, b, METADATA_READER).stdout)

    assert seen_a["aws_no_token"][0] == 401  # IMDSv2: the token header went through
    status, body = seen_a["aws"]
    assert status == 200 and json.loads(body)["action"] == "terminate"
    assert seen_a["gcp"] == [200, "FALSE"]
    assert seen_a_gcp["gcp"] == [200, "TRUE"]
    assert seen_a_gcp["gcp_no_flavor"][0] == 403
    assert json.loads(seen_a_gcp["azure"][1])["Events"] == []
    # node-b's front reads node-b's state: nothing was scheduled for it.
    assert seen_b["aws"][0] == 404 and seen_b["gcp"] == [200, "FALSE"]


def test_a_gcp_long_poll_through_the_front_answers_at_the_change(fabric: Fabric) -> None:
    a = fabric.add_host("node-a")
    code = textwrap.dedent(
        """
        import time, urllib.request
        url = ("http://metadata.google.internal/computeMetadata/v1/instance/preempted"
               "?wait_for_change=true&timeout_sec=20")
        req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        t = time.monotonic()
        with urllib.request.urlopen(req, timeout=30) as r:
            print(r.read().decode(), r.headers["ETag"], round(time.monotonic() - t, 2))
        """
    )
    with MetadataSimulator(fabric.gateway, 0) as sim:
        fabric.start_metadata(a, sim.node_url("node-a"))
        threading.Timer(0.5, sim.schedule_notice, ("node-a", "gcp", "preempt", 30)).start()
        value, etag, waited = on_node(fabric, a, code).stdout.split()
    assert value == "TRUE" and etag  # the answer of the change, its ETag passed through
    assert float(waited) < 15  # answered at the change, not at the poll's timeout


def test_partition_cuts_the_node_off_and_heal_restores_it(
    fabric: Fabric, echo_servers: list[subprocess.Popen[str]]
) -> None:
    a, b = fabric.add_host("node-a"), fabric.add_host("node-b")
    server = start_echo(echo_servers, fabric.exec_prefix(a), a.ip, 7001)
    assert on_node(fabric, b, ECHO_CLIENT, a.ip, "7001").returncode == 0

    fabric.partition("node-a")
    assert fabric.is_partitioned("node-a")
    assert on_node(fabric, b, ECHO_CLIENT, a.ip, "7001", "0.3").returncode == 1
    assert on_node(fabric, a, ECHO_CLIENT, fabric.gateway, "7001", "0.3").returncode == 1
    assert server.poll() is None  # its processes live on
    fabric.add_host("node-a")  # a restarted service's repair must not heal it
    assert fabric.is_partitioned("node-a")

    fabric.heal("node-a")
    assert not fabric.is_partitioned("node-a")
    assert on_node(fabric, b, ECHO_CLIENT, a.ip, "7001").returncode == 0


def _receive_rate(fabric: Fabric, host: Host, nbytes: int) -> float:
    """Bytes/s of one TCP stream from ``host`` to the gateway, timed where it lands."""
    srv = socket.create_server((fabric.gateway, 0))
    port = srv.getsockname()[1]
    sender = textwrap.dedent(
        """
        import socket, sys
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as c:
            c.sendall(b"x" * int(sys.argv[3]))
        """
    )
    proc = subprocess.Popen(
        [
            *fabric.exec_prefix(host),
            sys.executable,
            "-c",
            sender,
            fabric.gateway,
            str(port),
            str(nbytes),
        ]
    )
    try:
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            got, first = 0, 0.0
            while chunk := conn.recv(1 << 16):
                first = first or time.monotonic()
                got += len(chunk)
            elapsed = time.monotonic() - first
    finally:
        srv.close()
        proc.wait(30)
    assert got == nbytes
    return got / max(elapsed, 1e-6)


def test_shape_limits_a_transfer_from_the_node_and_unshape_lifts_it(fabric: Fabric) -> None:
    a = fabric.add_host("node-a")
    nbytes = 1_000_000
    free = _receive_rate(fabric, a, nbytes)
    fabric.shape("node-a", "16mbit")  # 2 MB/s: the megabyte takes about half a second
    shaped = _receive_rate(fabric, a, nbytes)
    fabric.unshape("node-a")
    fabric.unshape("node-a")  # idempotent
    lifted = _receive_rate(fabric, a, nbytes)
    assert free > 5 * shaped, (free, shaped)
    assert lifted > 5 * shaped, (lifted, shaped)


@pytest.mark.parametrize("rate", ["20m", "fast", "-5mbit", "0mbit", "20 mbits", ""])
def test_a_bad_rate_is_refused_naming_it(rate: str) -> None:
    with pytest.raises(ValueError, match=f"rate {rate!r}"):
        parse_rate(rate)


@needs_netns
def test_shape_refuses_a_bad_rate_before_touching_the_link(fabric: Fabric) -> None:
    fabric.add_host("node-a")
    with pytest.raises(ValueError, match="'20megabit'"):
        fabric.shape("node-a", "20megabit")


def test_tc_rates_are_read_in_tc_units() -> None:
    assert parse_rate("20mbit") == 20_000_000
    assert parse_rate("2mbps") == 16_000_000
    assert parse_rate("1.5Gbit") == 1_500_000_000


def test_add_host_is_idempotent_and_a_new_fabric_finds_the_same_hosts(
    make_fabric: tuple[str, str, Path],
) -> None:
    bridge, subnet, state = make_fabric
    first = Fabric(state, bridge=bridge, subnet=subnet)
    first.up()
    a, b = first.add_host("node-a"), first.add_host("node-b")
    assert first.add_host("node-a") == a

    again = Fabric(state, bridge=bridge, subnet=subnet)  # a restarted service
    again.up()
    assert again.hosts() == [a, b]
    assert again.add_host("node-b") == b
    c = again.add_host("node-c")
    assert c.ip not in {a.ip, b.ip}  # never handed out twice

    again.remove_host("node-a")
    assert [h.name for h in again.hosts()] == ["node-b", "node-c"]
    assert not Path(f"/run/netns/{a.netns}").exists()

    with pytest.raises(ValueError, match="belongs to bridge"):
        Fabric(state, bridge=bridge, subnet="10.215.0.0/24").hosts()


def test_a_stale_namespace_is_cleared_and_namespaces_not_ours_are_left_alone(
    fabric: Fabric,
) -> None:
    stale = f"sr-{fabric.bridge}-9"  # ours by name, unknown to state: a crashed run's
    foreign = f"sr-other{secrets.token_hex(2)}-0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        fabric.up()
        assert not Path(f"/run/netns/{stale}").exists()
        assert Path(f"/run/netns/{foreign}").exists()
        fabric.teardown()
        assert Path(f"/run/netns/{foreign}").exists()
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=False)
        subprocess.run(["ip", "netns", "del", stale], check=False, capture_output=True)


def test_a_subnet_that_overlaps_another_link_is_refused_before_anything_is_made(
    fabric: Fabric, tmp_path: Path
) -> None:
    inner = str(next(fabric.subnet.subnets(new_prefix=26)))
    other = Fabric(tmp_path / "other", bridge=f"srbru{secrets.token_hex(2)}", subnet=inner)
    with pytest.raises(FabricError, match=f"overlaps .* on {fabric.bridge}"):
        other.up()
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert other.bridge not in links


def test_teardown_leaves_no_namespace_no_bridge_and_no_process(fabric: Fabric) -> None:
    a = fabric.add_host("node-a")
    fabric.add_host("node-b")
    with MetadataSimulator(fabric.gateway, 0) as sim:
        front = fabric.start_metadata(a, sim.node_url("node-a"))
        assert fabric.start_metadata(a, sim.node_url("node-a")) == front  # idempotent
        restarted = Fabric(fabric.state_dir, bridge=fabric.bridge, subnet=str(fabric.subnet))
        assert restarted.start_metadata(a, sim.node_url("node-a")) == front  # found again
        sleeper = subprocess.Popen([*fabric.exec_prefix(a), "sleep", "600"])
        fabric.teardown()
        assert sleeper.wait(5) != 0  # the node's processes died with it
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"sr-{fabric.bridge}-" not in listed
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert fabric.bridge not in links
    assert not Path(f"/proc/{front}").exists()
    assert not Path(f"/etc/netns/{a.netns}").exists()
    fabric.teardown()  # idempotent


@pytest.mark.long
def test_gloo_all_reduce_across_two_nodes(fabric: Fabric, tmp_path: Path) -> None:
    hosts = [fabric.add_host("node-0"), fabric.add_host("node-1")]
    script = tmp_path / "allreduce.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch, torch.distributed as dist
            dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            print(int(t.item()), flush=True)
            dist.destroy_process_group()
            """
        )
    )
    port = str(random.randrange(20000, 30000))
    procs = []
    for rank, h in enumerate(hosts):
        env = {
            **_clean_env(),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": hosts[0].ip,
            "MASTER_PORT": port,
            "GLOO_SOCKET_IFNAME": h.ifname,
        }
        cmd = [*fabric.exec_prefix(h), sys.executable, str(script)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["3", "3"]
