"""``POST /v1/jobs/render`` and ``skyresume submit --dry-run``, through the real app:
the SkyPilot task YAML a job's first launch would submit, as SkyPilot reads it, so a
user can check that their image, disk and ports survive pinning. Nothing is stored,
nothing is asked of SkyPilot's API server; a bad spec is the usual 422."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.store import repo

pytestmark = pytest.mark.filterwarnings("ignore::Warning:sky")

YAMLS = Path(__file__).parent / "yamls"
GCP_IMAGE = "projects/deeplearning-platform-release/global/images/family/pytorch-latest-gpu"


def spec(**overrides: Any) -> dict[str, Any]:
    doc = {
        "name": "render-me",
        "task": {"template": "skypilot-gpu", "command": "python train.py"},
        "num_nodes": 2,
        "accelerators": ["A100:8"],
        "clouds": ["gcp"],
        "checkpoint": {"uri": "s3://bucket/ckpt"},
    }
    doc.update(overrides)
    return doc


@pytest.fixture
def make_client(tmp_path: Path, sky: Any):
    from fastapi.testclient import TestClient

    from orchestrator.app import create_app
    from orchestrator.settings import Settings
    from orchestrator.store import db

    apps = []

    def make(**settings: Any):
        url = f"sqlite:///{tmp_path / f'db{len(apps)}.sqlite'}"
        db.upgrade(url)
        settings.setdefault("skypilot_yaml_dir", YAMLS)  # where task files may be read
        app = create_app(Settings(home=tmp_path / "home", database_url=url, **settings))
        client = TestClient(app)
        client.headers["Authorization"] = f"Bearer {app.state.token}"
        apps.append(app)
        return app, client

    yield make
    for app in apps:
        app.state.engine.dispose()


def jobs_stored(app) -> int:
    with app.state.sessionmaker() as s:
        return repo.list_jobs(s).total


def test_render_shows_the_pinned_task_with_the_users_image_disk_and_ports(make_client):
    app, client = make_client()
    own = {"skypilot_yaml": str(YAMLS / "own_resources.yaml")}
    r = client.post("/v1/jobs/render", json=spec(task=own, accelerators=[]))
    assert r.status_code == 200, r.text
    out = r.json()
    doc = yaml.safe_load(out["task_yaml"])
    res = doc["resources"]
    assert res["infra"].startswith("gcp/") and res["use_spot"] is True
    assert res["image_id"] == {
        res["infra"].split("/")[1]: "projects/my-project/global/images/torch-2-3"
    }
    assert res["disk_size"] == 500 and res["ports"] == ["8080"] and res["labels"] == {"team": "ml"}
    assert doc["num_nodes"] == 2 and out["cluster_name"] == "sr-dry-run-a1"
    assert "A100:8" in out["placement"] and "2 nodes" in out["placement"]
    assert doc["envs"]["SKYRESUME_RUN_CHECKPOINT_URI"] == "s3://bucket/ckpt"
    assert jobs_stored(app) == 0  # a dry run stores nothing


def test_render_names_the_operators_default_image_for_a_template(make_client):
    _, client = make_client(skypilot_image_id=GCP_IMAGE)
    r = client.post("/v1/jobs/render", json=spec())
    assert r.status_code == 200, r.text
    res = yaml.safe_load(r.json()["task_yaml"])["resources"]
    assert list(res["image_id"].values()) == [GCP_IMAGE]


def test_a_task_the_launcher_would_refuse_is_422_saying_why(make_client):
    app, client = make_client()  # no image anywhere, and the template installs no torch
    r = client.post("/v1/jobs/render", json=spec())
    assert r.status_code == 422
    assert "no node image is named" in r.text and "SKYRESUME_SKYPILOT_IMAGE_ID" in r.text
    assert jobs_stored(app) == 0


def test_a_bad_spec_is_the_usual_422(make_client):
    _, client = make_client()
    r = client.post("/v1/jobs/render", json=spec(num_nodes=2, min_nodes=5, bogus=1))
    assert r.status_code == 422
    assert {"loc": ["body", "bogus"], "msg": "unknown field"} in r.json()["detail"]
    r = client.post(
        "/v1/jobs/render", content=b"a: [", headers={"content-type": "application/yaml"}
    )
    assert r.status_code == 422


def test_submit_dry_run_prints_the_yaml_and_submits_nothing(make_client, tmp_path, monkeypatch):
    """The CLI through the real app (its HTTP client pointed at the ASGI app)."""
    from typer.testing import CliRunner

    from orchestrator import cli
    from orchestrator.commands import common

    app, client = make_client(skypilot_image_id=GCP_IMAGE)

    class AppClient:
        def request(self, method: str, path: str, **kw: Any) -> Any:
            r = client.request(method, path, **kw)
            assert r.status_code < 400, r.text
            return r.json()

    monkeypatch.setattr(cli, "Client", AppClient)
    monkeypatch.setattr(common, "Client", AppClient)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec()))
    result = CliRunner().invoke(cli.app, ["submit", "--dry-run", str(path)])
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load(result.stdout)
    assert doc["resources"]["instance_type"] and doc["num_nodes"] == 2
    assert jobs_stored(app) == 0
