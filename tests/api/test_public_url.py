"""Nodes are never handed a service URL they cannot reach (SKYRESUME_PUBLIC_URL)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from orchestrator import server
from orchestrator.settings import NotRoutable, Settings, require_routable


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8470",
        "http://127.8.9.10:8470",
        "http://localhost:8470",
        "http://api.localhost",
        "http://0.0.0.0:8470",
        "http://[::]:8470",
        "http://[::1]:8470",
        "http://:8470",
        "",
        "ftp://10.0.0.5",
    ],
)
def test_unreachable_urls_are_refused_saying_what_to_set(url):
    with pytest.raises(NotRoutable) as e:
        require_routable(url, launcher="skypilot")
    assert "SKYRESUME_PUBLIC_URL" in str(e.value) and "skypilot launcher" in str(e.value)


@pytest.mark.parametrize(
    "url", ["http://10.0.0.5:8470", "https://skyresume.example.com", "http://[fd00::5]:8470"]
)
def test_routable_urls_pass(url):
    assert require_routable(url, launcher="skypilot") == url


def test_the_public_url_is_what_nodes_and_the_cli_are_given(tmp_path):
    s = Settings(
        home=tmp_path, service_url="http://127.0.0.1:8470", public_url="http://10.0.0.5:8470/"
    )
    assert s.effective_service_url == "http://10.0.0.5:8470"
    assert Settings(home=tmp_path).effective_service_url == "http://127.0.0.1:8470"


def test_a_loopback_public_url_is_a_bad_setting(tmp_path):
    with pytest.raises(ValidationError, match="not a URL nodes can reach"):
        Settings(home=tmp_path, public_url="http://127.0.0.1:8470")


def test_the_skypilot_launcher_needs_a_routable_url(tmp_path):
    with pytest.raises(ValidationError, match="SKYRESUME_PUBLIC_URL"):
        Settings(home=tmp_path, launcher="skypilot", host="0.0.0.0")
    ok = Settings(home=tmp_path, launcher="skypilot", public_url="http://10.0.0.5:8470")
    assert ok.effective_service_url == "http://10.0.0.5:8470"


def test_make_launcher_refuses_a_loopback_url_even_past_validation(tmp_path):
    # model_copy (as bind_settings does) skips validation: make_launcher checks again.
    s = Settings(home=tmp_path).model_copy(update={"launcher": "skypilot"})
    with contextlib.ExitStack() as cleanup, pytest.raises(NotRoutable):
        server.make_launcher(s, "tok", cleanup)


def test_serve_with_skypilot_on_loopback_is_one_error_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
    env.update(SKYRESUME_HOME=str(tmp_path), SKYRESUME_LAUNCHER="skypilot")
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve"],
        env=env,
        cwd=tmp_path,  # no .env from the checkout
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: bad setting SKYRESUME_LAUNCHER: ")
    assert "set SKYRESUME_PUBLIC_URL" in out.stderr and "127.0.0.1" in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


# --- https unless the URL is on a private network (SKYPILOT.md defect 15) ---------------


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.5:8470",
        "http://172.31.4.2:8470",
        "http://192.168.1.9",
        "http://100.100.7.1:8470",  # carrier-grade NAT space (overlays such as Tailscale)
        "http://[fd00::5]:8470",
        "http://skyresume:8470",  # one label: the local search domain
        "http://ip-10-0-0-5.ec2.internal:8470",
        "http://svc.home.arpa",
        "https://203.0.113.7:8470",
        "https://skyresume.example.com",
    ],
)
def test_plain_http_is_allowed_only_on_a_private_network(tmp_path, url):
    assert Settings(home=tmp_path, public_url=url).public_url == url
    assert require_routable(url, launcher="skypilot") == url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://54.12.7.9:8470", "plain http to 54.12.7.9, a public address"),
        ("http://[2600:1f18::5]:8470", "plain http to 2600:1f18::5, a public address"),
        ("http://skyresume.example.com", "plain http to skyresume.example.com, a name that"),
    ],
    ids=["public-ipv4", "public-ipv6", "dns-name"],
)
def test_plain_http_to_a_public_address_is_one_bad_setting_line_naming_why(tmp_path, url, why):
    with pytest.raises(ValidationError) as e:
        Settings(home=tmp_path, public_url=url)
    assert why in str(e.value) and "bearer tokens" in str(e.value) and "https://" in str(e.value)
    with pytest.raises(NotRoutable, match="SKYRESUME_PUBLIC_URL"):
        require_routable(url, launcher="skypilot")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
    env.update(SKYRESUME_HOME=str(tmp_path), SKYRESUME_PUBLIC_URL=url)
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.startswith("error: bad setting SKYRESUME_PUBLIC_URL: ")
    assert why in out.stderr and out.stderr.count("\n") == 1


def test_the_skypilot_launcher_refuses_a_public_http_service_url_too(tmp_path):
    with pytest.raises(ValidationError, match="a public address"):
        Settings(home=tmp_path, launcher="skypilot", service_url="http://54.12.7.9:8470")
