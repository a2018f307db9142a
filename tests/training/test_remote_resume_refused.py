"""An explicit RESUME_FROM that is an s3:// or gs:// URI is never read as a path: the
rank exits 78 saying the agent stages checkpoints, naming the URI. file:// and plain
paths keep loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.contract import Env, ExitCode
from training import Run, RunExit


def _run(tmp: Path, env: dict[str, str]) -> Run:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    env = {Env.CHECKPOINT_URI: f"file://{tmp / 'ckpt'}", Env.CHECKPOINT_EVERY: "2", **env}
    return Run.from_env(model=model, optimizer=opt, env=env, use_async=False)


def _train(run: Run, steps: int) -> None:
    for _ in run.steps(steps):
        loss = run.model(torch.ones(2, 4)).pow(2).mean()  # type: ignore[attr-defined]
        loss.backward()
        run.report(loss=loss)
        run.optimizer.step()  # type: ignore[attr-defined]
        run.optimizer.zero_grad()  # type: ignore[attr-defined]


@pytest.mark.parametrize("uri", ["s3://bucket/prefix/step_4", "gs://bucket/p/step_4"])
def test_a_remote_resume_from_exits_78_saying_the_agent_stages_it(tmp_path, capfd, uri):  # type: ignore[no-untyped-def]
    run = _run(tmp_path, {Env.RESUME_FROM: uri, Env.EXPECTED_STEP: "4"})
    with pytest.raises(RunExit) as info:
        run.restore()
    assert info.value.code == ExitCode.CHECKPOINT_INVALID
    assert uri in info.value.reason
    assert "agent stages checkpoints onto the node's disk before the ranks start" in (
        info.value.reason
    )
    assert "no COMMIT" not in info.value.reason  # not mistaken for a local directory
    assert uri in capfd.readouterr().err
    assert not Path("s3:").exists() and not Path("gs:").exists()


@pytest.mark.parametrize("form", ["path", "file-uri"])
def test_a_local_resume_from_still_loads(tmp_path, form):  # type: ignore[no-untyped-def]
    run = _run(tmp_path, {})
    _train(run, 4)
    run.finish()
    step_dir = tmp_path / "ckpt" / "step_2"
    assert (step_dir / "COMMIT").is_file()
    where = str(step_dir) if form == "path" else f"file://{step_dir}"
    run = _run(tmp_path, {Env.RESUME_FROM: where, Env.EXPECTED_STEP: "2"})
    assert run.restore() == 2
