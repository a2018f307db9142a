"""HTTPS: ``serve`` answers with the operator's certificate and key, and every client
(the CLI, each node's agent, the node's setup fetching the agent wheel) verifies it
against the operator's CA bundle. Real processes: ``skyresume serve`` over TLS, the
agent's own HTTP client, the CLI as a user runs it."""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from orchestrator.agent.client import ServiceClient, Unreachable
from orchestrator.launchers.local import free_port

pytestmark = pytest.mark.timeout(300)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(obj: Any) -> bytes:
    return bytes(obj.public_bytes(serialization.Encoding.PEM))


def make_ca(tmp: Path, name: str) -> tuple[Path, Any, Any]:
    """A private CA: (its PEM file, its certificate, its key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = tmp / f"{name}.pem"
    path.write_bytes(_pem(cert))
    return path, cert, key


def make_server_cert(tmp: Path, ca_cert: Any, ca_key: Any, ips: list[str]) -> tuple[Path, Path]:
    """A server certificate for these IP addresses, signed by the CA: (cert, key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("skyresume"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(i)) for i in ips]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "server.pem", tmp / "server.key"
    cert_path.write_bytes(_pem(cert))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
    env.update(SKYRESUME_HOME=str(home), **extra)
    return env


@contextlib.contextmanager
def https_service(home: Path, cert: Path, key: Path, **extra: str) -> Iterator[str]:
    port = free_port()
    env = _env(
        home,
        SKYRESUME_PORT=str(port),
        SKYRESUME_TLS_CERT=str(cert),
        SKYRESUME_TLS_KEY=str(key),
        **extra,
    )
    log = open(home / "service.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"https://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (home / "service.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", verify=False, timeout=2).status_code == 200:
                    break
            assert time.monotonic() < end, "the service did not answer over HTTPS"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pki")
    ca, ca_cert, ca_key = make_ca(tmp, "skyresume-test-ca")
    other, _, _ = make_ca(tmp, "someone-else")
    cert, key = make_server_cert(tmp, ca_cert, ca_key, ["127.0.0.1"])
    return {"ca": ca, "other": other, "cert": cert, "key": key}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path]) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("home")
    with https_service(home, pki["cert"], pki["key"], SKYRESUME_RECONCILE="false") as url:
        yield url, home


def test_the_agent_verifies_the_service_against_the_operators_ca(served, pki):
    url, _ = served
    client = ServiceClient(
        url, "t", job_id="nope", attempt=0, node_id="n0", ca_pem=pki["ca"].read_text()
    )
    # The TLS handshake and the certificate check passed: the service itself answered
    # (401: this token opens nothing).
    assert client.heartbeat({"state": "running"}).status in (401, 403, 404)


@pytest.mark.parametrize("trust", ["system store", "another CA"])
def test_the_agent_refuses_a_service_whose_certificate_it_cannot_verify(served, pki, trust):
    url, _ = served
    pem = pki["other"].read_text() if trust == "another CA" else None
    client = ServiceClient(url, "t", job_id="j", attempt=0, node_id="n0", ca_pem=pem)
    with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
        client.heartbeat({"state": "running"})


def test_the_cli_talks_https_with_the_ca_bundle_and_says_why_without_it(served, pki):
    url, home = served
    cli = [sys.executable, "-m", "orchestrator.cli", "jobs", "-o", "json"]
    ok = subprocess.run(
        cli,
        env=_env(home, SKYRESUME_SERVICE_URL=url, SKYRESUME_CA_BUNDLE=str(pki["ca"])),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        cli,
        env=_env(home, SKYRESUME_SERVICE_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1
    assert "certificate this machine does not trust" in bad.stderr
    assert "SKYRESUME_CA_BUNDLE" in bad.stderr


def test_the_service_banner_names_https(served):
    _, home = served
    assert "serving on https://" in (home / "service.log").read_text()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"SKYRESUME_TLS_CERT": "/nonexistent/cert.pem"}, "tls_key is not"),
        ({"SKYRESUME_TLS_CERT": "{other}", "SKYRESUME_TLS_KEY": "{key}"}, "do not load"),
        ({"SKYRESUME_TLS_CERT": "{cert}", "SKYRESUME_TLS_KEY": "/nonexistent/k"}, "no such file"),
        ({"SKYRESUME_CA_BUNDLE": "{key}"}, "holds no PEM certificate"),
    ],
)
def test_bad_tls_settings_stop_serve_with_one_line_naming_them(tmp_path, pki, setting, message):
    env = _env(
        tmp_path,
        SKYRESUME_PORT=str(free_port()),
        SKYRESUME_RECONCILE="false",
        **{k: v.format(**{n: str(p) for n, p in pki.items()}) for k, v in setting.items()},
    )
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_an_agent_given_a_bundle_without_a_certificate_stops_before_anything_starts(tmp_path):
    bundle = tmp_path / "empty.pem"
    bundle.write_text("not a certificate\n")
    flags = {
        "--job-id": "j", "--attempt": "0", "--node-id": "n0", "--node-rank": "0",
        "--nnodes": "1", "--nproc-per-node": "1", "--service-url": "https://127.0.0.1:1",
        "--local-dir": str(tmp_path), "--ca-bundle": str(bundle),
    }  # fmt: skip
    argv = [x for kv in flags.items() for x in kv]
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator.agent", "--print-config", *argv, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr  # EXIT_USAGE
    assert "--ca-bundle" in r.stderr and "no usable PEM certificate" in r.stderr
