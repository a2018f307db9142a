"""Elastic world sizes (training.elastic): a run that shrinks from 3 ranks to 2 and
grows back sees every sample as often as an uninterrupted run; with ``keep`` every
step has the full global batch, with ``scale`` a step takes its world's share and
the learning rate and the scheduler follow. The sampler and the math in one
process, Run at world 1 against a larger full world, then real 3 -> 2 -> 3 gloo runs
of the reference script."""

from __future__ import annotations

import json
import math
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit import torchrun

from orchestrator.contract import Env
from training import ResumableSampler, Run, RunConfig
from training.elastic import ElasticBatch, ElasticLR, plan_elastic

# --- the sampler, without processes ---------------------------------------------------

#: step -> that step's global batch (every rank's slice, in rank order), as the last
#: launch that ran the step trained it.
StepLog = dict[int, list[int]]


def _launch(
    log: StepLog,
    *,
    world: int,
    batch: int,
    state: tuple[int, dict[str, Any]] | None,
    steps: int,
    lost: int = 0,
    scales: bool = False,
    num_samples: int = 30,
) -> tuple[int, dict[str, Any]]:
    """``world`` ranks resume from ``state`` (step, sampler state), train ``steps``
    steps and save, then ``lost`` more that die with them (the next launch redoes
    them). Returns the saved (step, state)."""
    ranks = [
        ResumableSampler(num_samples, batch, seed=5, rank=r, world_size=world) for r in range(world)
    ]
    start = 0
    if state is not None:
        start, saved = state
        for s in ranks:
            s.load_state_dict(saved, batch_may_change=scales)
    checkpoint = None
    for i in range(steps + lost):
        log[start + i] = [idx for s in ranks for idx in s.indices()]
        for s in ranks:
            s.advance()
        if i + 1 == steps:
            checkpoint = (start + steps, ranks[0].state_dict())
    assert checkpoint is not None
    return checkpoint


def _uninterrupted(steps: int, *, batch: int = 12, world: int = 3) -> StepLog:
    log: StepLog = {}
    _launch(log, world=world, batch=batch, state=None, steps=steps)
    return log


def _flat(log: StepLog) -> list[int]:
    return [i for step in sorted(log) for i in log[step]]


def test_keep_on_three_then_two_then_three_ranks_gives_every_step_the_uninterrupted_batch():
    log: StepLog = {}
    saved = _launch(log, world=3, batch=12, state=None, steps=3, lost=2)
    saved = _launch(log, world=2, batch=12, state=saved, steps=4, lost=1)
    _launch(log, world=3, batch=12, state=saved, steps=3)
    base = _uninterrupted(10)
    assert sorted(log) == list(range(10))
    for step in range(10):  # the same samples in the same order, whatever the world
        assert log[step] == base[step], step
    assert Counter(_flat(log)) == Counter(_flat(base))


def test_scale_on_three_then_two_then_three_ranks_sees_the_uninterrupted_samples():
    # Full world 3, global batch 12: world 2 takes 8 a step. 30 samples an epoch, so
    # epochs end inside steps and step boundaries move against them.
    log: StepLog = {}
    saved = _launch(log, world=3, batch=12, state=None, steps=3, lost=2, scales=True)
    saved = _launch(log, world=2, batch=8, state=saved, steps=5, lost=1, scales=True)
    _launch(log, world=3, batch=12, state=saved, steps=3, scales=True)
    assert [len(log[s]) for s in sorted(log)] == [12] * 3 + [8] * 5 + [12] * 3
    total = len(_flat(log))
    assert total == 3 * 12 + 5 * 8 + 3 * 12
    base = _flat(_uninterrupted(10))[:total]
    assert Counter(_flat(log)) == Counter(base)
    assert _flat(log) == base  # even in the uninterrupted order: the position is in samples


def test_a_saved_sampler_with_another_global_batch_is_refused_unless_the_batch_scales():
    s = ResumableSampler(30, 12, seed=5, rank=0, world_size=3)
    s.advance()
    state = s.state_dict()
    smaller = ResumableSampler(30, 8, seed=5, rank=1, world_size=2)
    with pytest.raises(ValueError, match="global_batch was 12 when saved, now 8"):
        smaller.load_state_dict(state)
    assert smaller.consumed == 0
    smaller.load_state_dict(state, batch_may_change=True)
    assert smaller.consumed == 12
    other = {**state, "seed": 6}  # only the batch may change: the rest still names the data
    with pytest.raises(ValueError, match="seed was 6 when saved, now 5"):
        smaller.load_state_dict(other, batch_may_change=True)


# --- the math (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "lr", "world", "want_batch", "want_factor"),
    [
        (ElasticBatch.KEEP, ElasticLR.LINEAR, 2, 12, 1.0),
        (ElasticBatch.KEEP, ElasticLR.SQRT, 3, 12, 1.0),
        (ElasticBatch.SCALE, ElasticLR.LINEAR, 2, 8, 2 / 3),
        (ElasticBatch.SCALE, ElasticLR.SQRT, 2, 8, math.sqrt(2 / 3)),
        (ElasticBatch.SCALE, ElasticLR.LINEAR, 3, 12, 1.0),
        (ElasticBatch.SCALE, ElasticLR.SQRT, 1, 4, math.sqrt(1 / 3)),
    ],
    ids=["keep-2", "keep-full", "scale-linear-2", "scale-sqrt-2", "scale-full", "scale-sqrt-1"],
)
def test_a_world_trains_on_its_batch_with_its_lr_factor(batch, lr, world, want_batch, want_factor):
    plan = plan_elastic(12, world, 3, batch, lr)
    assert plan.global_batch == want_batch and plan.full_global_batch == 12
    assert plan.lr_factor == pytest.approx(want_factor, rel=1e-15)
    assert plan.batch_follows_world is (batch is ElasticBatch.SCALE)


@pytest.mark.parametrize(
    ("global_batch", "world", "full", "batch", "message"),
    [
        (12, 5, 6, ElasticBatch.KEEP, "global batch 12 is not divisible by the world size 5"),
        (10, 2, 4, ElasticBatch.SCALE, "global batch 10 is not divisible by the full world size 4"),
        (None, 2, 3, ElasticBatch.SCALE, "needs the full world's global batch"),
    ],
    ids=["keep-indivisible", "scale-indivisible", "scale-without-batch"],
)
def test_a_batch_that_does_not_split_evenly_is_refused_with_its_numbers(
    global_batch, world, full, batch, message
):
    with pytest.raises(ValueError, match=message):
        plan_elastic(global_batch, world, full, batch)


def test_the_elastic_variables_are_read_and_a_bad_value_names_its_variable():
    env = {Env.FULL_WORLD_SIZE: "4", Env.ELASTIC_BATCH: "scale", Env.ELASTIC_LR: "sqrt"}
    cfg = RunConfig.from_env(env, global_batch=16)
    assert (cfg.full_world_size, cfg.elastic_batch, cfg.elastic_lr) == (4, "scale", "sqrt")
    assert cfg.global_batch_for(2) == 8 and cfg.global_batch_for(4) == 16
    plain = RunConfig.from_env({}, global_batch=16)
    assert (plain.full_world_size, plain.elastic_batch) == (None, ElasticBatch.KEEP)
    assert plain.global_batch_for(2) == 16
    with pytest.raises(ValueError, match="SKYRESUME_RUN_ELASTIC_BATCH='grow'"):
        RunConfig.from_env({Env.ELASTIC_BATCH: "grow"})
    with pytest.raises(ValueError, match="SKYRESUME_RUN_ELASTIC_LR='cubic'"):
        RunConfig.from_env({Env.ELASTIC_LR: "cubic"})
    with pytest.raises(ValueError, match="ElasticBatch 'grow'"):
        RunConfig(elastic_batch="grow")  # type: ignore[arg-type]


# --- Run in one process: world 1 of a larger full world --------------------------------

BASE_LR = 0.1


def _warmup(position: int) -> float:
    return min(1.0, (position + 1) / 10)  # train_gpt.py's LambdaLR


def _elastic_env(full: int, batch: str = "scale", lr: str = "linear") -> dict[str, str]:
    return {
        Env.FULL_WORLD_SIZE: str(full),
        Env.ELASTIC_BATCH: batch,
        Env.ELASTIC_LR: lr,
        Env.GLOBAL_BATCH: "12",
    }


def _make(tmp: Path, env: dict[str, str], *, step_lr: bool = False, sampler_batch: int = 12):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    sched: Any = (
        torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        if step_lr
        else torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    )
    sampler = ResumableSampler(30, sampler_batch, seed=5)
    run = Run.from_env(
        model=model,
        optimizer=opt,
        scheduler=sched,
        sampler=sampler,
        env=env,
        checkpoint_uri=f"file://{tmp}",
        checkpoint_every=4,
        use_async=False,
    )
    applied: list[float] = []

    def record(o: torch.optim.Optimizer, _a: Any, _k: Any) -> None:
        # Registered after Run's own hook: it sees the lr the update is made with. Not
        # lr 0: DCP's get_state_dict steps a stateless SGD once with lr 0 at each save.
        if o.param_groups[0]["lr"] != 0:
            applied.append(o.param_groups[0]["lr"])

    opt.register_step_pre_hook(record)
    return run, model, opt, sched, sampler, applied


def _train(run, model, opt, sched, sampler, max_steps: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Train to ``max_steps``; returns the samples trained on before each step."""
    before = []
    for _ in run.steps(max_steps):
        before.append(run.samples)
        x = torch.ones(len(sampler.indices()), 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        run.report(loss=loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    return before


def test_keep_on_a_shrunk_world_accumulates_more_whatever_the_env_grad_accum_says():
    model = torch.nn.Linear(4, 1)
    env = {
        **_elastic_env(4, batch="keep"),
        Env.GLOBAL_BATCH: "8",
        Env.MICRO_BATCH: "2",
        Env.GRAD_ACCUM: "1",  # the service's, for 4 ranks of 2: wrong for 1 rank
    }
    run = Run.from_env(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), env=env)
    assert run.batch_plan is not None
    assert (run.batch_plan.micro_batch, run.batch_plan.grad_accum) == (2, 4)
    assert (run.global_batch, run.lr_factor) == (8, 1.0)
    run.finish()


@pytest.mark.parametrize(
    ("lr", "factor"), [("linear", 1 / 3), ("sqrt", math.sqrt(1 / 3))], ids=["linear", "sqrt"]
)
def test_scale_applies_the_lr_factor_inside_the_step_and_the_schedule_counts_samples(
    tmp_path, lr, factor
):
    run, model, opt, sched, sampler, applied = _make(tmp_path, _elastic_env(3, lr=lr))
    assert (run.global_batch, sampler.global_batch) == (4, 4)  # rebatched: 12 x 1/3
    before = _train(run, model, opt, sched, sampler, 7)
    run.finish()
    assert before == [0, 4, 8, 12, 16, 20, 24]
    # One schedule position per full global batch (12 samples), not per step.
    want = [BASE_LR * _warmup(s // 12) * factor for s in before]
    assert applied == pytest.approx(want, rel=1e-12)
    assert sched.last_epoch == 28 // 12
    # The param groups hold the full world's lr: the factor is never written into them.
    assert opt.param_groups[0]["lr"] == pytest.approx(BASE_LR * _warmup(28 // 12), rel=1e-12)


def test_scale_keeps_a_chainable_scheduler_exact_too(tmp_path):
    run, model, opt, sched, sampler, applied = _make(tmp_path, _elastic_env(3), step_lr=True)
    before = _train(run, model, opt, sched, sampler, 9)
    run.finish()
    # StepLR multiplies the current lr by gamma every 2 positions: replaying its own
    # step() once per full batch keeps that, and the factor never compounds into it.
    want = [BASE_LR * 0.5 ** ((s // 12) // 2) / 3 for s in before]
    assert applied == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    ("first_full", "then_full"), [(3, 1), (1, 3)], ids=["shrunk-to-full", "full-to-shrunk"]
)
def test_scale_resumed_on_another_world_applies_its_own_lr_factor_once(
    tmp_path, first_full, then_full
):
    # World 1 of a full world of 3 is the shrunk world (batch 4, lr x 1/3); of 1, the
    # full one (batch 12). The checkpoint at step 4 is resumed on the other.
    run, model, opt, sched, sampler, _ = _make(tmp_path, _elastic_env(first_full))
    first = _train(run, model, opt, sched, sampler, 5)
    run.finish()
    saved_samples = first[4]
    run, model, opt, sched, sampler, applied = _make(tmp_path, _elastic_env(then_full))
    assert run.restore() == 4
    assert run.samples == sampler.consumed == saved_samples
    position = saved_samples // 12
    assert sched.last_epoch == position
    assert opt.param_groups[0]["lr"] == pytest.approx(BASE_LR * _warmup(position), rel=1e-12)
    before = _train(run, model, opt, sched, sampler, 8)
    run.finish()
    factor = 1 / then_full if then_full == 3 else 1.0
    want = [BASE_LR * _warmup(s // 12) * factor for s in before]
    assert applied == pytest.approx(want, rel=1e-12)
    assert before[0] == saved_samples


def test_a_checkpoint_without_the_samples_counter_resumes_at_step_times_batch(tmp_path):
    run, _model, _opt, _sched, sampler, _ = _make(tmp_path, {})
    run.step, sampler.consumed = 4, 48
    state = run.state_dict()
    del state["samples"]  # as a checkpoint from before the counter
    assert run.checkpointer is not None
    run.checkpointer.save(state, 4)
    run.finish()
    run, *_ = _make(tmp_path, {})
    assert run.restore() == 4 and run.samples == 48
    run.finish()


def test_scale_refuses_what_cannot_follow_a_shrink_at_the_first_launch():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    full = _elastic_env(1)  # the full world itself: refused now, not at the first shrink
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        Run.from_env(model=model, optimizer=opt, scheduler=plateau, env=full)

    class Bare:
        param_groups: list[dict[str, Any]] = []

    with pytest.raises(ValueError, match="no register_step_pre_hook"):
        Run.from_env(model=model, optimizer=Bare(), env=full)
    with pytest.raises(ValueError, match=r"neither this world's 4 .* nor the full world's 12"):
        Run.from_env(
            model=model, optimizer=opt, sampler=ResumableSampler(30, 6, seed=1), env=_elastic_env(3)
        )


def test_framework_integrations_refuse_elastic_batch_scale():
    from training.integrations.session import FrameworkRun

    with pytest.raises(ValueError, match="elastic batch scale is not supported with hf"):
        FrameworkRun("hf", env=_elastic_env(3))


# --- real processes: the reference script on 3, 2, 3 gloo ranks ------------------------

STEPS = 12
TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq", "8", "--vocab", "32"]


def _gpt(tmp: Path, name: str, nproc: int, max_steps: int, *, final: bool = False) -> None:
    args = [
        "-m", "training.examples.train_gpt",
        "--max-steps", str(max_steps),
        "--checkpoint-uri", f"file://{tmp / name}",
        "--checkpoint-every", "4",
        "--global-batch", "12",
        "--micro-batch", "2",  # the planner's for 3 ranks: 2 x 2 there, 2 x 3 on 2 ranks
        "--dataset-size", "64",
        "--straggler-every", "0",
        "--sample-log", str(tmp / f"{name}.{{rank}}.jsonl"),
        *TINY,
    ]  # fmt: skip
    if final:
        args += ["--save-final", str(tmp / f"{name}.pt")]
    proc = torchrun(*args, nproc=nproc)
    try:
        out = proc.communicate(timeout=120)[0].decode()
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, out[-3000:]


def _read_log(tmp: Path, name: str) -> dict[int, list[dict[str, Any]]]:
    """step -> the lines of the latest launch that ran it, in rank order."""
    lines = [json.loads(x) for f in tmp.glob(f"{name}.*.jsonl") for x in f.read_text().splitlines()]
    latest: dict[int, int] = {}
    for r in lines:
        latest[r["step"]] = max(latest.get(r["step"], 0), r["launch"])
    kept: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(lines, key=lambda r: r["rank"]):
        if r["launch"] == latest[r["step"]]:
            kept.setdefault(r["step"], []).append(r)
    return kept


def _global(step_lines: list[dict[str, Any]]) -> list[int]:
    return [i for r in step_lines for i in r["indices"]]


def _three_two_three(tmp: Path, name: str, monkeypatch, batch: str) -> None:  # type: ignore[no-untyped-def]
    """Steps 0-4 on 3 ranks (saved at 4, step 4 lost), 4-8 on 2 (saved at 8), 8-11 on 3."""
    monkeypatch.setenv(Env.FULL_WORLD_SIZE, "3")
    monkeypatch.setenv(Env.ELASTIC_BATCH, batch)
    monkeypatch.setenv(Env.GRAD_ACCUM, "2")  # the service's for 3 ranks; 2 ranks need 3
    _gpt(tmp, name, 3, 5)
    _gpt(tmp, name, 2, 9)
    _gpt(tmp, name, 3, STEPS, final=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("elastic-base")
    _gpt(tmp, "base", 3, STEPS, final=True)
    return tmp


@pytest.mark.slow
@pytest.mark.e2e
def test_keep_on_three_two_three_ranks_sees_every_sample_once_and_ends_near_the_uninterrupted_run(
    tmp_path, uninterrupted, monkeypatch
):
    _three_two_three(tmp_path, "keep", monkeypatch, "keep")
    base, log = _read_log(uninterrupted, "base"), _read_log(tmp_path, "keep")
    assert sorted(log) == sorted(base) == list(range(STEPS))
    assert [len(log[s]) for s in range(STEPS)] == [3] * 4 + [2] * 4 + [3] * 4  # ranks
    for s in range(STEPS):
        assert {r["global_batch"] for r in log[s]} == {12}
        assert _global(log[s]) == _global(base[s]), s
        assert [r["lr"] for r in log[s]] == [base[s][0]["lr"]] * len(log[s])  # keep: no factor
    flat = [i for s in range(STEPS) for i in _global(log[s])]
    assert Counter(flat) == Counter(i for s in range(STEPS) for i in _global(base[s]))
    # Same samples and the same math per step; only the order of float sums differs
    # (DDP averages 2 ranks' gradients instead of 3, each accumulated over 3 micro-
    # batches instead of 2), float32 rounding that Adam's normalisation amplifies
    # while its second moments are small: 2e-5 relative here. 1e-4 leaves 5x of
    # margin; another data order (--dataset-size 65) ends 8e-3 away, 80x over it.
    a, b = torch.load(uninterrupted / "base.pt"), torch.load(tmp_path / "keep.pt")
    assert a["step"] == b["step"] == STEPS
    num = sum(((a["model"][k] - b["model"][k]) ** 2).sum() for k in a["model"])
    den = sum((a["model"][k] ** 2).sum() for k in a["model"])
    assert float((num / den) ** 0.5) < 1e-4


@pytest.mark.slow
@pytest.mark.e2e
def test_scale_on_three_two_three_ranks_sees_the_uninterrupted_samples_at_its_worlds_lr(
    tmp_path, uninterrupted, monkeypatch
):
    _three_two_three(tmp_path, "scale", monkeypatch, "scale")
    log = _read_log(tmp_path, "scale")
    assert sorted(log) == list(range(STEPS))
    batches = [log[s][0]["global_batch"] for s in range(STEPS)]
    assert batches == [12] * 4 + [8] * 4 + [12] * 4
    for s in range(STEPS):
        assert len(_global(log[s])) == batches[s]
    flat = [i for s in range(STEPS) for i in _global(log[s])]
    base = _read_log(uninterrupted, "base")
    base_flat = [i for s in range(STEPS) for i in _global(base[s])]
    assert Counter(flat) == Counter(base_flat[: len(flat)])  # 128 of the 144 samples
    # The lr of each step: train_gpt's warmup at position samples // 12, times 2/3 on
    # 2 ranks. Steps 8-11 ran on 3 ranks from a checkpoint saved on 2: x 1, not 2/3.
    samples = 0
    for s in range(STEPS):
        factor = 2 / 3 if batches[s] == 8 else 1.0
        want = 3e-3 * _warmup(samples // 12) * factor
        assert {round(r["lr"] / want, 9) for r in log[s]} == {1.0}, (s, log[s][0]["lr"], want)
        samples += batches[s]
    final = torch.load(tmp_path / "scale.pt")
    assert final["optim"]["param_groups"][0]["lr"] == pytest.approx(3e-3 * _warmup(128 // 12))
