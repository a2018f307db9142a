"""The emulator's own view of moto: boto3 straight to moto's server, never via the front.

The front and the hypervisor read moto through this, so a fault the front injects
(a capacity rule, a refused stop) never blinds the emulator itself. Credentials are
the offline fake ones; nothing here can reach a real AWS endpoint because every
client is made with ``endpoint_url`` set to moto's.

The VPC SkyPilot launches into is seeded by :func:`orchestrator.awsemu.skyconf.seed_vpc`
(disjoint /24 subnets per region and zone inside one /16, so an instance's private IP
is unique across regions, as the hosts' one bridge needs).
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass
from typing import Any

import yaml

from orchestrator.awsemu.skyconf import (
    EMULATED_REGIONS,
    FAKE_ACCESS_KEY_ID,
    FAKE_SECRET_ACCESS_KEY,
)

#: Regions watched unless the caller names others: those the SkyPilot side seeds.
DEFAULT_REGIONS = EMULATED_REGIONS
#: The ssh user SkyPilot's AWS template puts in UserData (``ssh_user``).
SSH_USER = "ubuntu"
FAKE_KEYS = {
    "aws_access_key_id": FAKE_ACCESS_KEY_ID,
    "aws_secret_access_key": FAKE_SECRET_ACCESS_KEY,
}


@dataclass(frozen=True)
class Instance:
    """The facts of one moto instance that make a host."""

    instance_id: str
    region: str
    zone: str
    state: str
    """pending, running, stopping, stopped, shutting-down, terminated."""
    private_ip: str | None
    spot: bool
    instance_type: str


class Ec2:
    """boto3 clients to moto, one per region, made once (boto3 sessions are slow)."""

    def __init__(self, endpoint: str, regions: tuple[str, ...] = DEFAULT_REGIONS) -> None:
        if not regions:
            raise ValueError("regions must name at least one region")
        self.endpoint = endpoint
        self.regions = tuple(regions)
        self._clients: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._zones: dict[tuple[str, str], str] = {}

    def client(self, region: str, service: str = "ec2") -> Any:
        with self._lock:
            c = self._clients.get((region, service))
            if c is None:
                import boto3  # heavy: only the emulator needs it
                from botocore.config import Config

                c = boto3.session.Session(**FAKE_KEYS, region_name=region).client(
                    service,
                    endpoint_url=self.endpoint,
                    config=Config(retries={"max_attempts": 2}, connect_timeout=5,
                                  read_timeout=30),
                )  # fmt: skip
                self._clients[(region, service)] = c
            return c

    # --- what the hypervisor reads --------------------------------------------------

    def instances(self, region: str) -> list[Instance]:
        """Every instance moto holds in ``region`` (terminated ones included)."""
        out = []
        pages = self.client(region).get_paginator("describe_instances").paginate()
        for page in pages:
            for res in page.get("Reservations", []):
                for i in res.get("Instances", []):
                    out.append(
                        Instance(
                            instance_id=i["InstanceId"],
                            region=region,
                            zone=i.get("Placement", {}).get("AvailabilityZone", ""),
                            state=i["State"]["Name"],
                            private_ip=i.get("PrivateIpAddress"),
                            spot=i.get("InstanceLifecycle") == "spot",
                            instance_type=i.get("InstanceType", ""),
                        )
                    )
        return out

    def authorized_keys(self, region: str, instance_id: str, user: str = SSH_USER) -> list[str]:
        """The ssh keys cloud-init would install for ``user``, from the UserData."""
        attr = self.client(region).describe_instance_attribute(
            InstanceId=instance_id, Attribute="userData"
        )
        raw = (attr.get("UserData") or {}).get("Value")
        return keys_from_user_data(base64.b64decode(raw).decode() if raw else "", user)

    # --- what the front asks (the Moto protocol) ------------------------------------

    def subnet_zone(self, region: str, subnet_id: str) -> str | None:
        key = (region, subnet_id)
        if key not in self._zones:
            found = self.client(region).describe_subnets(SubnetIds=[subnet_id])["Subnets"]
            if not found:
                return None
            self._zones[key] = found[0]["AvailabilityZone"]
        return self._zones[key]

    def spot_instances(self, region: str, instance_ids: list[str]) -> list[str]:
        if not instance_ids:
            return []
        from botocore.exceptions import ClientError

        try:
            res = self.client(region).describe_instances(InstanceIds=instance_ids)
        except ClientError:
            return []  # an unknown id: moto's own error is the right answer, let it pass
        return [
            i["InstanceId"]
            for r in res["Reservations"]
            for i in r["Instances"]
            if i.get("InstanceLifecycle") == "spot"
        ]

    def region_of(self, instance_id: str) -> str | None:
        from botocore.exceptions import ClientError

        for region in self.regions:
            try:
                res = self.client(region).describe_instances(InstanceIds=[instance_id])
            except ClientError:
                continue
            if res["Reservations"]:
                return region
        return None

    def terminate(self, instance_id: str) -> str | None:
        region = self.region_of(instance_id)
        if region is not None:
            self.client(region).terminate_instances(InstanceIds=[instance_id])
        return region


def keys_from_user_data(text: str, user: str = SSH_USER) -> list[str]:
    """``users: [{name: USER, ssh_authorized_keys: [...]}]`` of a cloud-config, or [].

    Only ``#cloud-config`` documents carry keys; anything else (a shell script, empty)
    has none, and the host then refuses every key, as a real VM would.
    """
    if not text.lstrip().startswith("#cloud-config"):
        return []
    doc = yaml.safe_load(text) or {}
    keys: list[str] = []
    for u in doc.get("users") or []:
        if isinstance(u, dict) and u.get("name") == user:
            keys += [str(k).strip() for k in u.get("ssh_authorized_keys") or [] if str(k).strip()]
    return keys
