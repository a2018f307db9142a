"""The agent package routes and the version check at register, through the real app
(SQLite; PostgreSQL when it is up)."""

from __future__ import annotations

import hashlib
import io
import shutil
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from testkit import job_spec

from orchestrator import __version__
from orchestrator.contract import AGENT_PROTOCOL
from orchestrator.store.models import Attempt

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def job(client) -> str:
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201
    job_id = r.json()["id"]
    with client.app.state.sessionmaker() as s, s.begin():
        s.add(
            Attempt(
                job_id=job_id,
                number=1,
                cloud="local",
                region="local",
                instance_type="cpu",
                num_nodes=1,
                spot=True,
                knobs={},
                started_at=datetime.now(UTC),
                state="running",
                launcher="local",
            )
        )
    return job_id


def register(client, job_id: str, **agent):
    body = {"node_rank": 0, "ranks": [], **agent}
    return client.post(f"/v1/jobs/{job_id}/attempts/1/nodes/n0/register", json=body)


CURRENT = {"agent_version": __version__, "agent_build": "source", "protocol": AGENT_PROTOCOL}


def test_a_current_agent_registers_and_learns_the_services_version(client, job):
    r = register(client, job, **CURRENT)
    assert r.status_code == 200, r.text
    assert r.json()["service_version"] == __version__
    assert r.json()["protocol"] == AGENT_PROTOCOL


@pytest.mark.parametrize(
    ("agent", "named"),
    [
        ({**CURRENT, "agent_version": "0.0.1"}, "skyresume 0.0.1"),  # an older agent
        ({**CURRENT, "agent_version": "9.9.9"}, "skyresume 9.9.9"),  # a newer one
        ({**CURRENT, "protocol": AGENT_PROTOCOL + 1}, f"protocol {AGENT_PROTOCOL + 1}"),
        ({}, "unversioned"),  # an agent from before the check
    ],
    ids=["older", "newer", "other-protocol", "unversioned"],
)
def test_an_agent_of_another_version_or_protocol_is_refused_naming_both(client, job, agent, named):
    r = register(client, job, **agent)
    assert r.status_code == 409
    assert r.headers["x-skyresume-refused"] == "agent-version"  # not "superseded"
    detail = r.json()["detail"]
    assert named in detail and f"skyresume {__version__}" in detail
    assert f"agent protocol {AGENT_PROTOCOL}" in detail
    # nothing was stored: the node is not registered
    hb = {"state": "running", "ranks": [], "last_checkpoint": None, "acked_command": None}
    r = client.post(f"/v1/jobs/{job}/attempts/1/nodes/n0/heartbeat", json=hb)
    assert r.status_code == 404


def test_another_build_of_the_same_version_is_accepted(client, job):
    assert register(client, job, **{**CURRENT, "agent_build": "ab" * 32}).status_code == 200


# --- the package ------------------------------------------------------------------------


def test_package_names_a_hash_pinned_wheel_under_the_public_url(tmp_path, db_url):
    from fastapi.testclient import TestClient

    from orchestrator.app import create_app
    from orchestrator.settings import Settings

    settings = Settings(
        home=tmp_path / "home", database_url=db_url, public_url="http://10.0.0.5:8470/"
    )
    with TestClient(create_app(settings)) as c:
        r = c.get("/v1/agent/package")  # no token: pip on a fresh node has none
        assert r.status_code == 200, r.text
        doc = r.json()
        wheel = doc["wheel"]
        assert doc["version"] == __version__ and wheel.startswith(f"skyresume-{__version__}-")
        assert doc["url"] == f"http://10.0.0.5:8470/v1/agent/dist/{wheel}"
        assert doc["pip_spec"] == f"{doc['url']}#sha256={doc['sha256']}"

        got = c.get(f"/v1/agent/dist/{wheel}")
        assert got.status_code == 200
        assert got.headers["content-type"] == "application/zip"
        assert hashlib.sha256(got.content).hexdigest() == doc["sha256"]
        names = zipfile.ZipFile(io.BytesIO(got.content)).namelist()
        assert "orchestrator/agent/main.py" in names and "training/__init__.py" in names
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
        build = zipfile.ZipFile(io.BytesIO(got.content)).read("orchestrator/_build_id")
        assert build.decode().strip() == doc["build"]
        # the same again: built once, the same bytes
        assert c.get("/v1/agent/package").json()["sha256"] == doc["sha256"]
        assert len(list((tmp_path / "home" / "agent-dist").glob("*/*.whl"))) == 1


@pytest.mark.parametrize(
    "name",
    ["skyresume-0.0.1-py3-none-any.whl", "token", "skyresume.db", "..%2Ftoken"],
    ids=["other-wheel", "home-file", "database", "encoded-traversal"],
)
def test_dist_serves_only_the_current_wheel(client, name):
    wheel = client.get("/v1/agent/package").json()["wheel"]
    r = client.get(f"/v1/agent/dist/{name}")
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")  # no file bytes
    detail = r.json()["detail"]
    assert detail == "Not Found" or detail.endswith(f"this service serves {wheel}")


def test_an_installed_package_without_its_source_tree_is_named_with_the_way_out(tmp_path):
    from orchestrator import package

    site = tmp_path / "site-packages" / "orchestrator"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    with pytest.raises(package.PackageUnavailable) as e:
        package.WheelCache(tmp_path / "home", package_dir=site).wheel()
    message = str(e.value)
    assert "no source tree" in message and str(site) in message
    assert "SKYRESUME_AGENT_PACKAGE" in message and "pip install -e" in message


def test_without_a_source_tree_the_package_route_is_503_saying_why(client, tmp_path):
    from orchestrator import package

    site = tmp_path / "site-packages" / "orchestrator"
    site.mkdir(parents=True)
    client.app.state.agent_wheels = package.WheelCache(tmp_path / "h", package_dir=site)
    r = client.get("/v1/agent/package")
    assert r.status_code == 503
    assert "no source tree" in r.json()["detail"]
    assert client.get("/v1/agent/dist/x.whl").status_code == 503


def test_the_wheel_is_rebuilt_when_the_source_changes(tmp_path):
    from orchestrator import package

    root = tmp_path / "src"
    shutil.copytree(
        ROOT, root, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "tests", "bench")
    )
    first = package.WheelCache(tmp_path / "home", package_dir=root / "orchestrator").wheel()
    with (root / "orchestrator" / "agent" / "main.py").open("a") as f:
        f.write("# an edit\n")
    second = package.WheelCache(tmp_path / "home", package_dir=root / "orchestrator").wheel()
    assert first.build != second.build and first.sha256 != second.sha256
    assert first.path.is_file() and second.path.is_file()  # each build keeps its own dir
