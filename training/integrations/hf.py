"""Hugging Face Trainer under skyresume: ``train(trainer)`` in place of ``trainer.train()``.

    from training.integrations.hf import train
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    train(trainer)                     # was: trainer.train()

What ``train`` tells Trainer, and why:

* ``save_strategy="no"``, ``save_total_limit=None``: the callback decides when to
  save (the job's interval, which the service may move, and SIGTERM), and
  skyresume prunes committed saves; Trainer rotating ``checkpoint-*`` itself would
  delete a save the agent may be staging.
* the knobs: ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` from
  the memory planner's micro-batch with the global batch kept, and
  ``gradient_checkpointing`` when the planner turned activation checkpointing on.
* ``resume_from_checkpoint``: the committed ``step_<N>`` every rank agreed on (staged
  from the job's URI). Trainer loads it as its own: weights, optimizer, scheduler,
  every rank's RNG (``rng_state_<rank>.pth``) and, from ``trainer_state.json``, the
  global step, whose batches it skips with its own ``skip_first_batches``.

The callback, at each optimizer step (every rank, same order, as ``training.Run``):

* ``on_pre_optimizer_step``: the step's loss (summed over its micro-batches) and the
  grad norm Trainer computed are checked on every rank: NaN/Inf anywhere, and no rank
  applies the update: exit 76 with a ``nan`` anomaly naming the step;
* ``on_step_end``: progress datagram, loss-spike detector (a ``spike`` anomaly: the
  service's rollback), stragglers; then the stop agreement: a SIGTERM on any rank
  makes every rank save this step and stop (``train`` then exits 75), else a save
  when the interval says so;
* ``on_save``: Trainer's ``checkpoint-<N>`` becomes the committed ``step_<N>``.

A checkpoint is Trainer's own directory plus ``manifest.json`` and ``COMMIT``:
``Trainer.train(resume_from_checkpoint=".../step_40")`` and
``AutoModel.from_pretrained(".../step_40")`` open it as usual. A different world size
on resume is Trainer's business (it warns and reseeds nothing); the data order is
the sampler's, which Trainer seeds from ``args.seed``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.integrations.session import FrameworkRun, Resume

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "training.integrations.hf needs transformers: pip install 'skyresume[hf]'"
    ) from e


def _checkpoint_prefix() -> str:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return str(PREFIX_CHECKPOINT_DIR)


class SkyresumeCallback(TrainerCallback):
    """The per-step hooks (see the module). ``train`` installs it; used alone, a
    script must pass ``resume_from_checkpoint`` itself and set what ``train`` sets."""

    def __init__(self, session: FrameworkRun, resume: Resume | None) -> None:
        self.session = session
        self.resume = resume
        self.loss: Any = None
        """This step's loss so far (the sum of its micro-batches' losses, on this rank)."""
        self.grad_norm: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # Trainer has loaded the checkpoint (weights, optimizer, scheduler, state):
        # every rank checks what it loaded before the first step.
        if kw.get("optimizer") is not None:
            self.session.run.optimizer = kw["optimizer"]
        self.session.confirm_resumed(int(state.global_step), self.resume)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.loss = self.grad_norm = None
        self.session.run.begin_step()  # the step's timer; a chaos fault is taken here

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        loss = self.loss if self.loss is not None else float("nan")
        self.session.run.report(loss=loss, grad_norm=self.grad_norm)  # 76 before the update

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        session = self.session
        session.run.end_step()
        step = int(state.global_step)
        if session.run.step != step:  # pragma: no cover - a Trainer that skipped a hook
            raise RuntimeError(f"skyresume counted {session.run.step} steps, Trainer {step}")
        if session.run.should_stop():
            session.stopped = True
            control.should_training_stop = True
            control.should_save = session.root is not None and session.last_saved != step
        elif session.save_due(step, int(state.max_steps or 0)):
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        step = int(state.global_step)
        src = Path(args.output_dir) / f"{_checkpoint_prefix()}-{step}"
        self.session.commit(src, step)


def _instrument(trainer: Any, callback: SkyresumeCallback) -> None:
    """Hand the callback each micro-batch's loss and the step's grad norm. Trainer
    gives callbacks neither: ``training_step`` returns the loss, ``_get_grad_norm``
    the norm it logs (before clipping). Instance attributes: the class is untouched."""
    training_step = trainer.training_step

    def counted_training_step(*a: Any, **kw: Any) -> Any:
        loss = training_step(*a, **kw)
        d = loss.detach()
        callback.loss = d if callback.loss is None else callback.loss + d
        return loss

    trainer.training_step = counted_training_step
    get_grad_norm = getattr(trainer, "_get_grad_norm", None)
    if get_grad_norm is not None:

        def kept_grad_norm(*a: Any, **kw: Any) -> Any:
            norm = get_grad_norm(*a, **kw)
            callback.grad_norm = norm
            return norm

        trainer._get_grad_norm = kept_grad_norm


def apply_knobs(trainer: Any, session: FrameworkRun) -> None:
    """per_device_train_batch_size / gradient_accumulation_steps from the planner's
    micro-batch (global batch kept), gradient_checkpointing when it asks for it."""
    args = trainer.args
    plan = session.batch_plan(args.per_device_train_batch_size, args.gradient_accumulation_steps)
    if (plan.micro_batch, plan.grad_accum) != (
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
    ) and session.rank == 0:
        print(
            f"skyresume: per_device_train_batch_size {args.per_device_train_batch_size} -> "
            f"{plan.micro_batch}, gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} -> {plan.grad_accum} "
            f"(global batch {plan.per_rank_batch * session.world_size} kept)",
            flush=True,
        )
    args.per_device_train_batch_size = plan.micro_batch
    args.gradient_accumulation_steps = plan.grad_accum
    trainer._train_batch_size = args.train_batch_size  # what __init__ derived from the old one
    if session.activation_checkpointing:
        args.gradient_checkpointing = True


def _take_over_saving(trainer: Any) -> None:
    from transformers.trainer_utils import SaveStrategy

    args = trainer.args
    if args.save_only_model:
        raise ValueError(
            "save_only_model=True saves no optimizer, scheduler or RNG: the resume "
            "could not be exact; leave it False under skyresume"
        )
    if args.ignore_data_skip:
        raise ValueError(
            "ignore_data_skip=True replays the data of the resumed steps; leave it False"
        )
    args.save_strategy = SaveStrategy.NO
    args.save_total_limit = None


def _restore_cpu_rank_storages() -> None:
    """On CPU, a multi-process Trainer loads its optimizer file with ``map_location=
    args.device``, which is ``cpu:<local rank>``; ``torch.load`` restores only ``cpu``,
    so Trainer's own resume fails ("don't know how to restore data location of
    torch.storage.UntypedStorage (tagged with cpu:0)"). Found on 2 x 2 gloo ranks; GPU
    runs (``cuda:<n>``) never meet it. Such storages are in host memory already."""
    import torch.serialization as ser

    def tagger(obj: Any) -> str | None:
        return None  # saving is left to torch's own taggers

    def deserializer(obj: Any, location: str) -> Any:
        return obj if location.startswith("cpu:") else None

    if not getattr(ser, "_skyresume_cpu_ranks", False):
        ser.register_package(5, tagger, deserializer)
        ser._skyresume_cpu_ranks = True  # type: ignore[attr-defined]


def train(trainer: Any, **train_kwargs: Any) -> Any:
    """``trainer.train()`` under skyresume (see the module). Returns what it returns;
    a stop exits 75, a NaN 76, an unusable or disputed checkpoint 78/77 (RunExit,
    on every rank)."""
    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError("resume_from_checkpoint is skyresume's to choose (SKYRESUME_RUN_*)")
    session = FrameworkRun("hf", seed=int(trainer.args.seed))
    apply_knobs(trainer, session)
    _take_over_saving(trainer)
    resume = session.restore()
    if resume is not None and session.distributed:
        _restore_cpu_rank_storages()
    callback = SkyresumeCallback(session, resume)
    trainer.add_callback(callback)
    _instrument(trainer, callback)
    out = trainer.train(
        resume_from_checkpoint=str(resume.path) if resume is not None else None, **train_kwargs
    )
    if session.stopped:
        session.exit_stopped()
    session.finish()
    return out
