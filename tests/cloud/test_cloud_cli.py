"""`metadata probe` and `checkpoints ls|stage` through Typer, against real servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

# tests/cloud is on sys.path (pytest prepends a test file's folder; tests/ has no packages).
from cloud_checkpoints import make_local_checkpoint, shards
from typer.testing import CliRunner

from orchestrator.cloud import metadata as md
from orchestrator.cloud.simulator import MetadataSimulator
from orchestrator.cloud.storage import upload_checkpoint
from orchestrator.commands.cloud import register


def cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """root"""

    register(app)
    return app


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli(), list(args))


@pytest.mark.parametrize("provider", md.PROVIDERS)
def test_probe_prints_the_notice_as_json(sim: MetadataSimulator, provider: str) -> None:
    sim.schedule_notice("n1", provider, md.RECLAIM_KIND[md.Provider(provider)], 60)
    r = run("metadata", "probe", "--provider", provider, "--endpoint", sim.node_url("n1"))
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["notice"]["provider"] == provider
    assert doc["notice"]["deadline"]


def test_probe_prints_null_when_quiet(sim: MetadataSimulator) -> None:
    r = run("metadata", "probe", "--provider", "azure", "--endpoint", sim.node_url("n1"))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["notice"] is None


def test_probe_auto_detects_the_provider() -> None:
    with MetadataSimulator(providers=("aws",)) as only:
        r = run("metadata", "probe", "--endpoint", only.node_url("n1"))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"provider": "aws", "notice": None}


def test_probe_of_a_broken_endpoint_fails_with_one_error_line(sim: MetadataSimulator) -> None:
    sim.set_faults("n1", errors_5xx=100)
    r = run("metadata", "probe", "--provider", "gcp", "--endpoint", sim.node_url("n1"))
    assert r.exit_code != 0
    assert r.stderr.startswith("error: gcp metadata unreadable")
    assert len(r.stderr.strip().splitlines()) == 1


def test_probe_refuses_a_provider_whose_notices_it_cannot_read() -> None:
    r = run("metadata", "probe", "--provider", "oracle")
    assert r.exit_code == 2
    assert "oracle" in r.output


def test_probe_refuses_a_non_url_endpoint() -> None:
    r = run("metadata", "probe", "--provider", "aws", "--endpoint", "localhost:80")
    assert r.exit_code == 2
    assert "must be an http://" in r.stderr


def test_checkpoints_ls_and_stage(store_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    upload_checkpoint(str(make_local_checkpoint(src, 7, shards(7))), store_uri)
    r = run("checkpoints", "ls", store_uri, "--json")
    assert r.exit_code == 0, r.output
    (c,) = json.loads(r.stdout)
    assert c["step"] == 7 and c["complete"]
    r = run("checkpoints", "ls", store_uri)
    assert "step          7  complete" in r.stdout
    r = run("checkpoints", "stage", store_uri, str(tmp_path / "stage"), "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["step"] == 7 and doc["downloaded_bytes"] == doc["bytes"] > 0


def test_checkpoints_on_a_malformed_uri_fail_clearly() -> None:
    r = run("checkpoints", "ls", "s3://Bad!/x")
    assert r.exit_code != 0
    assert r.stderr.strip() == "error: s3://Bad!/x: 'Bad!' is not a valid bucket name"


def test_staging_an_empty_root_fails_clearly(tmp_path: Path) -> None:
    r = run("checkpoints", "stage", f"file://{tmp_path}/none", str(tmp_path / "d"))
    assert r.exit_code != 0
    assert "no complete checkpoint" in r.stderr
