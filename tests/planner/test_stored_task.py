"""A job's SkyPilot task is read once, at submit, and stored with it (issue 26): the
reconciler launches the stored text whatever becomes of the file; the YAML's
``num_nodes`` is used unless the spec gives its own, and which was used is said;
a field skyresume does not run is named in one line. Through the real app on
SQLite and PostgreSQL, and the real reconciler with a launcher that renders each
node's task as the local launcher does (``SkyPilotLauncher.node_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.testkit import FakeLauncher, cli_through, job_spec

TASK = """\
num_nodes: 3
resources:
  accelerators: A100:8
setup: echo submitted-setup
run: echo submitted-run
"""


@dataclass
class RenderingLauncher(FakeLauncher):
    """The fake's cluster, with each launch's task rendered as the local launcher
    renders the node's (the same code path reads the task YAML)."""

    rendered: list[dict[str, Any]] = field(default_factory=list)
    seen_specs: list[Any] = field(default_factory=list)

    def candidates(self, spec, *, replacement=False):  # type: ignore[no-untyped-def]
        self.seen_specs.append(spec)
        return super().candidates(spec, replacement=replacement)

    def launch(self, request):  # type: ignore[no-untyped-def]
        from orchestrator.launchers.skypilot import SkyPilotLauncher

        config, _ = SkyPilotLauncher(token_for=lambda *_: "t").node_config(request, request.task)
        self.rendered.append(config)
        return super().launch(request)


def _tasks_dir(client: Any) -> Path:
    tasks: Path = client.app.state.settings.effective_skypilot_yaml_dir
    tasks.mkdir(parents=True, exist_ok=True)
    return tasks


def _submit(client: Any, path: Path, **overrides: Any) -> Any:
    doc = job_spec(task={"skypilot_yaml": str(path)})
    for key in ("num_nodes", "min_nodes", "accelerators", "spot", "clouds", "regions"):
        doc.pop(key)  # left to the YAML
    doc.update(overrides)
    return client.post("/v1/jobs", json=doc)


def _notes(client: Any, job_id: str) -> list[str]:
    items = client.get(f"/v1/jobs/{job_id}/events").json()["items"]
    return [e["message"] for e in items if e["kind"] == "task_note"]


def test_a_task_edited_or_deleted_after_submit_launches_as_submitted(sky, client, tmp_path):
    from orchestrator.reconciler.loop import Reconciler

    path = _tasks_dir(client) / "train.yaml"
    path.write_text(TASK)
    r = _submit(client, path)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    path.write_text(TASK.replace("submitted", "edited").replace("num_nodes: 3", "num_nodes: 5"))
    launcher = RenderingLauncher(tmp_path / "disks")
    rec = Reconciler(client.app.state.sessionmaker, launcher, "http://svc")
    now = datetime.now(UTC)
    for _ in range(4):
        rec.reconcile(job_id, now=now)
        if launcher.rendered:
            break
    assert launcher.rendered, "the job was never launched"
    config = launcher.rendered[0]
    assert "echo submitted-setup" in config["setup"] and "edited" not in config["setup"]
    assert "echo submitted-run" in config["envs"]["SKYRESUME_COMMAND"]
    assert launcher.launched[0].placement.num_nodes == 3  # the YAML's count at submit
    path.unlink()  # deleted: the launcher's candidates still read what was submitted
    launcher.seen_specs.clear()
    from orchestrator.store.snapshot import gather_snapshot

    with client.app.state.sessionmaker() as s:
        _, rows = gather_snapshot(s, job_id, now, launcher)
    copy = Path(rows.spec.task.skypilot_yaml)
    assert copy != path and copy.read_text() == TASK
    shown = client.get(f"/v1/jobs/{job_id}").json()["spec"]["task"]["skypilot_yaml"]
    assert shown == str(path.resolve())  # the API shows the file the text came from


def test_the_yamls_num_nodes_is_used_unless_the_spec_gives_its_own(sky, client):
    path = _tasks_dir(client) / "nodes.yaml"
    path.write_text(TASK)
    r = _submit(client, path)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["num_nodes"] == 3
    assert "nodes: 3 from the YAML's num_nodes (the job spec sets none)" in _notes(
        client, r.json()["id"]
    )
    r = _submit(client, path, num_nodes=2)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["num_nodes"] == 2
    notes = _notes(client, r.json()["id"])
    assert "nodes: 2 from the job spec (the YAML says 3)" in notes
    assert any(n.startswith("spot: the YAML's use_spot") for n in notes)
    # min_nodes is checked against the count the job gets: the YAML's
    r = _submit(client, path, min_nodes=4)
    assert r.status_code == 422 and "min_nodes (4) exceeds num_nodes (3)" in r.text
    # a template job has no YAML to take a count from
    doc = job_spec()
    doc.pop("num_nodes")
    r = client.post("/v1/jobs", json=doc)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "num_nodes"]


def test_plan_uses_the_yamls_num_nodes_when_the_spec_gives_none(sky, tmp_path):
    import json

    from typer.testing import CliRunner

    from orchestrator.cli import app

    (tmp_path / "t.yaml").write_text(TASK)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: j\ntask: {skypilot_yaml: t.yaml}\ncheckpoint: {uri: 'file:///c'}\n")
    r = CliRunner().invoke(app, ["plan", str(spec), "-o", "json", "--no-history"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ranked"][0]["num_nodes"] == 3
    assert "nodes: 3 from the YAML's num_nodes (the job spec sets none)" in doc["notes"]


def test_a_job_group_and_unsupported_fields_are_named_at_submit(sky, client):
    tasks = _tasks_dir(client)
    group = tasks / "group.yaml"
    group.write_text("name: g\n---\nname: a\nrun: x\n---\nname: b\nrun: y\n")
    r = _submit(client, group)
    assert r.status_code == 422
    msg = r.json()["detail"][0]["msg"]
    assert "job groups are not supported" in msg and "\n" not in msg
    recovering = tasks / "recovering.yaml"
    recovery = "  accelerators: A100:8\n  job_recovery:\n    max_restarts_on_errors: 1\n"
    recovering.write_text(TASK.replace("  accelerators: A100:8\n", recovery))
    r = _submit(client, recovering)
    assert r.status_code == 201, r.text
    notes = _notes(client, r.json()["id"])
    assert sum(n.startswith("resources.job_recovery:") for n in notes) == 1


def test_submit_prints_which_of_the_spec_and_the_yaml_decided(sky, client, monkeypatch):
    """The CLI talks to this test's real app (TestClient) instead of over a socket."""
    from typer.testing import CliRunner

    cli = cli_through(client, monkeypatch)
    tasks = _tasks_dir(client)
    (tasks / "train.yaml").write_text(TASK)
    spec = tasks / "job.yaml"
    spec.write_text("name: j\ntask: {skypilot_yaml: train.yaml}\ncheckpoint: {uri: 'file:///c'}\n")
    r = CliRunner().invoke(cli.app, ["submit", str(spec)])
    assert r.exit_code == 0, r.output
    assert "note: nodes: 3 from the YAML's num_nodes (the job spec sets none)" in r.stdout


def test_the_services_copies_of_stored_tasks_are_gone_when_it_exits() -> None:
    """A stored text may hold a task's secrets: its private copy (0600 in a 0700
    directory) lives only as long as the process that launches from it."""
    import subprocess
    import sys

    code = (
        "from orchestrator.launchers.user_task import stored_copy\n"
        "p = stored_copy('secrets:\\n  K: v\\n', 'task.yaml')\n"
        "import os, stat; print(p, oct(stat.S_IMODE(os.stat(p).st_mode)),"
        " oct(stat.S_IMODE(os.stat(p.parent.parent).st_mode)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path, mode, dir_mode = out.stdout.split()
    assert (mode, dir_mode) == (oct(0o600), oct(0o700)), out.stdout
    assert not Path(path).parent.parent.exists()
