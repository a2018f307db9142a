"""A job's secrets reach its nodes and nothing else (issue 26): no API answer, no
event, no log line of the service and no ``skyresume`` output shows a value. The
job's row keeps them (the launcher passes them at every launch, as SkyPilot's
``secrets:``). Through the real app on SQLite and PostgreSQL, the CLI against it,
and the real reconciler launching through a launcher that renders the node's task
and secrets as the local launcher does."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import select

from tests.planner.test_stored_task import RenderingLauncher
from tests.testkit import cli_through

SPEC_SECRET = "spec-secret-6f1d2c"
CLI_SECRET = "cli-secret-9a8b7c"
YAML_SECRET = "yaml-secret-3e4f5a"

TASK = f"""\
envs:
  HF_HOME: /data/hf
secrets:
  WANDB_API_KEY:
  INLINE_TOKEN: {YAML_SECRET}
resources:
  accelerators: A100:8
  image_id: docker:pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
run: python train.py
"""

VALUES = (SPEC_SECRET, CLI_SECRET, YAML_SECRET)


def _shown(text: str) -> list[str]:
    return [v for v in VALUES if v in text]


def test_secrets_reach_the_launch_and_no_answer_event_log_or_cli_output(
    sky, client, tmp_path, monkeypatch, caplog
):
    from typer.testing import CliRunner

    from orchestrator.reconciler.loop import Reconciler
    from orchestrator.store.models import Job

    cli = cli_through(client, monkeypatch)
    caplog.set_level(logging.DEBUG)
    tasks = client.app.state.settings.effective_skypilot_yaml_dir
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "train.yaml").write_text(TASK)
    spec = tasks / "job.yaml"
    spec.write_text(
        "name: secretive\ntask:\n  skypilot_yaml: train.yaml\n"
        f"  secrets: {{WANDB_API_KEY: {SPEC_SECRET}}}\ncheckpoint: {{uri: 'file:///c'}}\n"
    )
    outputs = []
    for args in (["submit", str(spec), "--dry-run"], ["submit", str(spec)]):
        r = CliRunner().invoke(cli.app, [*args, "--secret", f"EXTRA={CLI_SECRET}"])
        assert r.exit_code == 0, r.output
        outputs.append(r.output)
    job_id = client.get("/v1/jobs").json()["items"][0]["id"]
    r = CliRunner().invoke(cli.app, ["jobs", "-o", "json"])
    outputs.append(r.output)

    launcher = RenderingLauncher(tmp_path / "disks")
    rec = Reconciler(client.app.state.sessionmaker, launcher, "http://svc")
    now = datetime.now(UTC)
    for _ in range(4):
        rec.reconcile(job_id, now=now)
        if launcher.launched:
            break
    assert launcher.launched, "the job was never launched"
    # The launch gets every secret, as SkyPilot's secrets (the node's, not its envs).
    from orchestrator.launchers.skypilot import SkyPilotLauncher

    request = launcher.launched[0]
    config, secrets = SkyPilotLauncher(token_for=lambda *_: "t").node_config(request)
    assert secrets["WANDB_API_KEY"] == SPEC_SECRET and secrets["EXTRA"] == CLI_SECRET
    assert secrets["INLINE_TOKEN"] == YAML_SECRET
    assert not _shown(repr(request)) and not _shown(str(config.get("envs")))
    with client.app.state.sessionmaker() as s:  # kept for the next launch: on the row
        row = s.scalars(select(Job).where(Job.id == job_id)).one()
        assert row.spec["task"]["secrets"]["WANDB_API_KEY"] == SPEC_SECRET

    answers = {
        path: client.get(path)
        for path in (
            "/v1/jobs", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events", "/v1/events",
            f"/v1/jobs/{job_id}/attempts", f"/v1/jobs/{job_id}/incidents",
            f"/v1/jobs/{job_id}/live", f"/v1/jobs/{job_id}/goodput",
        )
    }  # fmt: skip
    for path, answer in answers.items():
        assert answer.status_code == 200, (path, answer.text)
        assert not _shown(answer.text), path
    shown = answers[f"/v1/jobs/{job_id}"].json()["spec"]["task"]["secrets"]
    assert shown == {"WANDB_API_KEY": "<redacted>", "EXTRA": "<redacted>"}
    assert any(
        e["kind"] == "task_note" for e in answers[f"/v1/jobs/{job_id}/events"].json()["items"]
    )
    for out in outputs:
        assert not _shown(out), out
    assert "<redacted>" in outputs[0]  # the dry run's task names its secrets, no value
    logged = [r.getMessage() for r in caplog.records]
    assert logged, "nothing was logged: the check would prove nothing"
    assert not [line for line in logged if _shown(line)]
