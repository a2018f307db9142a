"""The Run facade in one process (no torchrun): stop -> emergency save -> 75 and an
exact resume, the exit codes of bad resumes, NaN before the update, and the
environment contract; one real process for an exit through a second SIGTERM
(exit_worker.py). Multi-rank behaviour is in test_run_torchrun.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.contract import COMMIT_NAME, Env, ExitCode
from training import ResumableSampler, Run, RunConfig, RunExit
from training.checkpoint import find_latest_complete


def _make(tmp: Path, **config):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    random.seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sampler = ResumableSampler(40, 4, seed=3)
    data = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
    cfg = {"checkpoint_uri": f"file://{tmp}", "checkpoint_every": 2, "use_async": True, **config}
    run = Run.from_env(model=model, optimizer=opt, scheduler=sched, sampler=sampler, env={}, **cfg)
    return run, model, opt, sampler, data


def _train(run, model, opt, sampler, data, max_steps, *, on_step=None):  # type: ignore[no-untyped-def]
    draws = []
    for step in run.steps(max_steps):
        x = data[sampler.indices()]
        loss = model(x).pow(2).mean()
        if on_step:
            loss = on_step(step, loss)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run.report(loss=loss, grad_norm=gn)
        opt.step()
        opt.zero_grad()
        draws.append(random.random())  # Python's generator is part of the state too
    return draws


def _weights(model) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    return [p.detach().clone() for p in model.parameters()]


def test_sigterm_saves_exits_75_and_the_resume_is_exact(tmp_path):
    run, model, opt, sampler, data = _make(tmp_path / "base")
    base_draws = _train(run, model, opt, sampler, data, 9)
    run.finish()
    base = _weights(model)

    def term_at_5(step, loss):  # type: ignore[no-untyped-def]
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag
        return loss

    run, model, opt, sampler, data = _make(tmp_path / "cut")
    with pytest.raises(RunExit) as info:
        _train(run, model, opt, sampler, data, 9, on_step=term_at_5)
    assert info.value.code == ExitCode.PREEMPTED_SAVED
    found = find_latest_complete(tmp_path / "cut")
    assert found is not None and found.manifest.step == 6  # the step after the signal

    run, model, opt, sampler, data = _make(tmp_path / "cut")
    assert run.restore() == 6 and sampler.consumed == 6 * 4
    draws = _train(run, model, opt, sampler, data, 9)
    run.finish()
    assert draws == base_draws[6:]
    for a, b in zip(base, _weights(model), strict=True):
        assert torch.equal(a, b)


def test_a_rank_that_saved_on_sigterm_still_exits_75_through_a_second_sigterm(tmp_path):
    """torchrun forwards the agent's SIGTERM, so a rank may get a second one while it
    exits after its save: a default handler put back by then would end it at -15, a
    death the agent cannot tell from a rank killed before it saved. A real process,
    told over stdin when each signal has been sent (no sleeps)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("exit_worker.py")), str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "training\n"
        proc.send_signal(signal.SIGTERM)
        proc.stdin.write("go on\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "exiting\n"  # RunExit raised, the save done
        proc.send_signal(signal.SIGTERM)  # the second one, forwarded
        proc.stdin.write("exit now\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == ExitCode.PREEMPTED_SAVED
    finally:
        proc.kill()
        proc.wait()
    found = find_latest_complete(tmp_path)
    assert found is not None and found.manifest.step == 2  # the step after the signal


def test_damaged_newest_falls_back_and_an_explicit_damaged_path_exits_78(tmp_path, capfd):
    run, model, opt, sampler, data = _make(tmp_path)
    _train(run, model, opt, sampler, data, 7)
    run.finish()
    shard = next((tmp_path / "step_6").glob("*.distcp"))
    shard.write_bytes(b"x" + shard.read_bytes()[1:])  # same size, different bytes

    run, *_ = _make(tmp_path)
    assert run.restore() == 4
    assert "step 6 rejected" in capfd.readouterr().err

    run, *_ = _make(tmp_path, resume_from=str(tmp_path / "step_6"))
    with pytest.raises(RunExit) as info:
        run.restore()
    assert info.value.code == ExitCode.CHECKPOINT_INVALID
    assert f"{shard}: checksum mismatch" in info.value.reason

    (tmp_path / "step_4" / COMMIT_NAME).unlink()
    run, *_ = _make(tmp_path, resume_from=f"file://{tmp_path / 'step_4'}")
    with pytest.raises(RunExit, match="CHECKPOINT_INVALID") as info:
        run.restore()
    assert "COMMIT: missing" in info.value.reason


def test_a_step_other_than_the_staged_one_exits_77(tmp_path):
    run, model, opt, sampler, data = _make(tmp_path)
    _train(run, model, opt, sampler, data, 5)
    run.finish()
    run, *_ = _make(tmp_path, expected_step=2)
    with pytest.raises(RunExit) as info:
        run.restore()
    assert info.value.code == ExitCode.RESUME_MISMATCH
    assert "loaded step 4, but the orchestrator staged step 2" in info.value.reason


def test_nan_exits_76_before_the_optimizer_touches_the_weights(tmp_path):
    run, model, opt, sampler, data = _make(tmp_path, checkpoint_uri="")
    before: list[torch.Tensor] = []

    def nan_at_3(step, loss):  # type: ignore[no-untyped-def]
        if step == 3:
            before.extend(_weights(model))
            return loss * float("nan")
        return loss

    with pytest.raises(RunExit) as info:
        _train(run, model, opt, sampler, data, 9, on_step=nan_at_3)
    assert info.value.code == ExitCode.NAN_DETECTED
    for a, b in zip(before, _weights(model), strict=True):
        assert torch.equal(a, b)


def test_control_file_changes_the_checkpoint_interval_while_running(tmp_path):
    control = tmp_path / "control.json"
    control.write_text('{"checkpoint_every": 3}')
    run, model, opt, sampler, data = _make(
        tmp_path / "ck", checkpoint_every=100, control_file=str(control), control_every=1
    )

    def rewrite_at_4(step, loss):  # type: ignore[no-untyped-def]
        if step == 4:
            control.write_text('{"checkpoint_every": 5}')
            os.utime(control, ns=(1, 10**18))  # a distinct mtime even on coarse clocks
        return loss

    _train(run, model, opt, sampler, data, 12, on_step=rewrite_at_4)
    run.finish()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_10", "step_3"]


def test_config_from_env_reads_the_contract_and_names_bad_values():
    env = {
        Env.CHECKPOINT_URI: "s3://bucket/run",
        Env.LOCAL_CHECKPOINT_DIR: "/disk",
        Env.RESUME_FROM: "none",
        Env.EXPECTED_STEP: "40",
        Env.CHECKPOINT_EVERY: "25",
        Env.GLOBAL_BATCH: "64",
        Env.MICRO_BATCH: "4",
        Env.PROGRESS_ADDR: "127.0.0.1:9",
        Env.CONTROL_FILE: "/disk/control.json",
        Env.CHECKPOINT_KEEP: "5",
    }
    assert RunConfig.from_env(env).keep == 5
    cfg = RunConfig.from_env(env, keep=4)
    assert (cfg.checkpoint_uri, cfg.local_dir, cfg.resume_from) == (
        "s3://bucket/run",
        "/disk",
        "none",
    )
    assert (cfg.expected_step, cfg.checkpoint_every, cfg.global_batch, cfg.micro_batch) == (
        40,
        25,
        64,
        4,
    )
    assert (cfg.control_file, cfg.keep) == ("/disk/control.json", 4)
    with pytest.raises(ValueError, match=f"{Env.CHECKPOINT_EVERY}='often': not an integer"):
        RunConfig.from_env({Env.CHECKPOINT_EVERY: "often"})
    with pytest.raises(ValueError, match="keep must be >= 2"):
        RunConfig(keep=1)
    with pytest.raises(ValueError, match="use file:///abs/path, s3:// or gs://"):
        RunConfig(checkpoint_uri="ftp://x/y")


def test_rollback_skip_moves_the_data_past_the_window_and_keeps_every_step_an_update(tmp_path):
    """SKYRESUME_RUN_SKIP_STEPS=3-5: at step 3 the sampler jumps 3 global batches; the
    step counter goes on 3, 4, ... (each still one optimizer update)."""
    run, model, opt, sampler, data = _make(tmp_path, skip_steps=(3, 5), checkpoint_every=0)
    seen = []
    for step in run.steps(6):
        seen.append((step, sampler.consumed))
        loss = model(data[sampler.indices()]).pow(2).mean()
        loss.backward()
        run.report(loss=loss, grad_norm=torch.tensor(0.1))
        opt.step()
        opt.zero_grad()
    run.finish()
    gb = sampler.global_batch
    assert [s for s, _ in seen] == [0, 1, 2, 3, 4, 5]
    assert [c // gb for _, c in seen] == [0, 1, 2, 6, 7, 8]  # batches 3, 4, 5 skipped


def test_a_bad_skip_window_is_refused_naming_the_variable():
    from training.run import _env_range

    assert _env_range({Env.SKIP_STEPS: "41-52"}, Env.SKIP_STEPS) == (41, 52)
    for bad in ("52-41", "x-3", "7"):
        with pytest.raises(ValueError, match=Env.SKIP_STEPS):
            _env_range({Env.SKIP_STEPS: bad}, Env.SKIP_STEPS)
