"""Hosts: an instance moto starts is a machine on the bridge, and ends with its instance.

The namespace tests need root, ``ip``/``unshare`` and Debian's sshd (which
:func:`~orchestrator.awsemu.hosts.ensure_prerequisites` installs); elsewhere they skip
saying which is missing. They share one emulator (bridge ``mbrt``), so a developer's
own ``up`` on the same address space makes them skip rather than fight it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.awsemu import emulator
from orchestrator.awsemu.ec2 import keys_from_user_data
from orchestrator.awsemu.front import admin
from orchestrator.awsemu.hosts import HostError, HostPool, ensure_prerequisites, unavailable_reason
from orchestrator.launchers.netns import bridge_mac

AMI = "ami-785db401"
BRIDGE = "mbrt"


# sshd is left out: it is installed (apt) when a test first needs it, never at collection.
REASON = unavailable_reason(sshd=False)
needs_hosts = pytest.mark.skipif(REASON is not None, reason=f"no hosts here: {REASON}")


# --- what does not need root ---------------------------------------------------------

SKYPILOT_USER_DATA = """#cloud-config
users:
  - name: ubuntu
    shell: /bin/bash
    sudo: ALL=(ALL) NOPASSWD:ALL
    ssh_authorized_keys:
      - |-
        ssh-ed25519 AAAAC3Nza-the-key sky-key
write_files:
  - path: /etc/apt/apt.conf.d/20auto-upgrades
    content: |
      APT::Periodic::Update-Package-Lists "0";
"""


def test_the_key_is_read_from_skypilots_own_cloud_config() -> None:
    assert keys_from_user_data(SKYPILOT_USER_DATA) == ["ssh-ed25519 AAAAC3Nza-the-key sky-key"]
    assert keys_from_user_data(SKYPILOT_USER_DATA, user="root") == []


@pytest.mark.parametrize("text", ["", "#!/bin/sh\necho hi\n", "users: [{name: ubuntu}]\n"],
                         ids=["empty", "a-script", "not-marked-cloud-config"])  # fmt: skip
def test_user_data_that_is_no_cloud_config_carries_no_keys(text: str) -> None:
    assert keys_from_user_data(text) == []


@pytest.mark.parametrize(
    ("bridge", "cidr", "match"),
    [("mbr_0", "10.213.0.0/16", "bridge"), ("toolongname", "10.213.0.0/16", "bridge"),
     ("mbr0", "10.213.0.0/28", "cidr"), ("mbr0", "10.213.0.1/16", "host bits")],
    ids=["underscore", "too-long", "too-small", "host-bits"],
)  # fmt: skip
def test_a_pool_refuses_a_bridge_or_cidr_it_cannot_use(
    tmp_path: Path, bridge: str, cidr: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        HostPool(tmp_path, bridge=bridge, cidr=cidr)


def test_a_private_ip_outside_the_bridges_network_is_refused(tmp_path: Path) -> None:
    pool = HostPool(tmp_path, bridge="mbr0", cidr="10.213.0.0/16")
    with pytest.raises(ValueError, match=r"outside 10\.213\.0\.0/16"):
        pool.spec("i-0123456789abcdef0", "172.31.0.5")
    with pytest.raises(ValueError, match="gateway"):
        pool.spec("i-0123456789abcdef0", "10.213.0.1")


# --- hosts -----------------------------------------------------------------------------


def prerequisites_or_skip() -> None:
    """sshd, sudo and user ubuntu, installed when missing; a skip saying why if not."""
    if REASON is not None:
        pytest.skip(f"no hosts here: {REASON}")
    try:
        ensure_prerequisites()
    except HostError as e:  # no apt mirror here, say
        pytest.skip(f"no hosts here: {e}")


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[emulator.Emulator]:
    prerequisites_or_skip()
    try:
        e = emulator.start(tmp_path_factory.mktemp("awsemu-hosts"), bridge=BRIDGE)
    except HostError as err:
        if "overlaps" in str(err):
            pytest.skip(f"another emulator holds the address space: {err}")
        raise
    yield e
    e.stop()


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    d = tmp_path_factory.mktemp("key")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id")],
                   check=True)  # fmt: skip
    return d / "id", (d / "id.pub").read_text().strip()


def user_data(pub: str) -> str:
    return SKYPILOT_USER_DATA.replace("ssh-ed25519 AAAAC3Nza-the-key sky-key", pub)


def launch(emu: emulator.Emulator, pub: str, *, n: int = 1, spot: bool = False) -> list[str]:
    c = emu.boto3_client()
    sub = c.describe_subnets(
        Filters=[{"Name": "tag:Name", "Values": ["skypilot-moto*"]},
                 {"Name": "availability-zone", "Values": ["us-east-1a"]}]
    )["Subnets"][0]["SubnetId"]  # fmt: skip
    kw: dict[str, Any] = {
        "ImageId": AMI, "InstanceType": "m6i.large", "MinCount": n, "MaxCount": n,
        "UserData": user_data(pub),
        "NetworkInterfaces": [{"DeviceIndex": 0, "SubnetId": sub,
                               "AssociatePublicIpAddress": False}],
    }  # fmt: skip
    if spot:
        kw["InstanceMarketOptions"] = {"MarketType": "spot"}
    return [i["InstanceId"] for i in c.run_instances(**kw)["Instances"]]


def ssh(key: Path, ip: str, command: str, *, check: bool = True) -> str:
    p = subprocess.run(
        ["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
         "-o", "ConnectTimeout=10", f"ubuntu@{ip}", command],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if check and p.returncode != 0:
        raise AssertionError(f"ssh {ip} {command!r}: {p.returncode}\n{p.stderr}")
    return p.stdout.strip()


IMDS = (
    "T=$(curl -sf -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 60' "
    "http://169.254.169.254/latest/api/token) && "
    'curl -s -w " %{{http_code}}" -H "X-aws-ec2-metadata-token: $T" '
    "http://169.254.169.254/latest/meta-data/{leaf}"
)


@needs_hosts
@pytest.mark.e2e
def test_two_instances_are_two_hosts_reached_by_ssh_with_the_user_data_key(
    emu: emulator.Emulator, key: tuple[Path, str]
) -> None:
    a, b = launch(emu, key[1], n=2)
    ip_a, ip_b = emu.wait_host(a), emu.wait_host(b)
    assert ssh(key[0], ip_a, "hostname") == "ip-" + ip_a.replace(".", "-")
    assert ssh(key[0], ip_a, "whoami; echo $HOME; sudo -n whoami").split() == [
        "ubuntu", "/home/ubuntu", "root"]  # fmt: skip
    assert ssh(key[0], ip_a, IMDS.format(leaf="instance-id")) == f"{a} 200"
    assert ssh(key[0], ip_b, IMDS.format(leaf="instance-id")) == f"{b} 200"
    assert ssh(key[0], ip_a, IMDS.format(leaf="spot/instance-action")).endswith(" 404")
    # Own disk, own /tmp, own /etc: what one host writes, the other never sees.
    ssh(key[0], ip_a, "echo a > ~/disk; echo a > /tmp/t; sudo sh -c 'echo a > /etc/awsemu-t'")
    assert ssh(key[0], ip_b, "ls ~/disk /tmp/t /etc/awsemu-t 2>&1 | grep -c 'No such'") == "3"
    assert not Path("/etc/awsemu-t").exists()
    # Own processes: a host sees its own PID namespace only.
    assert ssh(key[0], ip_a, "ps -e -o comm= | grep -c '^sshd$'") in {"2", "3"}
    # The hosts reach each other on the bridge (no ping here: a TCP connect).
    assert ssh(key[0], ip_a, f"timeout 5 bash -c 'echo > /dev/tcp/{ip_b}/22' && echo ok") == "ok"
    emu.boto3_client().terminate_instances(InstanceIds=[a, b])


@needs_hosts
@pytest.mark.e2e
def test_terminating_an_instance_ends_its_host_and_every_process_in_it(
    emu: emulator.Emulator, key: tuple[Path, str]
) -> None:
    (iid,) = launch(emu, key[1])
    ip = emu.wait_host(iid)
    ssh(key[0], ip, "nohup sleep 4242 >/dev/null 2>&1 & disown")
    spec = emu.pool.running()[iid] if emu.pool else None
    assert spec is not None
    emu.boto3_client().terminate_instances(InstanceIds=[iid])
    emu.wait_gone(iid)
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert spec.netns not in ns
    assert "sleep 4242" not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                              text=True).stdout  # fmt: skip
    assert not Path(spec.dir).exists()  # a terminated instance's disk is gone


@needs_hosts
@pytest.mark.e2e
def test_the_gateway_keeps_its_mac_while_hosts_come_and_go(
    emu: emulator.Emulator, key: tuple[Path, str]
) -> None:
    # A bridge takes its lowest port's MAC unless told one: a terminated host's veth
    # going took the gateway's MAC with it, and its peers' heartbeats to the service
    # went nowhere for about 30 s (the elastic SkyPilot e2e's survivors, unheard).
    assert emu.pool is not None
    mac = Path(f"/sys/class/net/{BRIDGE}/address")
    want = bridge_mac(emu.pool.gateway)
    assert mac.read_text().strip() == want
    (iid,) = launch(emu, key[1])
    emu.wait_host(iid)
    assert mac.read_text().strip() == want
    emu.boto3_client().terminate_instances(InstanceIds=[iid])
    emu.wait_gone(iid)
    assert mac.read_text().strip() == want


@needs_hosts
@pytest.mark.e2e
def test_a_preempted_host_reads_its_notice_at_169_254_169_254_then_ends(
    emu: emulator.Emulator, key: tuple[Path, str]
) -> None:
    (iid,) = launch(emu, key[1], spot=True)
    ip = emu.wait_host(iid)
    admin(emu.endpoint, "POST", "preempt", {"instance_id": iid, "window_s": 3})
    body, status = ssh(key[0], ip, IMDS.format(leaf="spot/instance-action")).rsplit(" ", 1)
    assert status == "200" and json.loads(body)["action"] == "terminate"
    emu.wait_gone(iid, timeout_s=60)
    c = emu.boto3_client()
    res = c.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]
    assert res["State"]["Name"] == "terminated"


@needs_hosts
@pytest.mark.e2e
def test_a_stopped_instance_keeps_its_disk_for_its_next_start(
    emu: emulator.Emulator, key: tuple[Path, str]
) -> None:
    (iid,) = launch(emu, key[1])
    ip = emu.wait_host(iid)
    ssh(key[0], ip, "echo kept > ~/disk")
    c = emu.boto3_client()
    c.stop_instances(InstanceIds=[iid])
    emu.wait_gone(iid)
    c.start_instances(InstanceIds=[iid])
    assert ssh(key[0], emu.wait_host(iid), "cat ~/disk") == "kept"
    c.terminate_instances(InstanceIds=[iid])
    emu.wait_gone(iid)


def launch_via(endpoint: str, pub: str) -> list[str]:
    """One on-demand instance with ``pub`` in its UserData, through the AWS ``endpoint``."""
    import boto3

    from orchestrator.awsemu.ec2 import FAKE_KEYS

    session = boto3.session.Session(**FAKE_KEYS, region_name="us-east-1")
    c = session.client("ec2", endpoint_url=endpoint)
    sub = c.describe_subnets(Filters=[{"Name": "tag:Name", "Values": ["skypilot-moto*"]}])
    res = c.run_instances(
        ImageId=AMI, InstanceType="m6i.large", MinCount=1, MaxCount=1, UserData=user_data(pub),
        SubnetId=sub["Subnets"][0]["SubnetId"],
    )  # fmt: skip
    return [i["InstanceId"] for i in res["Instances"]]
