"""SkyPilot's client side of the emulated AWS: its home, catalog, credentials and API server.

Everything lives under the emulator's home, never in the user's ``~/.sky`` or ``~/.aws``:
SkyPilot's client and its API server run with ``HOME=<emu-home>/sky-home`` (see
:func:`sky_env`), so ``~/.sky`` (catalog, ``config.yaml``, SSH key, request and cluster
databases) and ``~/.aws`` (fake credentials) are the emulator's own::

    <emu-home>/sky-home/
      .sky/config.yaml                     aws: {vpc_name: skypilot-moto, use_internal_ips: true,
                                           use_ssm: false}, allowed_clouds: [aws]
      .sky/catalogs/v8/aws/vms.csv         tests' v8 fixture + tests/awsemu/catalog, zone ids
                                           checked against moto's own zone mapping
      .sky/catalogs/v8/aws/images.csv      every skypilot:* image tag -> a moto AMI
      .sky/catalogs/v8/aws/instance_quota_mapping.csv, common/{accelerators,metadata}.csv
      .aws/credentials, .aws/config        fake keys, region us-east-1
    <emu-home>/skyconf.json                the AWS endpoint and the API server's port

Why a HOME and not ``SKY_RUNTIME_DIR``: SkyPilot reads ``~/.sky/config.yaml``, its SSH
key and AWS's credential chain from ``HOME`` whatever the runtime dir says, and the
aws CLI that ``sky check`` runs reads ``~/.aws``; one HOME keeps them all in one place.

The API server gets a port of its own (``SKYPILOT_API_SERVER_LOCAL_PORT``, which client
and server both honour): other SkyPilot servers on this machine, on 46580 or elsewhere,
are never reused, and ``sky api stop`` only kills the server on this port.

AWS is moto behind part A's fault front: ``AWS_ENDPOINT_URL`` (honoured by boto3 and the
aws CLI) points there. The VPC ``skypilot-moto`` (10.213.0.0/16) is seeded in every
emulated region with one private subnet per zone (``MapPublicIpOnLaunch=False``), the
subnets disjoint across regions, so every instance's private IP is unique on the
hypervisor's one bridge; 10.213.0.0/24 stays free for the host side of that bridge.
SkyPilot's IAM instance profile is seeded too (:func:`seed_iam` says why); :func:`seed`
does both.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

#: The regions the emulator serves (those of the tests' v8 catalog).
EMULATED_REGIONS = ("us-east-1", "us-west-2", "eu-west-1")
VPC_NAME = "skypilot-moto"
VPC_CIDR = "10.213.0.0/16"
#: A moto built-in AMI (Ubuntu 16.04, x86_64, EBS) that moto serves in every region.
#: What it says it holds does not matter: the node's real userland is this host's.
MOTO_AMI_ID = "ami-785db401"
#: Fake, and shaped like real keys, so the aws CLI and botocore accept them.
FAKE_ACCESS_KEY_ID = "AKIAAWSEMU0000000000"
FAKE_SECRET_ACCESS_KEY = "awsemu/fake/secret/key/never/valid/anywhere00"
DEFAULT_REGION = "us-east-1"

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The tests' own catalog, which the emulator's is built from.
BASE_CATALOG = REPO_ROOT / "tests" / "planner" / "catalog" / "v8"
#: Rows the emulator adds to it: the small CPU instance types the smoke tests launch.
EXTRA_CATALOG = REPO_ROOT / "tests" / "awsemu" / "catalog"

SKY_HOME = "sky-home"
PORT_TRIES = 3  # API server starts tried when its port was taken meanwhile
#: What SkyPilot's server log says when its port (or its queue manager's) was taken.
PORT_TAKEN = ("is not available", "is already in use")
STATE_FILE = "skyconf.json"
CATALOG_VERSION = "v8"  # sky.skylet.constants.CATALOG_SCHEMA_VERSION for 0.14.1


class SkyConfError(RuntimeError):
    """The SkyPilot side of the emulator could not be set up; the message says where."""


@dataclass(frozen=True)
class SkyLayout:
    """Where the emulator keeps SkyPilot's client files (see the module docstring)."""

    emu_home: Path

    @property
    def sky_home(self) -> Path:
        return self.emu_home / SKY_HOME

    @property
    def server_log(self) -> Path:
        """Where ``sky api start`` has its server write (``~/.sky/api_server/server.log``)."""
        return self.sky_home / ".sky" / "api_server" / "server.log"

    @property
    def catalog_dir(self) -> Path:
        return self.sky_home / ".sky" / "catalogs" / CATALOG_VERSION

    @property
    def config_path(self) -> Path:
        return self.sky_home / ".sky" / "config.yaml"

    @property
    def state_path(self) -> Path:
        return self.emu_home / STATE_FILE


# --- catalog -------------------------------------------------------------------------


def moto_zone_ids(regions: Iterable[str] = EMULATED_REGIONS) -> dict[str, dict[str, str]]:
    """``{region: {zone id: zone name}}`` as moto's server will report them.

    Read from moto itself (the table its ``DescribeAvailabilityZones`` answers from), so
    the catalog can never name a zone id moto does not have.
    """
    from moto.ec2.models.availability_zones_and_regions import RegionsAndZonesBackend

    zones = RegionsAndZonesBackend.zones
    out: dict[str, dict[str, str]] = {}
    for region in regions:
        if region not in zones:
            raise SkyConfError(f"moto has no region {region!r}")
        out[region] = {z.zone_id: z.name for z in zones[region]}
    return out


def _read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _write_rows(path: Path, fields: list[str], rows: Iterable[Mapping[str, str]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())


def build_catalog(dest: Path, regions: Iterable[str] = EMULATED_REGIONS,
                  ami_id: str = MOTO_AMI_ID, base: Path = BASE_CATALOG,
                  extra: Path = EXTRA_CATALOG) -> None:
    """Write SkyPilot's v8 catalog for the emulator into ``dest`` (``.../catalogs/v8``).

    Hand-placed files without a ``.meta`` md5 are used as they are and never
    re-downloaded (DESIGN.md), so nothing here ever reaches SkyPilot's catalog host.
    """
    regions = tuple(regions)
    zone_ids = moto_zone_ids(regions)
    for needed in (base / "aws" / "vms.csv", extra / "vms.csv"):
        if not needed.exists():
            raise SkyConfError(f"the emulator's catalog is built from {needed}, which is missing")
    fields, rows = _read_rows(base / "aws" / "vms.csv")
    extra_fields, extra_rows = _read_rows(extra / "vms.csv")
    if extra_fields != fields:
        raise SkyConfError(f"{extra / 'vms.csv'} columns {extra_fields} are not {fields}")
    vms = []
    for row in [*rows, *extra_rows]:
        if row["Region"] not in zone_ids:
            continue
        if row["AvailabilityZone"] not in zone_ids[row["Region"]]:
            raise SkyConfError(
                f"catalog row {row['InstanceType']} names zone id {row['AvailabilityZone']}, "
                f"which moto's {row['Region']} lacks (it has {sorted(zone_ids[row['Region']])})"
            )
        vms.append(row)
    _write_rows(dest / "aws" / "vms.csv", fields, vms)

    img_fields, images = _read_rows(base / "aws" / "images.csv")
    tags = sorted({r["Tag"] for r in images})
    _write_rows(
        dest / "aws" / "images.csv", img_fields,
        [{**next(r for r in images if r["Tag"] == tag), "Region": region, "ImageId": ami_id}
         for tag in tags for region in regions],
    )
    q_fields, quotas = _read_rows(base / "aws" / "instance_quota_mapping.csv")
    known = {r["InstanceType"] for r in quotas}
    # Every CPU type shares the standard on-demand/spot quota codes of m6i.
    m6i = next(r for r in quotas if r["InstanceType"].startswith("m6i."))
    quotas += [{**m6i, "InstanceType": t} for t in sorted({r["InstanceType"] for r in vms})
               if t not in known]
    _write_rows(dest / "aws" / "instance_quota_mapping.csv", q_fields, quotas)
    for name in ("accelerators.csv", "metadata.csv"):
        (dest / "common").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(base / "common" / name, dest / "common" / name)


# --- client home ---------------------------------------------------------------------


def sky_config() -> dict[str, object]:
    return {
        "allowed_clouds": ["aws"],
        # use_internal_ips: moto's public IPs are never routed; every node is reached
        # on the hypervisor's bridge at its private IP.
        "aws": {"vpc_name": VPC_NAME, "use_internal_ips": True, "use_ssm": False},
    }


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def queue_manager_port(api_port: int) -> int:
    """The port SkyPilot's API server on ``api_port`` gives its request-queue manager.

    SkyPilot 0.14.1 derives it from the API port, within [50000, 60000)
    (``sky/server/requests/queues/mp_queue.py``, ``get_queue_manager_port``), and the
    server exits with "port N is already in use by another process" when it does not
    bind. That range lies inside the kernel's ephemeral range, so a port some other
    server took with ``bind(0)``, or an outgoing connection's local port, can be it (seen
    in CI). The constants are SkyPilot's own; a test checks this against its function.
    """
    from sky.server import common
    from sky.server.requests.queues import mp_queue

    offset = api_port - common.DEFAULT_SERVER_PORT
    if offset == 0:
        return int(mp_queue.DEFAULT_QUEUE_MANAGER_PORT)
    return 50000 + (int(mp_queue.DEFAULT_QUEUE_MANAGER_PORT) - 50000 + offset) % 10000


def _binds(port: int, reuse_addr: bool = False) -> bool:
    with socket.socket() as s:
        if reuse_addr:  # as SkyPilot checks its queue port: a TIME_WAIT socket does not count
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A loopback port for the API server that binds now, as does its queue manager's.

    It is chosen below the kernel's ephemeral range: the API server binds it only later
    (``sky api start``), and in between the emulator's own clients open connections, and
    a port from that range can be taken by one of them as its local port; SkyPilot's
    server then exits with "Port N is not available" (seen in CI). Ports below that
    range are never handed out to outgoing connections. The queue manager's port
    (:func:`queue_manager_port`) cannot be kept out of that range, so it is only checked
    free now; :func:`start_api_server` takes a fresh pair when it was taken meanwhile.
    """
    import random

    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(20000, low) if low > 20001 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            chosen: int = s.getsockname()[1]
        if _binds(queue_manager_port(chosen), reuse_addr=True):
            return chosen
    raise SkyConfError("no free loopback port below the ephemeral range")


def write_client_home(emu_home: Path, endpoint: str, api_port: int | None = None) -> SkyLayout:
    """SkyPilot's config, catalog and fake AWS credentials under ``emu_home``."""
    layout = SkyLayout(emu_home)
    build_catalog(layout.catalog_dir)
    layout.config_path.parent.mkdir(parents=True, exist_ok=True)
    layout.config_path.write_text(yaml.safe_dump(sky_config(), sort_keys=False))
    aws = layout.sky_home / ".aws"
    aws.mkdir(parents=True, exist_ok=True)
    (aws / "credentials").write_text(
        "[default]\n"
        f"aws_access_key_id = {FAKE_ACCESS_KEY_ID}\n"
        f"aws_secret_access_key = {FAKE_SECRET_ACCESS_KEY}\n"
    )
    (aws / "config").write_text(f"[default]\nregion = {DEFAULT_REGION}\n")
    state = read_state(emu_home) if layout.state_path.exists() else {}
    # The port is kept across rewrites: a running API server and its clients agree on it.
    port = api_port or int(str(state.get("api_port") or 0)) or free_port()
    layout.state_path.write_text(
        json.dumps({"endpoint": endpoint, "api_port": port}, indent=2) + "\n"
    )
    return layout


def read_state(emu_home: Path) -> dict[str, object]:
    path = SkyLayout(emu_home).state_path
    if not path.exists():
        raise SkyConfError(f"{path} is missing: write_client_home (or prepare) first")
    data: dict[str, object] = json.loads(path.read_text())
    return data


def api_server_url(emu_home: Path) -> str:
    return f"http://127.0.0.1:{read_state(emu_home)['api_port']}"


def sky_env(emu_home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment SkyPilot's client, its API server and the service run with.

    The caller's own AWS and SkyPilot settings are dropped: a real ``AWS_PROFILE`` or
    ``SKYPILOT_API_SERVER_ENDPOINT`` must never steer an emulated launch elsewhere.
    """
    base = dict(os.environ if base is None else base)
    state = read_state(emu_home)
    layout = SkyLayout(emu_home)
    env = {k: v for k, v in base.items()
           if not k.startswith(("AWS_", "SKYPILOT_")) and k != "SKY_RUNTIME_DIR"}
    port = str(state["api_port"])
    bindir = str(Path(sys.executable).parent)  # sky, aws and moto live beside this Python
    path = env.get("PATH", "/usr/bin:/bin")
    env.update({
        "HOME": str(layout.sky_home),
        "PATH": path if path.split(":")[0] == bindir else f"{bindir}:{path}",
        "AWS_ENDPOINT_URL": str(state["endpoint"]),
        "AWS_DEFAULT_REGION": DEFAULT_REGION,
        "AWS_SHARED_CREDENTIALS_FILE": str(layout.sky_home / ".aws" / "credentials"),
        "AWS_CONFIG_FILE": str(layout.sky_home / ".aws" / "config"),
        # The aws CLI and boto3 must not wait on an instance-metadata probe here.
        "AWS_EC2_METADATA_DISABLED": "true",
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
        "SKYPILOT_API_SERVER_LOCAL_PORT": port,
        "SKYPILOT_API_SERVER_ENDPOINT": f"http://127.0.0.1:{port}",
    })
    return env


# --- moto seeding --------------------------------------------------------------------


def subnet_cidr(region_index: int, zone_index: int) -> str:
    """Disjoint /24s inside 10.213.0.0/16: 16 zones per region, 10.213.0.0/24 kept free."""
    if not 0 <= zone_index < 16:
        raise SkyConfError(f"zone index {zone_index} is outside 0..15")
    return f"10.213.{1 + region_index * 16 + zone_index}.0/24"


def seed_vpc(endpoint: str, regions: Iterable[str] = EMULATED_REGIONS) -> dict[str, str]:
    """Create VPC ``skypilot-moto`` with a private subnet per zone in every region.

    Idempotent: a region that already has the VPC is left as it is. Returns
    ``{region: vpc id}``.
    """
    import boto3

    vpcs: dict[str, str] = {}
    for r_index, region in enumerate(regions):
        ec2 = boto3.client(
            "ec2", region_name=region, endpoint_url=endpoint,
            aws_access_key_id=FAKE_ACCESS_KEY_ID,
            aws_secret_access_key=FAKE_SECRET_ACCESS_KEY,
        )
        found = ec2.describe_vpcs(Filters=[{"Name": "tag:Name", "Values": [VPC_NAME]}])["Vpcs"]
        if found:
            vpcs[region] = found[0]["VpcId"]
            continue
        vpc_id = ec2.create_vpc(CidrBlock=VPC_CIDR)["Vpc"]["VpcId"]
        ec2.create_tags(Resources=[vpc_id], Tags=[{"Key": "Name", "Value": VPC_NAME}])
        zones = ec2.describe_availability_zones()["AvailabilityZones"]
        for z_index, zone in enumerate(sorted(zones, key=lambda z: z["ZoneName"])):
            subnet = ec2.create_subnet(
                VpcId=vpc_id, CidrBlock=subnet_cidr(r_index, z_index),
                AvailabilityZone=zone["ZoneName"],
            )["Subnet"]["SubnetId"]
            # Private: SkyPilot (use_internal_ips) picks subnets that map no public IP.
            ec2.modify_subnet_attribute(SubnetId=subnet, MapPublicIpOnLaunch={"Value": False})
            ec2.create_tags(Resources=[subnet],
                            Tags=[{"Key": "Name", "Value": f"{VPC_NAME}-{zone['ZoneName']}"}])
        vpcs[region] = vpc_id
    return vpcs


#: SkyPilot's default instance profile and role (``sky/provision/aws/config.py``:
#: DEFAULT_SKYPILOT_INSTANCE_PROFILE, DEFAULT_SKYPILOT_IAM_ROLE).
SKYPILOT_IAM_NAME = "skypilot-v1"
_IAM_POLICY_VERSION = "2012-10-17"


def seed_iam(endpoint: str) -> str:
    """SkyPilot's instance profile and role, as its first launch in an account leaves them.

    Why seeded, not left to SkyPilot's bootstrap: that bootstrap puts an inline policy
    without a ``Version`` (real IAM defaults it; moto refuses it with
    MalformedPolicyDocument), so the first zone's launch fails and SkyPilot fails over
    to the next one; and it sleeps 15 s twice for IAM propagation. With the profile
    holding its role, SkyPilot's ``_configure_iam_role`` only reads it, as it does in
    any account it has launched in before. Idempotent; returns the profile's ARN.
    """
    import boto3

    iam = boto3.client("iam", region_name=DEFAULT_REGION, endpoint_url=endpoint,
                       aws_access_key_id=FAKE_ACCESS_KEY_ID,
                       aws_secret_access_key=FAKE_SECRET_ACCESS_KEY)
    errors = iam.exceptions
    try:
        profile = iam.get_instance_profile(InstanceProfileName=SKYPILOT_IAM_NAME)
    except errors.NoSuchEntityException:
        profile = iam.create_instance_profile(InstanceProfileName=SKYPILOT_IAM_NAME)
    if profile["InstanceProfile"]["Roles"]:
        return str(profile["InstanceProfile"]["Arn"])
    try:
        role = iam.get_role(RoleName=SKYPILOT_IAM_NAME)["Role"]
    except errors.NoSuchEntityException:
        role = iam.create_role(RoleName=SKYPILOT_IAM_NAME, AssumeRolePolicyDocument=json.dumps({
            "Version": _IAM_POLICY_VERSION,
            "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                           "Action": "sts:AssumeRole"}],
        }))["Role"]
    for arn in ("arn:aws:iam::aws:policy/AmazonEC2FullAccess",
                "arn:aws:iam::aws:policy/AmazonS3FullAccess"):
        try:
            iam.attach_role_policy(RoleName=SKYPILOT_IAM_NAME, PolicyArn=arn)
        except errors.NoSuchEntityException as exc:
            raise SkyConfError(
                f"moto does not know {arn}: start moto_server with "
                "MOTO_IAM_LOAD_MANAGED_POLICIES=true"
            ) from exc
    iam.put_role_policy(
        RoleName=SKYPILOT_IAM_NAME, PolicyName="SkyPilotPassRolePolicy",
        PolicyDocument=json.dumps({
            "Version": _IAM_POLICY_VERSION,
            "Statement": [
                {"Effect": "Allow", "Action": ["iam:GetRole", "iam:PassRole"],
                 "Resource": role["Arn"]},
                {"Effect": "Allow", "Action": "iam:GetInstanceProfile",
                 "Resource": profile["InstanceProfile"]["Arn"]},
            ],
        }),
    )
    iam.add_role_to_instance_profile(InstanceProfileName=SKYPILOT_IAM_NAME,
                                     RoleName=SKYPILOT_IAM_NAME)
    return str(profile["InstanceProfile"]["Arn"])


def seed(endpoint: str, regions: Iterable[str] = EMULATED_REGIONS) -> dict[str, str]:
    """Everything moto needs before SkyPilot's first launch: IAM, then the VPCs.

    Returns ``{region: vpc id}`` like :func:`seed_vpc`.
    """
    seed_iam(endpoint)
    return seed_vpc(endpoint, regions)


# --- API server ----------------------------------------------------------------------


def _sky(emu_home: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "sky"), *args],
        env=sky_env(emu_home), capture_output=True, text=True, timeout=timeout,
        cwd=str(SkyLayout(emu_home).sky_home),
    )


def api_server_healthy(emu_home: Path) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api_server_url(emu_home)}/api/health", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def start_api_server(emu_home: Path, timeout: float = 180) -> str:
    """``sky api start`` on loopback, with the emulator's environment. Returns its URL.

    SkyPilot daemonizes the server and returns once it answers; it then outlives this
    process, so :func:`stop_api_server` must be called (``down`` does).

    A server already answering on this home's port is an earlier ``up``'s: it runs with
    that run's environment (an endpoint that is gone), so it is stopped first, never
    reused.
    """
    if api_server_healthy(emu_home):
        stop_api_server(emu_home)
    for _ in range(PORT_TRIES):
        port = int(str(read_state(emu_home)["api_port"]))
        if not (_binds(port) and _binds(queue_manager_port(port), reuse_addr=True)):
            _new_api_port(emu_home)  # chosen at prepare time, and taken since
        proc = _sky(emu_home, "api", "start", "--host", "127.0.0.1", timeout=timeout)
        if proc.returncode == 0 and api_server_healthy(emu_home):
            return api_server_url(emu_home)
        log = server_log_tail(emu_home)
        if not any(taken in log for taken in PORT_TAKEN):
            break
        # Another process bound a port after it was chosen: a fresh pair, then again.
        _new_api_port(emu_home)
    raise SkyConfError(
        f"sky api start failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}"
        f"\n--- {SkyLayout(emu_home).server_log} (last lines) ---\n{log}"
    )


def _new_api_port(emu_home: Path) -> None:
    write_client_home(emu_home, str(read_state(emu_home)["endpoint"]), api_port=free_port())


def server_log_tail(emu_home: Path, limit: int = 3000) -> str:
    """The end of SkyPilot's own API server log, or a line saying there is none."""
    path = SkyLayout(emu_home).server_log
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError as e:
        return f"(no server log: {e})"


def stop_api_server(emu_home: Path, timeout: float = 60) -> None:
    """``sky api stop`` for this emulator's port only (SkyPilot matches the port)."""
    if not SkyLayout(emu_home).state_path.exists():
        return
    proc = _sky(emu_home, "api", "stop", timeout=timeout)
    if proc.returncode != 0:
        raise SkyConfError(f"sky api stop failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    deadline = time.monotonic() + timeout
    while api_server_healthy(emu_home):
        if time.monotonic() > deadline:
            raise SkyConfError(f"the API server at {api_server_url(emu_home)} is still up")
        time.sleep(0.5)


# --- everything ----------------------------------------------------------------------


def prepare(emu_home: Path, endpoint: str, *, runtime: bool = True,
            cache_root: Path | None = None) -> SkyLayout:
    """The offline SkyPilot side, short of starting anything: the node template (when
    ``runtime``), the client home and the state file. Seeding needs moto up (:func:`seed_vpc`)."""
    if runtime:
        from orchestrator.awsemu.runtime import prepare_node_template

        prepare_node_template(emu_home, cache_root)
    return write_client_home(emu_home, endpoint)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m orchestrator.awsemu.skyconf")
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--endpoint", default=None,
                        help="the AWS endpoint (front or moto); prepare and seed need it")
    parser.add_argument("command", choices=["prepare", "seed", "api-start", "api-stop", "env"])
    args = parser.parse_args(argv)
    if args.command in ("prepare", "seed") and not args.endpoint:
        parser.error(f"{args.command} needs --endpoint (the AWS endpoint: the front or moto)")
    try:
        if args.command == "prepare":
            prepare(args.home, args.endpoint, runtime=False)
        elif args.command == "seed":
            print(json.dumps(seed(args.endpoint)))
        elif args.command == "api-start":
            print(start_api_server(args.home))
        elif args.command == "api-stop":
            stop_api_server(args.home)
        else:
            env = sky_env(args.home)
            for key in sorted(k for k in env if k.startswith(("AWS_", "SKYPILOT_")) or k == "HOME"):
                print(f"export {key}={shlex.quote(env[key])}")
    except SkyConfError as exc:
        print(f"awsemu: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
