"""The fault front, through boto3, against moto's real server: what AWS refuses, it refuses.

No root needed: the emulator runs without hosts here (``with_hosts=False``), so a
preemption's notice is read on the metadata simulator's ``/nodes/<instance-id>`` URL,
the same document a host's 169.254.169.254 relays (tests/awsemu/test_hosts.py reads it
there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from orchestrator.awsemu import emulator
from orchestrator.awsemu.front import admin, parse_capacity_rule, region_of

AMI = "ami-785db401"


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[emulator.Emulator]:
    with emulator.running(tmp_path_factory.mktemp("awsemu"), with_hosts=False) as e:
        yield e


@pytest.fixture(autouse=True)
def _no_rules_left(emu: emulator.Emulator) -> Iterator[None]:
    yield
    admin(emu.endpoint, "DELETE", "capacity")


def ec2(emu: emulator.Emulator, region: str = "us-east-1") -> Any:
    # No retries: a test must see each answer the front gives, not botocore's last one.
    import boto3

    from orchestrator.awsemu.ec2 import FAKE_KEYS

    session = boto3.session.Session(**FAKE_KEYS, region_name=region)
    return session.client("ec2", endpoint_url=emu.endpoint,
                          config=Config(retries={"max_attempts": 0}))  # fmt: skip


def subnet(client: Any, zone: str) -> str:
    found = client.describe_subnets(
        Filters=[{"Name": "tag:Name", "Values": ["skypilot-moto*"]},
                 {"Name": "availability-zone", "Values": [zone]}]
    )["Subnets"]  # fmt: skip
    return str(found[0]["SubnetId"])


def launch(client: Any, zone: str, *, spot: bool = False, itype: str = "m6i.large") -> str:
    """One instance the way SkyPilot asks for it: a subnet by NetworkInterfaces."""
    kw: dict[str, Any] = {
        "ImageId": AMI, "InstanceType": itype, "MinCount": 1, "MaxCount": 1,
        "NetworkInterfaces": [{"DeviceIndex": 0, "SubnetId": subnet(client, zone),
                               "AssociatePublicIpAddress": False}],
    }  # fmt: skip
    if spot:
        kw["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {"SpotInstanceType": "one-time",
                            "InstanceInterruptionBehavior": "terminate"},
        }  # fmt: skip
    return str(client.run_instances(**kw)["Instances"][0]["InstanceId"])


def state(client: Any, iid: str) -> str:
    res = client.describe_instances(InstanceIds=[iid])["Reservations"]
    return str(res[0]["Instances"][0]["State"]["Name"])


def refused(fn: Any, **kw: Any) -> ClientError:
    with pytest.raises(ClientError) as info:
        fn(**kw)
    return info.value


def test_a_zone_without_capacity_refuses_run_instances_as_aws_does(
    emu: emulator.Emulator,
) -> None:
    c = ec2(emu)
    admin(emu.endpoint, "POST", "capacity", {"zone": "us-east-1a"})
    err = refused(launch, client=c, zone="us-east-1a")
    assert err.response["Error"]["Code"] == "InsufficientInstanceCapacity"
    assert err.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert "m6i.large capacity in the Availability Zone you requested (us-east-1a)" in str(err)
    assert err.operation_name == "RunInstances"
    assert launch(c, "us-east-1b").startswith("i-")  # the next zone still has capacity


def test_a_region_rule_reads_the_region_from_the_request_signature(
    emu: emulator.Emulator,
) -> None:
    admin(emu.endpoint, "POST", "capacity", {"region": "us-east-1"})
    err = refused(launch, client=ec2(emu, "us-east-1"), zone="us-east-1c")
    assert err.response["Error"]["Code"] == "InsufficientInstanceCapacity"
    assert launch(ec2(emu, "us-west-2"), "us-west-2a").startswith("i-")


def test_a_rule_for_two_calls_fails_two_and_then_lets_launches_through(
    emu: emulator.Emulator,
) -> None:
    c = ec2(emu)
    admin(emu.endpoint, "POST", "capacity", {"region": "us-east-1", "calls": 2})
    for _ in range(2):
        refused(launch, client=c, zone="us-east-1a")
    assert launch(c, "us-east-1a").startswith("i-")
    assert admin(emu.endpoint, "GET", "faults")["capacity"] == []


def test_a_rule_for_another_instance_type_lets_this_one_through(emu: emulator.Emulator) -> None:
    admin(
        emu.endpoint, "POST", "capacity", {"region": "us-east-1", "instance_type": "p4d.24xlarge"}
    )
    assert launch(ec2(emu), "us-east-1a").startswith("i-")


def test_skypilots_own_create_call_gives_up_at_once_on_the_capacity_error(
    emu: emulator.Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SkyPilot retries server errors it thinks transient (InternalError, ...), with
    # 5-60 s backoffs; capacity must not be one of them, or every blocked zone would
    # cost minutes. Its own call, through its own boto3 adaptor, against the front.
    from sky.adaptors import aws
    from sky.provision.aws import instance as sky_instance

    from orchestrator.awsemu.ec2 import FAKE_KEYS

    monkeypatch.setenv("AWS_ENDPOINT_URL", emu.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEYS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_KEYS["aws_secret_access_key"])
    admin(emu.endpoint, "POST", "capacity", {"zone": "us-east-1a"})
    before = admin(emu.endpoint, "GET", "faults")["counts"].get("RunInstances", 0)
    fail_fast = aws.resource("ec2", region_name="us-east-1", max_attempts=0)
    with pytest.raises(ClientError) as info:
        sky_instance._ec2_call_with_retry_on_server_error(
            fail_fast.create_instances, ImageId=AMI, InstanceType="m6i.large",
            MinCount=1, MaxCount=1, SubnetId=subnet(ec2(emu), "us-east-1a"),
        )  # fmt: skip
    assert info.value.response["Error"]["Code"] == "InsufficientInstanceCapacity"
    after = admin(emu.endpoint, "GET", "faults")["counts"]["RunInstances"]
    assert after - before == 1


def test_a_spot_instance_cannot_be_stopped_and_an_on_demand_one_can(
    emu: emulator.Emulator,
) -> None:
    c = ec2(emu)
    spot, on_demand = launch(c, "us-east-1a", spot=True), launch(c, "us-east-1a")
    err = refused(c.stop_instances, InstanceIds=[spot])
    assert err.response["Error"]["Code"] == "UnsupportedOperation"
    assert err.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert f"You can't stop the Spot Instance '{spot}'" in str(err)
    assert state(c, spot) == "running"
    # A request naming both is refused whole, as AWS refuses it.
    refused(c.stop_instances, InstanceIds=[on_demand, spot])
    c.stop_instances(InstanceIds=[on_demand])
    assert state(c, on_demand) in {"stopping", "stopped"}


def _imds(emu: emulator.Emulator, iid: str, path: str) -> tuple[int, str]:
    base = f"{emu.simulator.url}/nodes/{iid}"
    ttl = {"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    put = urllib.request.Request(f"{base}/latest/api/token", method="PUT", headers=ttl)
    with urllib.request.urlopen(put, timeout=5) as r:
        token = r.read().decode()
    get = urllib.request.Request(base + path, headers={"X-aws-ec2-metadata-token": token})
    try:
        with urllib.request.urlopen(get, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_a_preempted_spot_instance_gets_the_notice_then_is_terminated_at_the_window(
    emu: emulator.Emulator,
) -> None:
    c = ec2(emu)
    iid = launch(c, "us-east-1b", spot=True)
    assert _imds(emu, iid, "/latest/meta-data/spot/instance-action")[0] == 404
    admin(emu.endpoint, "POST", "preempt", {"instance_id": iid, "window_s": 2})
    status, body = _imds(emu, iid, "/latest/meta-data/spot/instance-action")
    assert status == 200 and json.loads(body)["action"] == "terminate"
    assert state(c, iid) == "running"  # the window is the instance's to use
    deadline = time.monotonic() + 30
    while state(c, iid) != "terminated" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state(c, iid) == "terminated"


def test_terminate_ends_an_instance_without_notice(emu: emulator.Emulator) -> None:
    c = ec2(emu, "us-west-2")
    iid = launch(c, "us-west-2b", spot=True)
    out = admin(emu.endpoint, "POST", "terminate", {"instance_id": iid})
    assert out == {"terminated": iid, "region": "us-west-2"}
    assert state(c, iid) == "terminated"
    assert _imds(emu, iid, "/latest/meta-data/spot/instance-action")[0] == 404


def test_terminating_an_unknown_instance_is_a_404_naming_it(emu: emulator.Emulator) -> None:
    with pytest.raises(RuntimeError, match="404 no instance i-0123456789abcdef0"):
        admin(emu.endpoint, "POST", "terminate", {"instance_id": "i-0123456789abcdef0"})


@pytest.mark.parametrize(
    ("doc", "named"),
    [
        ({"zone": "us-east-1a", "calls": 0}, "calls"),
        ({"region": "us-east-1", "seconds": -1}, "seconds"),
        ({"region": ""}, "region"),
        ({"regoin": "us-east-1"}, "regoin"),
        ([1, 2], "JSON object"),
    ],
    ids=["zero-calls", "negative-seconds", "empty-region", "typo", "not-an-object"],
)
def test_a_bad_capacity_rule_is_refused_naming_what_is_wrong(
    emu: emulator.Emulator, doc: Any, named: str
) -> None:
    with pytest.raises(RuntimeError, match=f"400 .*{named}"):
        admin(emu.endpoint, "POST", "capacity", doc)


def test_a_zone_rule_is_in_its_zones_region() -> None:
    rule = parse_capacity_rule({"zone": "eu-west-1b"}, now=0.0)
    assert (rule.region, rule.zone) == ("eu-west-1", "eu-west-1b")
    assert rule.matches("eu-west-1", "eu-west-1b", "m6i.large")
    assert not rule.matches("eu-west-1", "eu-west-1a", "m6i.large")


def test_a_rule_for_some_seconds_ends_by_the_clock() -> None:
    rule = parse_capacity_rule({"region": "us-east-1", "seconds": 30}, now=1000.0)
    assert rule.live(1029.9) and not rule.live(1030.0)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Authorization": "AWS4-HMAC-SHA256 Credential=AKIA/20261201/eu-west-1/ec2/aws4_request, "
                           "SignedHeaders=host, Signature=x"}, ("eu-west-1", "ec2")),
        ({"Authorization": "AWS4-HMAC-SHA256 Credential=AKIA/20261201/us-east-1/sts/aws4_request"},
         ("us-east-1", "sts")),
        ({"Host": "ec2.us-west-2.amazonaws.com"}, ("us-west-2", "ec2")),
        ({}, ("us-east-1", None)),
    ],
    ids=["sigv4-ec2", "sigv4-sts", "host", "neither"],
)  # fmt: skip
def test_the_region_comes_from_the_signature_then_the_host(
    headers: dict[str, str], expected: tuple[str, str | None]
) -> None:
    assert region_of(headers) == expected


def test_iam_and_sts_pass_through_the_front(emu: emulator.Emulator) -> None:
    sts = emu.boto3_client("sts")
    assert sts.get_caller_identity()["Account"]
    iam = emu.boto3_client("iam")
    iam.create_role(RoleName="awsemu-front-test", AssumeRolePolicyDocument="{}")
    assert iam.get_role(RoleName="awsemu-front-test")["Role"]["RoleName"] == "awsemu-front-test"


def test_the_cli_injects_a_fault_into_the_running_emulator(emu: emulator.Emulator) -> None:
    cmd = [sys.executable, "-m", "orchestrator.awsemu", "fault", "capacity",
           "--home", str(emu.home), "--zone", "us-east-1c", "--calls", "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout)["added"]["zone"] == "us-east-1c"
    err = refused(launch, client=ec2(emu), zone="us-east-1c")
    assert err.response["Error"]["Code"] == "InsufficientInstanceCapacity"


def test_the_state_file_names_the_endpoint_and_is_gone_after_stop(tmp_path: Path) -> None:
    with emulator.running(tmp_path, with_hosts=False) as e:
        st = emulator.read_state(tmp_path)
        assert st.endpoint == e.endpoint and st.bridge is None
    assert not (tmp_path / emulator.STATE_FILE).exists()
