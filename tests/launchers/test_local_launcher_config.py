"""The local launcher's config: what it refuses, and how the service's settings and
environment become it (server.local_launcher_config, the one place they are read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.launchers.local import STORAGE_ENV, LocalLauncher, LocalLauncherConfig
from orchestrator.server import local_launcher_config
from orchestrator.settings import Settings


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"provider": "oracle"}, "provider must be one of aws, gcp, azure"),
        ({"network": "auto"}, "network must be netns or loopback"),
        ({"regions": ()}, "at least one region"),
        ({"hosts_per_region": 0}, "one host in each"),
    ],
    ids=["provider", "network", "regions", "hosts"],
)
def test_a_config_the_launcher_could_not_play_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        LocalLauncherConfig(**bad)


def test_the_config_keeps_its_own_copy_of_the_callers_mappings():
    image = {"PATH": "/opt/bin"}
    config = LocalLauncherConfig(image_env=image, regions=["r1", "r2"])  # type: ignore[arg-type]
    image["PATH"] = "/elsewhere"
    assert config.image_env == {"PATH": "/opt/bin"} and config.regions == ("r1", "r2")


def test_kept_survivors_and_single_releases_need_nodes_that_are_hosts(tmp_path: Path):
    loopback = LocalLauncher(tmp_path, "http://svc", lambda j, a: "t")
    netns = LocalLauncher(
        tmp_path, "http://svc", lambda j, a: "t", LocalLauncherConfig(network="netns")
    )
    assert not loopback.abilities.keeps_survivors and not loopback.abilities.releases_single_nodes
    assert netns.abilities.keeps_survivors and netns.abilities.releases_single_nodes


def test_the_service_settings_become_the_config(tmp_path: Path):
    settings = Settings(
        home=tmp_path,
        local_provider="gcp",
        local_regions="us-a,us-b",
        local_hosts_per_region=3,
        local_provision_delay_s=2.5,
        local_gpu_memory_gib=80,
        local_replacement_gpu_memory_gib=40,
        local_node_env="PATH, HF_TOKEN, UNSET",
        local_keep_survivors=False,
        local_release_single_nodes=False,
    )
    store = STORAGE_ENV[0]
    environ = {"PATH": "/opt/bin", "HF_TOKEN": "secret", store: "http://s3", "OTHER": "x"}
    config = local_launcher_config(
        settings, network="netns", network_note="why", package="pkg", environ=environ
    )
    assert config == LocalLauncherConfig(
        provider="gcp",
        network="netns",
        network_note="why",
        regions=("us-a", "us-b"),
        hosts_per_region=3,
        provision_delay_s=2.5,
        gpu_memory_gib=80,
        replacement_gpu_memory_gib=40,
        package="pkg",
        pip_args=settings.pip_args or "--no-index --no-deps",
        storage_env={store: "http://s3"},
        image_env={"PATH": "/opt/bin"},  # named, set, and never a token
        keep_survivors=False,
        release_single_nodes=False,
    )
