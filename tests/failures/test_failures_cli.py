from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from orchestrator.commands.failures import register


@pytest.fixture
def app() -> typer.Typer:
    a = typer.Typer()
    register(a)
    return a


runner = CliRunner()

# https://github.com/tatsu-lab/stanford_alpaca/issues/207
IB_LOG = (
    "step 1200 loss 2.31\n"
    "[E ProcessGroupNCCL.cpp:455] Some NCCL operations have failed or timed out.\n"
    "what(): NCCL error: remote process exited or there was a network error, NCCL version "
    "2.14.3 ncclRemoteError: A call failed possibly due to a network error\n"
)


def test_classify_prints_the_json_contract(app: typer.Typer, tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_text(IB_LOG)
    r = runner.invoke(app, ["classify", str(log), "--exit-code", "1"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) == {"class", "retryable", "confidence", "evidence", "decided_by"}
    assert doc["class"] == "nccl_transport"
    assert doc["retryable"] is True
    assert any("ncclRemoteError" in e for e in doc["evidence"])
    # The line that decided it, as it stands in the log.
    assert doc["confidence"] >= 0.9
    assert "ncclRemoteError" in doc["decided_by"]
    assert doc["decided_by"] in IB_LOG.splitlines()


def test_classify_reads_exit_code_and_signal(app: typer.Typer, tmp_path: Path) -> None:
    log = tmp_path / "empty.log"
    log.write_text("")
    doc = json.loads(runner.invoke(app, ["classify", str(log), "--exit-code", "76"]).stdout)
    assert doc["class"] == "nan_divergence"
    doc = json.loads(runner.invoke(app, ["classify", str(log), "--signal", "SIGKILL"]).stdout)
    assert doc["class"] == "host_oom_killed"


def test_classify_reads_stdin(app: typer.Typer) -> None:
    r = runner.invoke(app, ["classify", "-"], input="torch.OutOfMemoryError: CUDA out of memory.")
    assert json.loads(r.stdout)["class"] == "cuda_oom"


def test_classify_missing_file_is_one_error_line(app: typer.Typer, tmp_path: Path) -> None:
    r = runner.invoke(app, ["classify", str(tmp_path / "nope.log")])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: log file")
    assert "Traceback" not in r.output


def test_classify_bad_signal_is_one_error_line(app: typer.Typer, tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("")
    r = runner.invoke(app, ["classify", str(log), "--signal", "SIGWHAT"])
    assert r.exit_code == 2
    assert "SIGWHAT" in r.stderr


def test_advise_reproduces_the_issue_figures(app: typer.Typer) -> None:
    args = ["advise", "--gpus", "512", "--restart-seconds", "600", "--output", "json"]
    a60 = json.loads(runner.invoke(app, [*args, "--save-seconds", "60"]).stdout)
    a5 = json.loads(runner.invoke(app, [*args, "--save-seconds", "5"]).stdout)
    assert a60["interval_minutes"] == pytest.approx(109, abs=1)
    assert a60["lost_fraction"] == pytest.approx(0.02, abs=0.001)
    assert a5["interval_minutes"] == pytest.approx(31, abs=1)
    assert a5["lost_fraction"] == pytest.approx(0.007, abs=0.0005)


def test_advise_table_names_interval_and_lost_time(app: typer.Typer) -> None:
    r = runner.invoke(
        app, ["advise", "--gpus", "512", "--save-seconds", "60", "--restart-seconds", "600"]
    )
    assert r.exit_code == 0
    assert "108.3 min" in r.stdout  # Daly's: Young's 109.0 min, less the 1-minute save
    assert "2.00%" in r.stdout


def test_advise_refuses_nonpositive_gpus(app: typer.Typer) -> None:
    r = runner.invoke(
        app, ["advise", "--gpus", "0", "--save-seconds", "6", "--restart-seconds", "1"]
    )
    assert r.exit_code == 2
    assert r.stderr.strip() == "error: --gpus must be positive, got 0"


def test_simulate_compares_all_policies_at_llama3_scale(app: typer.Typer) -> None:
    r = runner.invoke(
        app,
        ["simulate", "--gpus", "16384", "--days", "54", "--failure-model", "llama3", "-o", "json"],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    fr = {x["policy"]: x["effective_training_fraction"] for x in doc["results"]}
    assert set(fr) == {"skyresume", "skypilot-managed", "torchrun"}
    assert fr["skyresume"] > fr["skypilot-managed"]
    assert fr["skyresume"] > fr["torchrun"]


def test_simulate_one_policy_table(app: typer.Typer) -> None:
    r = runner.invoke(app, ["simulate", "--policy", "skyresume", "--seed", "3"])
    assert r.exit_code == 0
    assert "skyresume" in r.stdout
    assert "torchrun" not in r.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--policy", "foo"], "--policy 'foo'"),
        (["--failure-model", "weibull"], "--failure-model 'weibull'"),
        (["--days", "0"], "--days"),
    ],
    ids=["policy", "model", "days"],
)
def test_simulate_bad_input_is_one_error_line(
    app: typer.Typer, args: list[str], needle: str
) -> None:
    r = runner.invoke(app, ["simulate", *args])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
