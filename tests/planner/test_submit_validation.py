"""``POST /v1/jobs`` (what ``skyresume submit`` sends) checks ``task.skypilot_yaml``
at once with SkyPilot's own parser: a missing file or a task SkyPilot rejects is a
422 naming the field, and no job is stored, so nothing of it is ever launched (issue
26, defect 10). On SQLite and PostgreSQL, as every API test."""

from __future__ import annotations

import json
from typing import Any

from tests.testkit import cli_through, job_spec


def _total(client: Any) -> int:
    return int(client.get("/v1/jobs").json()["total"])


def _post(client: Any, path: str) -> Any:
    return client.post("/v1/jobs", json=job_spec(task={"skypilot_yaml": path}))


def test_a_task_skypilot_rejects_is_never_stored(sky, client):
    tasks = client.app.state.settings.effective_skypilot_yaml_dir
    tasks.mkdir(parents=True, exist_ok=True)
    before = _total(client)
    bad = {
        "missing.yaml": None,
        "empty-env.yaml": "envs:\n  HF_TOKEN:\nrun: echo\n",  # SkyPilot: HF_TOKEN is None
        "bad-field.yaml": "resources:\n  acceleratorz: A100:8\nrun: echo\n",
        "setup.yaml": "resources:\n  disk_size: -5\nsetup: pip install torch\nrun: echo\n",
    }
    for name, text in bad.items():
        path = tasks / name
        if text is not None:
            path.write_text(text)
        r = _post(client, str(path))
        assert r.status_code == 422, (name, r.text)
        detail = r.json()["detail"][0]
        assert detail["loc"] == ["body", "task", "skypilot_yaml"], detail
        assert ("SkyPilot rejected it" in detail["msg"]) or ("cannot read" in detail["msg"])
    assert _total(client) == before  # nothing stored, so nothing launched
    good = tasks / "good.yaml"
    good.write_text("resources:\n  accelerators: A100:8\nrun: echo\n")
    assert _post(client, str(good)).status_code == 201
    assert _total(client) == before + 1


def test_submit_resolves_a_relative_task_path_against_the_spec_once(sky, client, monkeypatch):
    """``skyresume submit`` sends the task path resolved against the spec's folder (as
    ``plan`` reads it), never left for the service's working directory at launch.
    The CLI talks to this test's real app (TestClient) instead of over a socket."""
    from typer.testing import CliRunner

    cli = cli_through(client, monkeypatch)
    tasks = client.app.state.settings.effective_skypilot_yaml_dir
    (tasks / "sub").mkdir(parents=True, exist_ok=True)
    (tasks / "sub" / "train.yaml").write_text("resources:\n  accelerators: A100:8\nrun: echo\n")
    spec = tasks / "job.yaml"
    spec.write_text(
        "name: rel\nnum_nodes: 1\ntask: {skypilot_yaml: sub/train.yaml}\n"
        "checkpoint: {uri: 'file:///tmp/ckpt'}\n"
    )
    monkeypatch.chdir("/")  # the CLI's own working directory plays no part
    r = CliRunner().invoke(cli.app, ["submit", str(spec), "-o", "json"])
    assert r.exit_code == 0, r.output
    job = client.get(f"/v1/jobs/{json.loads(r.stdout)['id']}").json()
    assert job["spec"]["task"]["skypilot_yaml"] == str((tasks / "sub" / "train.yaml").resolve())


def test_envs_fill_the_yamls_empty_ones_and_secrets_never_come_back(sky, client):
    tasks = client.app.state.settings.effective_skypilot_yaml_dir
    tasks.mkdir(parents=True, exist_ok=True)
    path = tasks / "hf.yaml"
    path.write_text("envs:\n  HF_TOKEN:\nresources:\n  accelerators: A100:8\nrun: echo\n")
    assert _post(client, str(path)).status_code == 422  # SkyPilot: HF_TOKEN is None
    doc = job_spec(
        task={"skypilot_yaml": str(path), "envs": {"HF_TOKEN": "hf_x"},
              "secrets": {"WANDB_API_KEY": "s3cr3t-value"}},
    )  # fmt: skip
    r = client.post("/v1/jobs", json=doc)
    assert r.status_code == 201, r.text
    assert "s3cr3t-value" not in r.text
    job_id = r.json()["id"]
    for answer in (client.get(f"/v1/jobs/{job_id}"), client.get("/v1/jobs")):
        assert answer.is_success and "s3cr3t-value" not in answer.text
    shown = client.get(f"/v1/jobs/{job_id}").json()["spec"]["task"]
    assert shown["secrets"] == {"WANDB_API_KEY": "<redacted>"}
    assert shown["envs"] == {"HF_TOKEN": "hf_x"}
    bad = job_spec(task={"skypilot_yaml": str(path), "envs": {"not a name": "x"}})
    assert client.post("/v1/jobs", json=bad).status_code == 422
