"""SkyPilot's client side of the emulated AWS (orchestrator/awsemu/skyconf.py).

The catalog and environment tests are pure file work. The seeding tests run against
a real moto server on loopback. The ``long`` ones start SkyPilot's own API server with
the emulator's environment and run the real ``sky`` CLI against moto, offline.
"""

from __future__ import annotations

import csv
import ipaddress
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.awsemu import skyconf


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def catalog(tmp_path: Path) -> Path:
    skyconf.build_catalog(tmp_path / "v8")
    return tmp_path / "v8"


def test_every_catalog_zone_id_is_one_moto_reports(catalog: Path) -> None:
    zones = skyconf.moto_zone_ids()
    rows = _rows(catalog / "aws" / "vms.csv")
    assert rows
    for row in rows:
        assert row["AvailabilityZone"] in zones[row["Region"]], row


def test_the_catalog_offers_the_small_cpu_types_in_every_emulated_region(catalog: Path) -> None:
    rows = _rows(catalog / "aws" / "vms.csv")
    for itype in ("m6i.large", "m6i.xlarge", "m6i.2xlarge"):
        assert {r["Region"] for r in rows if r["InstanceType"] == itype} == set(
            skyconf.EMULATED_REGIONS)
    quotas = {r["InstanceType"] for r in _rows(catalog / "aws" / "instance_quota_mapping.csv")}
    assert {r["InstanceType"] for r in rows} <= quotas


def test_every_skypilot_image_tag_maps_to_the_moto_ami_in_every_region(catalog: Path) -> None:
    images = _rows(catalog / "aws" / "images.csv")
    for region in skyconf.EMULATED_REGIONS:
        cpu = [r for r in images if r["Tag"] == "skypilot:custom-cpu-ubuntu"
               and r["Region"] == region]
        assert [r["ImageId"] for r in cpu] == [skyconf.MOTO_AMI_ID]
    assert {r["ImageId"] for r in images} == {skyconf.MOTO_AMI_ID}


def test_a_catalog_row_in_a_zone_moto_lacks_is_refused_by_name(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    extra.mkdir()
    src = (skyconf.EXTRA_CATALOG / "vms.csv").read_text().splitlines()
    (extra / "vms.csv").write_text("\n".join([src[0], src[1].replace("use1-az1", "use1-az9")]))
    with pytest.raises(skyconf.SkyConfError, match="use1-az9"):
        skyconf.build_catalog(tmp_path / "v8", extra=extra)


def test_subnets_are_disjoint_across_regions_and_leave_the_bridge_subnet_free() -> None:
    vpc = ipaddress.ip_network(skyconf.VPC_CIDR)
    nets = [ipaddress.ip_network(skyconf.subnet_cidr(r, z)) for r in range(3) for z in range(16)]
    assert all(n.subnet_of(vpc) for n in nets)
    assert len(set(nets)) == len(nets)
    assert ipaddress.ip_network("10.213.0.0/24") not in nets
    with pytest.raises(skyconf.SkyConfError, match="zone index 16"):
        skyconf.subnet_cidr(0, 16)


def test_sky_env_keeps_the_callers_own_aws_and_skypilot_settings_out(tmp_path: Path) -> None:
    skyconf.write_client_home(tmp_path, "http://127.0.0.1:1", api_port=47001)
    env = skyconf.sky_env(tmp_path, {
        "PATH": "/usr/bin", "AWS_PROFILE": "prod", "AWS_ACCESS_KEY_ID": "AKIAREAL",
        "SKYPILOT_API_SERVER_ENDPOINT": "https://sky.example.com", "SKY_RUNTIME_DIR": "/x",
        "LANG": "C.UTF-8",
    })
    assert "AWS_PROFILE" not in env and "AWS_ACCESS_KEY_ID" not in env
    assert "SKY_RUNTIME_DIR" not in env
    assert env["SKYPILOT_API_SERVER_ENDPOINT"] == "http://127.0.0.1:47001"
    assert env["SKYPILOT_API_SERVER_LOCAL_PORT"] == "47001"
    assert env["HOME"] == str(tmp_path / skyconf.SKY_HOME)
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:1"
    assert env["SKYPILOT_DISABLE_USAGE_COLLECTION"] == "1"
    assert env["LANG"] == "C.UTF-8"
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)


def test_the_api_port_survives_rewriting_the_client_home(tmp_path: Path) -> None:
    skyconf.write_client_home(tmp_path, "http://127.0.0.1:1")
    port = skyconf.read_state(tmp_path)["api_port"]
    skyconf.write_client_home(tmp_path, "http://127.0.0.1:2")
    assert skyconf.read_state(tmp_path) == {"endpoint": "http://127.0.0.1:2", "api_port": port}


def test_the_api_port_is_never_one_the_kernel_hands_to_outgoing_connections() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(skyconf.free_port() < low for _ in range(20))


def test_the_env_command_prints_exports_a_shell_can_eval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "a home with spaces"
    skyconf.write_client_home(home, "http://127.0.0.1:1", api_port=47002)
    assert skyconf.main(["--home", str(home), "env"]) == 0
    script = capsys.readouterr().out + 'printf "%s|%s" "$HOME" "$AWS_ENDPOINT_URL"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout == f"{home / skyconf.SKY_HOME}|http://127.0.0.1:1"


def test_sky_env_before_the_client_home_exists_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(skyconf.SkyConfError, match="write_client_home"):
        skyconf.sky_env(tmp_path)


# --- against a real moto server -------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = skyconf.free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
            # As the emulator runs it: SkyPilot attaches AWS-managed policies by ARN.
            env={**os.environ, "MOTO_IAM_LOAD_MANAGED_POLICIES": "true"},
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()}") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ec2(url: str, region: str):  # type: ignore[no-untyped-def]
    import boto3

    return boto3.client("ec2", region_name=region, endpoint_url=url,
                        aws_access_key_id=skyconf.FAKE_ACCESS_KEY_ID,
                        aws_secret_access_key=skyconf.FAKE_SECRET_ACCESS_KEY)


@pytest.mark.slow
def test_seeding_makes_a_private_subnet_per_zone_and_is_idempotent(moto_url: str) -> None:
    first = skyconf.seed_vpc(moto_url)
    assert skyconf.seed_vpc(moto_url) == first
    for region, vpc_id in first.items():
        ec2 = _ec2(moto_url, region)
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "tag:Name", "Values": [skyconf.VPC_NAME]}])
        assert [v["VpcId"] for v in vpcs["Vpcs"]] == [vpc_id]
        subnets = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["Subnets"]
        zones = {z["ZoneName"] for z in ec2.describe_availability_zones()["AvailabilityZones"]}
        assert {s["AvailabilityZone"] for s in subnets} == zones
        assert not any(s["MapPublicIpOnLaunch"] for s in subnets)


@pytest.mark.slow
def test_the_catalogs_ami_exists_in_every_emulated_region(moto_url: str) -> None:
    for region in skyconf.EMULATED_REGIONS:
        images = _ec2(moto_url, region).describe_images(ImageIds=[skyconf.MOTO_AMI_ID])
        assert [i["ImageId"] for i in images["Images"]] == [skyconf.MOTO_AMI_ID]


@pytest.mark.slow
def test_skypilots_iam_bootstrap_finds_the_seeded_profile_and_creates_nothing(
    moto_url: str,
) -> None:
    import boto3
    from sky.provision.aws import config as sky_aws_config

    arn = skyconf.seed_iam(moto_url)
    assert skyconf.seed_iam(moto_url) == arn
    iam = boto3.resource("iam", region_name="us-east-1", endpoint_url=moto_url,
                         aws_access_key_id=skyconf.FAKE_ACCESS_KEY_ID,
                         aws_secret_access_key=skyconf.FAKE_SECRET_ACCESS_KEY)
    # SkyPilot's own function: on a fresh moto it would put a Version-less inline
    # policy, which moto (unlike IAM) refuses, failing the first zone's launch.
    assert sky_aws_config._configure_iam_role(iam) == {"Arn": arn}
    profile = iam.InstanceProfile(skyconf.SKYPILOT_IAM_NAME)
    assert [r.name for r in profile.roles] == [skyconf.SKYPILOT_IAM_NAME]
    attached = {p.arn for p in iam.Role(skyconf.SKYPILOT_IAM_NAME).attached_policies.all()}
    assert attached == {"arn:aws:iam::aws:policy/AmazonEC2FullAccess",
                        "arn:aws:iam::aws:policy/AmazonS3FullAccess"}


# --- SkyPilot's own CLI and API server --------------------------------------------------


@pytest.fixture(scope="module")
def sky_home(moto_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("awsemu")
    skyconf.prepare(home, moto_url, runtime=False)
    skyconf.seed(moto_url)
    skyconf.start_api_server(home)
    try:
        yield home
    finally:
        skyconf.stop_api_server(home)


def test_the_queue_port_is_the_one_skypilots_server_derives_from_the_api_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sky.server.requests.queues import mp_queue

    for api_port in (46580, 30541, 20000, 32767, 46579, 56580):
        monkeypatch.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(api_port))
        assert skyconf.queue_manager_port(api_port) == mp_queue.get_queue_manager_port()
    assert skyconf.queue_manager_port(30541) == 53972  # the port CI saw taken


def test_a_chosen_api_port_comes_with_a_queue_port_that_binds() -> None:
    for _ in range(20):
        port = skyconf.free_port()
        with socket.socket() as s:
            s.bind(("127.0.0.1", skyconf.queue_manager_port(port)))


@pytest.mark.long  # 41 s each; in CI's emulator step, whose modules start API servers
@pytest.mark.parametrize("which", ["api", "queue"])
def test_an_api_port_taken_before_the_server_binds_it_is_swapped_for_a_free_one(
    tmp_path: Path, which: str
) -> None:
    # CI saw SkyPilot's server exit with "Port N is not available" (its API port) and
    # with "port N is already in use by another process" (the queue manager's port it
    # derives from the API port): the port chosen at prepare time had been taken by the
    # time `sky api start` bound it.
    skyconf.prepare(tmp_path, "http://127.0.0.1:1", runtime=False)
    taken = int(str(skyconf.read_state(tmp_path)["api_port"]))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken if which == "api" else skyconf.queue_manager_port(taken)))
        squatter.listen()
        url = skyconf.start_api_server(tmp_path)
        try:
            port = int(str(skyconf.read_state(tmp_path)["api_port"]))
            assert port != taken and url == f"http://127.0.0.1:{port}"
            assert skyconf.api_server_healthy(tmp_path)
        finally:
            skyconf.stop_api_server(tmp_path)
    assert not skyconf.api_server_healthy(tmp_path)


def _sky(home: Path, *args: str) -> str:
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "sky"), *args], env=skyconf.sky_env(home),
        cwd=home, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.long
def test_sky_check_reports_aws_enabled_against_moto(sky_home: Path) -> None:
    out = _sky(sky_home, "check", "aws")
    assert "AWS: enabled" in out
    assert f"127.0.0.1:{skyconf.read_state(sky_home)['api_port']}" in out


@pytest.mark.long
def test_the_optimizer_picks_m6i_large_spot_in_the_emulated_region(sky_home: Path) -> None:
    out = _sky(sky_home, "launch", "--dryrun", "-y", "-c", "awsemu-opt", "--infra",
               "aws/us-east-1", "--cpus", "2+", "--use-spot", "echo hi")
    chosen = [line for line in out.splitlines() if "✔" in line]
    assert len(chosen) == 1, out[-3000:]
    assert "m6i.large[Spot]" in chosen[0] and "us-east-1" in chosen[0]
    # use_ssm: false keeps SkyPilot on plain SSH to the private IPs (no AWS SSM).
    assert "SSM" not in out


def _api_server_pids(home: Path) -> set[int]:
    import psutil

    port = f"--port={skyconf.read_state(home)['api_port']}"
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if "sky.server.server" in " ".join(p.info["cmdline"] or []) and port in
            (p.info["cmdline"] or [])}


@pytest.mark.long
def test_starting_the_api_server_again_replaces_the_one_an_earlier_up_left(
    sky_home: Path,
) -> None:
    before = _api_server_pids(sky_home)
    assert before
    skyconf.start_api_server(sky_home)
    after = _api_server_pids(sky_home)
    assert after and not after & before
    assert skyconf.api_server_healthy(sky_home)
