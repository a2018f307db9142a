"""Faults a rank injects into itself (``inject_fault`` in the control file): each one
does what it says on a real rank, and fails with the text the classifier reads.

The facade tests run ``Run`` in this process; the fatal faults run the reference
script as a process of its own (its stderr is the rank's log), and the per-rank
spike runs under torchrun."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from datagrams import Listener
from testkit import torchrun

from orchestrator.contract import Env, ExitCode, FaultKind
from orchestrator.domain.failures import FailureClass, classify_failure, exception_signature
from training import ResumableSampler, Run, RunExit, chaos
from training.control import ControlFile
from training.examples import train_gpt

ROOT = Path(__file__).resolve().parents[2]


def fault(kind: str, token: str = "1", rank: int | None = None) -> str:
    return json.dumps({"inject_fault": {"kind": kind, "token": token, "rank": rank}})


def write(path: Path, text: str) -> None:
    path.write_text(text)
    os.utime(path, ns=(1, time.time_ns()))  # a distinct mtime even on coarse clocks


def _make(control: Path):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sampler = ResumableSampler(64, 8, seed=3)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    run = Run.from_env(
        model=model, optimizer=opt, sampler=sampler, env={},
        control_file=str(control), control_every=1,
    )  # fmt: skip
    return run, model, opt, sampler, data


def _train(run, model, opt, sampler, data, steps, *, on_step=None, forward=True):  # type: ignore[no-untyped-def]
    grad_norms = []
    for step in run.steps(steps):
        if on_step:
            on_step(step)
        loss = model(data[sampler.indices()]).pow(2).mean() + 1.0
        if forward:
            loss = run.perturb_loss(loss)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        run.report(loss=loss, grad_norm=grad_norms[-1])
        opt.step()
        opt.zero_grad()
    run.finish()
    return grad_norms


# --- in this process: the facade -----------------------------------------------------------


def test_a_fault_is_taken_once_per_token_and_only_by_the_rank_it_names(tmp_path):
    control = tmp_path / "control.json"
    run, *rest = _make(control)
    plan = {5: fault("spike", "1", rank=3), 10: fault("spike", "2"), 40: fault("spike", "3", 0)}

    def on_step(step):  # type: ignore[no-untyped-def]
        if step in plan:
            write(control, plan[step])
        if step == 20:  # the same token again (the agent rewrote the file for an interval)
            write(control, json.dumps({"checkpoint_every": 7, **json.loads(plan[10])}))

    _train(run, *rest, 60, on_step=on_step)
    # Written during step N, read at the boundary before N + 1; rank 3 is not this one.
    assert run.injected == [(11, FaultKind.SPIKE), (41, FaultKind.SPIKE)]


def test_a_bad_fault_request_is_refused_with_a_warning_and_training_goes_on(tmp_path, capfd):
    control = tmp_path / "control.json"
    write(control, json.dumps({"inject_fault": {"kind": "meteor", "token": "1", "rank": None}}))
    c = ControlFile(str(control))
    c.poll()
    assert c.fault is None
    assert "inject_fault.kind must be one of" in capfd.readouterr().err


def test_chaos_nan_exits_76_before_the_update_once_per_token(tmp_path):
    control = tmp_path / "control.json"
    run, model, *rest = _make(control)
    before: list[torch.Tensor] = []

    def on_step(step):  # type: ignore[no-untyped-def]
        if step == 30:
            write(control, fault("nan"))
        if step == 31:
            before.extend(p.detach().clone() for p in model.parameters())

    with pytest.raises(RunExit) as info:
        _train(run, model, *rest, 60, on_step=on_step)
    assert info.value.code == ExitCode.NAN_DETECTED
    assert run.injected == [(31, FaultKind.NAN)] and run.step == 31
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("forward", [True, False], ids=["through-the-forward", "reported-only"])
def test_chaos_spike_is_found_at_its_onset_and_training_goes_on(tmp_path, forward):
    control = tmp_path / "control.json"
    run, *rest = _make(control)

    def on_step(step):  # type: ignore[no-untyped-def]
        if step == 40:
            write(control, fault("spike"))

    grad_norms = _train(run, *rest, 80, on_step=on_step, forward=forward)
    assert run.step == 80  # the rank reports; the service decides what to do
    assert run.injected == [(41, FaultKind.SPIKE)]
    assert [(f.kind, f.step) for f in run.findings] == [("loss_spike", 41)]
    assert "grad norm" in run.findings[0].evidence
    # perturb_loss scales what is backpropagated; without it only the report spikes.
    spiked = grad_norms[41] / statistics.median(grad_norms[20:41])
    if forward:
        assert chaos.SPIKE_FACTOR / 2 < spiked < chaos.SPIKE_FACTOR * 2
    else:
        assert spiked < 2


def test_oom_above_the_micro_batch_goes_away_when_replanned_and_recurs_at_the_smallest(
    monkeypatch,
):
    """The reference script refuses a micro-batch above N like a card too small would;
    the planner's smaller micro-batch (Env.MICRO_BATCH) runs, the smallest fails too."""
    monkeypatch.setenv(train_gpt.OOM_ABOVE_MICRO_BATCH, "2")
    for var in (Env.PROGRESS_ADDR, Env.CONTROL_FILE, Env.CHECKPOINT_URI):
        monkeypatch.delenv(var, raising=False)
    args = ["--max-steps", "3", "--checkpoint-uri", "", "--global-batch", "8"]
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB"):
        train_gpt.main(args)  # micro-batch 8 (the whole per-rank batch)
    monkeypatch.setenv(Env.MICRO_BATCH, "2")
    assert train_gpt.main(args) == 0  # micro-batch 2 x 4 accumulation: same global batch
    monkeypatch.setenv(train_gpt.OOM_ABOVE_MICRO_BATCH, "0")
    monkeypatch.setenv(Env.MICRO_BATCH, "1")
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        train_gpt.main(args)


# --- a rank of its own: the fatal faults and the log they leave ------------------------------


def rank_process(tmp_path: Path, *args: str, control: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for var in (Env.PROGRESS_ADDR, Env.CHECKPOINT_URI, Env.MICRO_BATCH):
        env.pop(var, None)
    if control is not None:
        path = tmp_path / "control.json"
        path.write_text(control)
        env[Env.CONTROL_FILE] = str(path)
    cmd = [sys.executable, "-m", "training.examples.train_gpt", "--straggler-every", "0", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "exception", "failure_class"),
    [
        ("oom", "torch.OutOfMemoryError: CUDA out of memory.", FailureClass.CUDA_OOM),
        ("xid", "torch.AcceleratorError: CUDA error: unspecified launch failure",
         FailureClass.GPU_HARDWARE),
        ("transport", "torch.distributed.DistBackendError: NCCL error in:",
         FailureClass.NCCL_TRANSPORT),
        ("user_error", "KeyError: 'input_ids'", FailureClass.USER_CODE_ERROR),
    ],
    ids=["oom", "xid", "transport", "user_error"],
)  # fmt: skip
def test_a_fatal_fault_kills_the_rank_with_a_traceback_the_classifier_reads(
    tmp_path, kind, exception, failure_class
):
    proc = rank_process(tmp_path, "--max-steps", "5", "--checkpoint-uri", "", control=fault(kind))
    _out, err_b = proc.communicate(timeout=120)
    err = err_b.decode()
    assert proc.returncode == 1, err[-2000:]  # uncaught: Python's own exit, no contract code
    assert "Traceback (most recent call last)" in err and exception in err, err[-2000:]
    assert f"chaos: {kind} at step 0" in err
    assert classify_failure(proc.returncode, None, err).failure_class is failure_class
    if kind == "xid":
        assert f"NVRM: Xid (PCI:0000:3b:00): 79, pid={proc.pid}, name=python" in err
    if kind == "user_error":
        assert exception_signature(err) == "KeyError: 'input_ids'"


@pytest.mark.slow
def test_a_user_error_recurs_after_a_resume_from_an_older_checkpoint(tmp_path):
    """The script's own bug at step 12: a relaunch from step 5 meets it again, with the
    same exception signature (what the service's fail-fast compares)."""
    ckpt = f"file://{tmp_path / 'ckpt'}"
    common = ["--max-steps", "20", "--checkpoint-uri", ckpt, "--checkpoint-every", "5",
              "--sync-save", "--raise-keyerror-at-step", "12"]  # fmt: skip
    first = rank_process(tmp_path, *common)
    err1 = first.communicate(timeout=120)[1].decode()
    assert first.returncode == 1 and (tmp_path / "ckpt" / "step_10").is_dir(), err1[-2000:]
    again = rank_process(tmp_path, *common, "--resume-from", str(tmp_path / "ckpt" / "step_5"))
    err2 = again.communicate(timeout=120)[1].decode()
    assert again.returncode == 1, err2[-2000:]
    sig1, sig2 = exception_signature(err1), exception_signature(err2)
    assert sig1 == sig2 == "KeyError: 'input_ids'"
    assert 'train_gpt.py", line' in err2.split("Traceback")[-1]  # raised in the script's frame


# --- under torchrun: a spike on one rank of two ------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
def test_a_spike_on_one_rank_is_reported_by_that_rank_and_both_keep_training(tmp_path, monkeypatch):
    agent = Listener()
    control = tmp_path / "control.json"
    control.write_text("{}")
    monkeypatch.setenv(Env.PROGRESS_ADDR, agent.addr)
    monkeypatch.setenv(Env.CONTROL_FILE, str(control))
    monkeypatch.delenv(Env.CHECKPOINT_URI, raising=False)
    proc = torchrun("-m", "training.examples.train_gpt", "--max-steps", "90",
                    "--checkpoint-uri", "", "--straggler-every", "0")  # fmt: skip
    deadline = time.monotonic() + 240
    while not any(d["type"] == "progress" and d["step"] >= 30 for d in agent.got):
        assert proc.poll() is None and time.monotonic() < deadline, "never reached step 30"
        time.sleep(0.05)
    write(control, fault("spike", rank=1))
    out = proc.communicate(timeout=240)[0].decode()
    agent.close()
    assert proc.returncode == 0, out[-3000:]
    injected = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines()
                if "rank 1: chaos: spike at step" in line]  # fmt: skip
    assert len(injected) == 1 and "rank 0: chaos" not in out, out[-3000:]
    spikes = agent.of("anomaly")
    assert [(a["rank"], a["kind"], a["onset_step"]) for a in spikes] == [(1, "spike", injected[0])]
    assert {e["rank"]: e["code"] for e in agent.of("exit")} == {0: 0, 1: 0}
