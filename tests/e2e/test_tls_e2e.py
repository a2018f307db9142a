"""A job over HTTPS end to end: ``skyresume serve`` with a certificate from the
operator's private CA, nodes that are hosts of their own (network namespaces) reaching
it at the bridge's address, each node's setup installing the agent wheel over HTTPS
(pip verifies it with the CA the task carries) and each agent verifying the service
before it registers, heartbeats and reports. Real processes throughout."""

from __future__ import annotations

import ssl
import time

import httpx
import pytest

from orchestrator.demo import api_get, api_post, job_spec, node_gateway, wait_for
from orchestrator.launchers.netns import Fabric
from tests.api.test_tls import https_service, make_ca, make_server_cert

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.timeout(400),
    pytest.mark.skipif(Fabric.unavailable_reason() is not None, reason="needs network namespaces"),
]


def test_nodes_install_register_and_train_over_https_verified_by_the_operators_ca(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    gateway, _ = node_gateway(home)
    ca, ca_cert, ca_key = make_ca(tmp_path, "ops-ca")
    cert, key = make_server_cert(tmp_path, ca_cert, ca_key, ["127.0.0.1", gateway])
    env = {"SKYRESUME_CA_BUNDLE": str(ca), "SKYRESUME_LOCAL_NETWORK": "netns"}
    with https_service(home, cert, key, **env) as url:
        token = (home / "token").read_text().strip()
        http = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            verify=ssl.create_default_context(cafile=str(ca)),
            timeout=30,
        )
        spec = job_spec(home, 12)
        spec.update(num_nodes=2, ranks_per_node=1)
        job = api_post(http, "/v1/jobs", spec)["id"]
        end = time.monotonic() + 300
        st = wait_for(http, job, "the end", lambda st, n, v, step: st == "SUCCEEDED", end)
        assert st[0] == "SUCCEEDED", (home / "service.log").read_text()[-3000:]
        (attempt,) = api_get(http, f"/v1/jobs/{job}/attempts")["items"]
        assert len(attempt["nodes"]) == 2
        assert all(n["last_heartbeat_at"] for n in attempt["nodes"])
    # The nodes were told the https URL at the gateway, with the CA to trust it by.
    task = next((home / "local-nodes").rglob("*.launch.json")).read_text()
    assert f"https://{gateway}:" in task and "BEGIN CERTIFICATE" in task
