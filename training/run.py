"""``Run``: the whole library behind one object a training script adopts in a few lines.

    run = Run.from_env(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    run.restore()
    for step in run.steps(max_steps):
        ...forward, backward...
        run.report(loss=loss, grad_norm=grad_norm)  # before optimizer.step()
        opt.step(); sched.step(); opt.zero_grad()
    run.finish()

What happens where (every rank runs the same code and calls the same collectives
in the same order; that is what makes the agreements below safe):

* ``restore()``: one rank per node stages the newest complete remote checkpoint
  (s3://, gs:// URIs); every rank lists what it has; ranks agree on the newest
  checkpoint every one of them has (``resume.choose_checkpoint``), verify it,
  load it (DCP reshards onto any world size), then all-gather (step, manifest
  digest) once more and send the ``resumed`` datagram. Disagreement exits 77,
  an unusable checkpoint 78; nothing has been trained by then.
* each step boundary (``steps()``): one all-reduce carries the SIGTERM/SIGUSR1
  flag and each rank's reading of the agent's control file. A stop: every rank
  saves the same emergency checkpoint and exits 75.
* ``report()``: an all-reduce of "this rank saw NaN/Inf"; any rank: no rank
  applies the update, exit 76 (a ``nan`` anomaly naming the step).
* after each step: the ``progress`` datagram; the loss spike detector (a
  persistent spike is one ``spike`` anomaly naming its onset step); every
  ``straggler_every`` steps an all-gather of per-rank compute times; every
  ``reference_every`` steps, and before every save, the reference forward pass
  compared across replicas (exit 79 on a difference, so a corrupted replica is
  never checkpointed); then the periodic save (async by default).

Exits are ``RunExit`` (a ``SystemExit``) carrying the contract's code, raised on
every rank at the same point, after an ``exit`` datagram; uncaught, the process
exits with that code, which is what the agent reads. The flag-only SIGTERM handler
stays installed through that exit, so a second SIGTERM (torchrun forwards one) cannot
turn a saved rank's 75 into -15.

Chaos faults from the control file (``training.chaos``) are taken at the step
boundary after a poll; the ones that kill a rank raise there, uncaught.

Step numbers in anomalies are the index of the step whose loss was bad: the
number of updates applied to the weights that computed it, so ``step_<N>`` holds
those weights (the ``progress`` datagram of that step says N + 1, steps done).

Elastic world sizes (``training.elastic``): on an elastic run the agent sets
``FULL_WORLD_SIZE`` (the world the global batch and lr are for) and
``ELASTIC_BATCH``. With ``keep`` a smaller world trains on the same global batch
(``batch_plan`` is for the current world: more accumulation, whatever the env's
``GRAD_ACCUM`` says), so every step sees the samples of an uninterrupted run. With
``scale`` the world's batch is ``global_batch * world / full`` (a sampler built for
the full world is rebatched), a checkpoint's other batch is accepted, the lr is
multiplied by ``lr_factor`` inside ``optimizer.step()`` only (param groups,
scheduler and checkpoints keep the full world's lr, so nothing compounds across
resumes), and a torch ``LRScheduler`` is kept at position ``samples //
full_global_batch`` (``samples``: a counter in the checkpoint) instead of one per
step. What cannot follow (a non-torch optimizer, ReduceLROnPlateau) is refused at
construction, on the full world too.

Warm regroup (``groups()``, ``training.regroup``): a script trains inside

    for group in run.groups():
        with group:
            run.rewrap(DDP(model))      # what uses the process group, per group
            for step in run.steps(max_steps): ...

On a plain run that is one group and changes nothing. On an elastic run whose agent
writes memberships (``REGROUP_TIMEOUT_S`` set), a collective error that says a peer
is gone (gloo's text; nothing else: a user's bug, an OOM, a ``RunExit`` propagate),
or a newer membership generation every rank read at a step boundary (they save that
step first), ends the group and not the process: the rank destroys the process
group, sends a ``regroup`` datagram, waits for a newer ``Membership`` in the control
file (or exits ``REGROUP_FAILED`` for a cold restart), joins the new group over
``tcp://`` with its new rank and world and the same collective timeout, replans
everything above that depends on the world (batch plan, lr factor and schedule, the
sampler's slice, the Checkpointer and its group, the monitors), and yields the next
group, whose ``restore()`` loads the membership's checkpoint and sends ``resumed``
again. The model, optimizer and scheduler objects stay; the script builds only the
wrapper that holds the old group.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlparse

from orchestrator.contract import (
    MANIFEST_NAME,
    AnomalyKind,
    Env,
    ExitCode,
    FaultKind,
    Membership,
    RegroupReason,
    StrEnum,
    manifest_digest,
)
from training import chaos
from training.checkpoint import (
    Checkpointer,
    CheckpointError,
    Committed,
    step_dirs,
    verify_checkpoint,
)
from training.control import ControlFile
from training.data import ResumableSampler
from training.elastic import (
    ElasticBatch,
    ElasticLR,
    ElasticPlan,
    SamplesSchedule,
    plan_elastic,
    refuse_unscalable,
    scale_lr_during_step,
)
from training.knobs import BatchPlan, collective_timeout_from_env, plan_batch
from training.monitors import (
    Finding,
    Spike,
    SpikeDetector,
    SpikeRule,
    StragglerRun,
    detect_reference_divergence,
    detect_slow_link,
    detect_straggler,
)
from training.progress import ProgressReporter
from training.regroup import (
    Group,
    GroupEnd,
    LeaveForMembership,
    MembershipTimeout,
    RegroupTimeline,
    StoppedWhileWaiting,
    await_membership,
    await_store,
    detect_group_loss,
    drop_ddp_hooks,
    process_group_timeout,
    sharded_on_group,
    stale_ddp,
)
from training.resume import (
    CheckpointUnusable,
    RankCandidates,
    ResumeMismatch,
    agree_on_resume,
    choose_checkpoint,
)
from training.rng import capture_rng_state, reseed_all, restore_rng_state, rng_key
from training.signals import StopRequest

#: Checkpoint URI schemes a rank never reads as a path (the agent stages them first).
REMOTE_SCHEMES = frozenset({"s3", "gs"})

_E = TypeVar("_E", bound=StrEnum)


class RunExit(SystemExit):
    """A deliberate exit with one of the contract's codes (every rank agrees)."""

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.exit_code.name} ({int(self.exit_code)}): {self.reason}"


def _env_range(env: Mapping[str, str], name: str) -> tuple[int, int] | None:
    """``FIRST-LAST`` (inclusive, FIRST <= LAST) or None when unset."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    first, sep, last = raw.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: want FIRST-LAST, two step numbers") from None
    if not sep or lo < 0 or hi < lo:
        raise ValueError(f"{name}={raw!r}: want FIRST-LAST with 0 <= FIRST <= LAST")
    return lo, hi


def _enum(kind: type[_E], value: Any) -> _E:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(str(m)) for m in kind)
        raise ValueError(f"{kind.__name__} {value!r}: want one of {allowed}") from None


def _env_enum(env: Mapping[str, str], name: str, kind: type[_E], default: _E) -> _E:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw.lower())
    except ValueError:
        allowed = ", ".join(str(m) for m in kind)
        raise ValueError(f"{name}={raw!r}: want one of {allowed}") from None


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not an integer") from None


@dataclass(frozen=True)
class RunConfig:
    """The run's context. ``from_env`` reads what the node agent sets
    (``orchestrator.contract.Env``); keyword overrides (a script's flags) win."""

    checkpoint_uri: str = ""
    """file:///abs/path, s3://bucket/prefix or gs://bucket/prefix; empty = no checkpoints."""
    local_dir: str = ""
    """Local tier for s3:// and gs:// URIs (saves land here, then upload). A file://
    URI is written directly (it is already a filesystem)."""
    resume_from: str = "latest"
    """``latest`` | ``none`` | a local path or file:// URI of one ``step_<N>`` directory
    (an s3:// or gs:// one is refused at restore, exit 78: the agent stages those)."""
    expected_step: int | None = None
    """Set by the reconciler after staging: ranks refuse to train on any other step."""
    skip_steps: tuple[int, int] | None = None
    """(first, last): after a rollback past an anomaly (``on_anomaly: rollback_skip``),
    when the run reaches step ``first`` the data position moves past the batches of
    steps ``first..last``, so the data that preceded the anomaly is not replayed. The
    step counter does not move: every step is still one optimizer update."""
    checkpoint_every: int = 100
    """Steps between periodic saves; 0 = none. The control file may change it."""
    keep: int = 3
    """Complete checkpoints kept, locally and in the store (>= 2)."""
    use_async: bool = True
    """``async_save``: the step blocks only for the copy to CPU memory."""
    seed: int = 0
    """Reseeds per-rank generators when a resume changes the world size (see rng.py)."""
    global_batch: int | None = None
    """Samples per optimizer step over all ranks of the full world. Fixed for the whole
    run, except with ``elastic_batch`` scale on a smaller world (``global_batch_for``)."""
    full_world_size: int | None = None
    """The world size ``global_batch`` and the learning rate are for, on an elastic run
    (``Env.FULL_WORLD_SIZE``); None: not elastic, the current world is the full one."""
    elastic_batch: ElasticBatch = ElasticBatch.KEEP
    """On a world other than the full one: keep the global batch (each rank accumulates
    more) or scale it with the world, the learning rate following ``elastic_lr``."""
    elastic_lr: ElasticLR = ElasticLR.LINEAR
    """With ``elastic_batch`` scale: the learning rate x world / full, or its sqrt."""
    regroup_timeout_s: float = 0.0
    """Elastic runs (``full_world_size`` set) in ``Run.groups()``: seconds a rank whose
    group ended waits for a newer membership in the control file before it exits
    ``REGROUP_FAILED``; 0: warm regroup off (``Env.REGROUP_TIMEOUT_S``, set by an agent
    that writes memberships)."""
    micro_batch: int | None = None
    """Per-rank micro-batch the memory planner chose (None = the whole per-rank batch)."""
    activation_checkpoint_every: int = 0
    """Recompute every Nth block's activations (the model applies it); 0 = off."""
    progress_addr: str = ""
    """host:port of the agent's UDP listener; empty = no reports."""
    control_file: str = ""
    """The agent's JSON control file; empty = none."""
    control_every: int = 5
    """Steps between control-file polls (each poll is one stat())."""
    reference_every: int = 0
    """Steps between reference forward passes (and one before every save) when a
    ``reference_fn`` is given; 0 = only before saves."""
    reference_rtol: float = 1e-6
    straggler_every: int = 10
    """Steps between sharing per-rank compute times; 0 = never."""
    straggler_ratio: float = 1.5
    """Slowest rank over the median at or above which a straggler is reported."""
    straggler_persist: int = 3
    """Consecutive shares in which the same rank is over ``straggler_ratio`` before it
    is reported (monitors.StragglerRun)."""
    spike: SpikeRule = field(default_factory=SpikeRule)
    """When the loss is a spike: window, robust z, minimum jump, persistence."""
    job_id: str = ""
    attempt: int | None = None
    node_id: str = ""

    def __post_init__(self) -> None:
        if self.keep < 2:
            raise ValueError(
                f"keep must be >= 2 (got {self.keep}): a save in flight needs a fallback"
            )
        for name in ("checkpoint_every", "control_every", "reference_every", "straggler_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.resume_from not in ("latest", "none") and not self.resume_from:
            raise ValueError("resume_from must be 'latest', 'none' or a path")
        scheme = urlparse(self.checkpoint_uri).scheme if self.checkpoint_uri else ""
        if self.checkpoint_uri and scheme not in ("file", "s3", "gs"):
            raise ValueError(
                f"checkpoint_uri {self.checkpoint_uri!r}: use file:///abs/path, s3:// or gs://"
            )
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"global_batch must be positive, got {self.global_batch}")
        if self.full_world_size is not None and self.full_world_size < 1:
            raise ValueError(f"full_world_size must be positive, got {self.full_world_size}")
        if not self.regroup_timeout_s >= 0:  # NaN too
            raise ValueError(f"regroup_timeout_s must be >= 0, got {self.regroup_timeout_s}")
        # Plain strings (a script's flags) become the enums; a bad one is refused here.
        object.__setattr__(self, "elastic_batch", _enum(ElasticBatch, self.elastic_batch))
        object.__setattr__(self, "elastic_lr", _enum(ElasticLR, self.elastic_lr))
        if self.straggler_ratio <= 1.0:
            raise ValueError(f"straggler_ratio must be > 1, got {self.straggler_ratio}")
        if self.straggler_persist < 1:
            raise ValueError(f"straggler_persist must be >= 1, got {self.straggler_persist}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> RunConfig:
        """Read the agent's ``SKYRESUME_RUN_*`` variables; a bad value raises
        ValueError naming the variable. ``overrides`` that are None are ignored."""
        env = os.environ if env is None else env
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown RunConfig fields: {', '.join(sorted(unknown))}")
        cfg = cls(
            checkpoint_uri=env.get(Env.CHECKPOINT_URI, ""),
            local_dir=env.get(Env.LOCAL_CHECKPOINT_DIR, ""),
            resume_from=env.get(Env.RESUME_FROM, "") or "latest",
            expected_step=_env_int(env, Env.EXPECTED_STEP, None),
            skip_steps=_env_range(env, Env.SKIP_STEPS),
            checkpoint_every=_env_int(env, Env.CHECKPOINT_EVERY, 100) or 0,
            keep=_env_int(env, Env.CHECKPOINT_KEEP, 3) or 3,
            global_batch=_env_int(env, Env.GLOBAL_BATCH, None),
            full_world_size=_env_int(env, Env.FULL_WORLD_SIZE, None),
            elastic_batch=_env_enum(env, Env.ELASTIC_BATCH, ElasticBatch, ElasticBatch.KEEP),
            elastic_lr=_env_enum(env, Env.ELASTIC_LR, ElasticLR, ElasticLR.LINEAR),
            regroup_timeout_s=_env_int(env, Env.REGROUP_TIMEOUT_S, 0) or 0,
            micro_batch=_env_int(env, Env.MICRO_BATCH, None) or None,
            activation_checkpoint_every=_env_int(env, Env.ACTIVATION_CHECKPOINT_EVERY, 0) or 0,
            progress_addr=env.get(Env.PROGRESS_ADDR, ""),
            control_file=env.get(Env.CONTROL_FILE, ""),
            job_id=env.get(Env.JOB_ID, ""),
            attempt=_env_int(env, Env.ATTEMPT, None),
            node_id=env.get(Env.NODE_ID, ""),
        )
        return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})

    def elastic_plan(self, world_size: int, global_batch: int | None = None) -> ElasticPlan:
        """This world's batch and lr factor (``training.elastic``); ``global_batch``
        stands in for the full world's when the config has none."""
        return plan_elastic(
            self.global_batch if self.global_batch is not None else global_batch,
            world_size,
            self.full_world_size,
            self.elastic_batch,
            self.elastic_lr,
        )

    def global_batch_for(self, world_size: int) -> int | None:
        """Samples per step on ``world_size`` ranks: the global batch, or with elastic
        batch scale ``global_batch * world_size / full_world_size``. Build the
        ResumableSampler with it."""
        return self.elastic_plan(world_size).global_batch


@dataclass
class _StepTimes:
    started: float = 0.0
    first_bucket: float | None = None
    """When DDP's first gradient bucket was ready on this rank (before any wait)."""
    waited: float = 0.0
    """Seconds this step spent blocked in the run's own collectives."""
    window: list[float] = field(default_factory=list)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def checkpoint_tiers(uri: str, local_dir: str) -> tuple[Path | None, str | None, str | None]:
    """(local root, URI to upload to, URI the local root itself is). A file:// URI is
    used directly; s3:// and gs:// get a local tier first."""
    if not uri:
        return None, None, None
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(parsed.path), None, uri
    import hashlib
    import tempfile

    default = (
        Path(tempfile.gettempdir())
        / "skyresume-local"
        / hashlib.sha256(uri.encode()).hexdigest()[:12]
    )
    return (Path(local_dir) if local_dir else default), uri, None


class Run:
    """One training run's checkpoints, resume, stop, reports and monitors."""

    def __init__(
        self,
        config: RunConfig,
        *,
        model: Any,
        optimizer: Any,
        scheduler: Any = None,
        sampler: ResumableSampler | None = None,
        reference_fn: Callable[[], Any] | None = None,
        extra_state: Mapping[str, Any] | None = None,
    ) -> None:
        """``model`` may be wrapped (DDP, FSDP2). ``reference_fn()`` returns the loss
        of a fixed batch (it is run under ``torch.no_grad()`` with the model in eval
        mode). ``extra_state`` maps names to objects with ``state_dict()`` /
        ``load_state_dict()`` that are saved and restored too."""
        import torch.distributed as dist

        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self._skipped = False
        self.reference_fn = reference_fn
        self.extra_state = dict(extra_state or {})
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.elastic = config.elastic_plan(
            self.world_size, sampler.global_batch if sampler is not None else None
        )
        """This world's batch and lr factor (the full world's on a non-elastic run)."""
        if sampler is not None:
            self._fit_sampler(sampler)
        self.global_batch: int | None = None
        """Samples per optimizer step on this world, every rank's together."""
        self.full_global_batch = self.elastic.full_global_batch
        """The spec's global batch, for the full world (``global_batch`` but in scale mode)."""
        self.lr_factor = 1.0
        """What the scheduler's lr is multiplied by inside ``optimizer.step()`` (the param
        groups keep the full world's lr; log ``lr * run.lr_factor`` for the one applied)."""
        self.batch_plan: BatchPlan | None = None
        """Micro-batch and accumulation for this world."""
        self._schedule: SamplesSchedule | None = None
        self._lr_hooks: tuple[Any, ...] = ()
        self._plan_world()
        self.step = 0
        """Optimizer steps completed (the next step to run)."""
        self.samples = 0
        """Samples trained on by the steps completed (each step's global batch summed;
        a ``rollback_skip``'s skipped batches are not in it). The scheduler's position
        in scale mode is ``samples // full_global_batch``."""
        self.checkpoint_every = config.checkpoint_every
        self.resumed_digest: str | None = None
        self.last_straggler: tuple[int, float] | None = None
        self._stragglers = StragglerRun(config.straggler_persist)
        self._uploads_seen = 0
        """(slowest rank, its compute time over the median) at the last share."""
        self.findings: list[Finding] = []
        self.reporter = ProgressReporter(config.progress_addr, rank=self.rank)
        self._stop = StopRequest()
        self._control = ControlFile(config.control_file)
        self._loss_spikes = SpikeDetector(config.spike)
        self._grad_norms: deque[tuple[int, float]] = deque(maxlen=config.spike.window)
        """(step, grad norm) of recent steps: evidence beside a loss spike."""
        self._faults_taken: set[str] = set()
        self._fault_now: FaultKind | None = None
        """A fault taken at this step boundary and not yet acted on."""
        self._nan_next = False
        self._spike_left = 0
        """Steps of an injected loss spike still to run (this one included)."""
        self._spike_applied = False
        self.injected: list[tuple[int, FaultKind]] = []
        """(step, kind) of every chaos fault this rank acted on."""
        self._times = _StepTimes()
        self._report: tuple[float, float | None] | None = None
        self._restored = False
        self._polled = False
        self._max_steps: int | None = None
        self._last_saved: int | None = None
        self.root, self.upload_uri, durable = checkpoint_tiers(
            config.checkpoint_uri, config.local_dir
        )
        self._durable_uri = durable
        self.checkpointer: Checkpointer | None = self._make_checkpointer()
        self._hook_ddp()
        self.warm_regroup = bool(
            self.distributed and config.full_world_size is not None and config.regroup_timeout_s
        )
        """Elastic with an agent that writes memberships: inside ``groups()``, a lost
        peer or a newer membership ends the group, not the process."""
        self.generation = 0
        """The membership generation of the current process group (0: the first
        launch's own group, when the control file names none)."""
        self._group: Group | None = None
        """The group of ``groups()`` being trained on, if any."""
        self._leave_due: int | None = None
        """A newer generation every rank read at this step boundary: save and leave."""
        self._group_timeout: Any = None
        self._backend = ""
        self._timeline: RegroupTimeline | None = None
        """The warm regroup in progress, until the new group's first step is done."""
        if self.warm_regroup:
            self._adopt_generation_at_start()

    def _plan_world(self) -> None:
        """Batch, accumulation, lr factor and schedule for ``self.elastic`` (this world)."""
        for hook in self._lr_hooks:
            hook.remove()
        self._lr_hooks = ()
        global_batch = self.elastic.global_batch
        self.global_batch = global_batch
        self.lr_factor = self.elastic.lr_factor
        # The current world size, never the env's GRAD_ACCUM: the service computes that
        # for the full world, and a shrunk world needs more accumulation.
        self.batch_plan = (
            plan_batch(global_batch, self.world_size, self.config.micro_batch)
            if global_batch is not None
            else None
        )
        self._schedule = None
        if self.elastic.batch_follows_world:
            refuse_unscalable(self.optimizer, self.scheduler)  # on every launch, the full one too
            if self.lr_factor != 1.0:
                self._lr_hooks = scale_lr_during_step(self.optimizer, self.lr_factor)
            if self.scheduler is not None and global_batch != self.full_global_batch:
                assert self.full_global_batch is not None  # plan_elastic refuses None
                self._schedule = SamplesSchedule(self.scheduler, self.full_global_batch)

    def _make_checkpointer(self) -> Checkpointer | None:
        """A Checkpointer for the current process group (it holds a group of its own)."""
        if self.root is None:
            return None
        return Checkpointer(
            self.root,
            keep=self.config.keep,
            use_async=self.config.use_async,
            extra={"global_batch": self.global_batch},
            upload_uri=self.upload_uri,
            durable_uri=self._durable_uri,
            on_commit=self._on_commit,
        )

    def _fit_sampler(self, sampler: ResumableSampler) -> None:
        """The sampler must take this world's global batch. In scale mode one built
        for the full world (what a script that knows nothing of elasticity does) is
        rebatched; anything else is refused, since it would train on another batch."""
        plan = self.elastic
        want = plan.global_batch
        if sampler.global_batch == want:
            return
        if plan.batch_follows_world and sampler.global_batch == plan.full_global_batch:
            assert want is not None
            sampler.rebatch(want)
            if self.rank == 0:
                print(
                    f"elastic batch scale: world {plan.world_size} of {plan.full_world_size} "
                    f"trains on a global batch of {want} (the spec's {plan.full_global_batch} "
                    f"x {plan.world_size}/{plan.full_world_size}), lr x {plan.lr_factor:.4g}",
                    file=sys.stderr,
                )
            return
        if not plan.batch_follows_world:
            raise ValueError(
                f"global batch {want} (config) differs from the sampler's {sampler.global_batch}"
            )
        raise ValueError(
            f"the sampler's global batch {sampler.global_batch} is neither this world's "
            f"{want} (elastic batch scale, world {plan.world_size} of "
            f"{plan.full_world_size}) nor the full world's {plan.full_global_batch}"
        )

    @classmethod
    def from_env(
        cls,
        *,
        model: Any,
        optimizer: Any,
        scheduler: Any = None,
        sampler: ResumableSampler | None = None,
        reference_fn: Callable[[], Any] | None = None,
        extra_state: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        **config: Any,
    ) -> Run:
        """A Run whose context comes from the agent's environment; keyword
        arguments named like ``RunConfig`` fields override it (None = keep)."""
        return cls(
            RunConfig.from_env(env, **config),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=sampler,
            reference_fn=reference_fn,
            extra_state=extra_state,
        )

    # --- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full training state as DCP saves it (this rank's view)."""
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        sd: dict[str, Any] = {
            "model": msd,
            "optim": osd,
            "step": torch.tensor(self.step),
            "samples": torch.tensor(self.samples),
            "rng": {rng_key(self.rank): capture_rng_state()},
        }
        if self.scheduler is not None:
            sd["sched"] = self.scheduler.state_dict()
        if self.sampler is not None:
            sd["data"] = self.sampler.state_dict()
        for name, obj in self.extra_state.items():
            sd[f"extra.{name}"] = obj.state_dict()
        return sd

    def _load(self, step_dir: Path, world_at_save: int) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = self.state_dict()
        saved_keys = set(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)
        mine = rng_key(self.rank)
        same_world = world_at_save == self.world_size
        if same_world:  # only the generators this checkpoint actually holds
            sd["rng"][mine] = {
                k: v for k, v in sd["rng"][mine].items() if f"rng.{mine}.{k}" in saved_keys
            }
        else:
            del sd["rng"]
        if "samples" not in saved_keys:  # saved before the counter: one batch throughout
            del sd["samples"]
        dcp.load(sd, checkpoint_id=str(step_dir), no_dist=not self.distributed)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
        )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sd["sched"])
        if self.sampler is not None:
            # The position is in samples: a scaled batch still means the same data.
            self.sampler.load_state_dict(
                sd["data"], batch_may_change=self.elastic.batch_follows_world
            )
        for name, obj in self.extra_state.items():
            obj.load_state_dict(sd[f"extra.{name}"])
        step = int(sd["step"])
        self.samples = int(sd["samples"]) if "samples" in sd else step * (self.global_batch or 0)
        if same_world and "torch" in sd["rng"][mine]:
            restore_rng_state(sd["rng"][mine])
        else:  # another world size, or a checkpoint without this rank's generators
            reseed_all(self.config.seed, step, self.rank)
            if self.rank == 0 and not same_world:
                print(
                    f"world size {world_at_save} -> {self.world_size}: model, optimizer and "
                    f"data position resharded; random generators reseeded from (seed, step, rank)",
                    file=sys.stderr,
                )
        return step

    # --- restore ----------------------------------------------------------------------

    def restore(self) -> int:
        """Load the checkpoint every rank agrees on (or start fresh); returns the step.

        Exits (RunExit) 78 if what was asked for cannot be loaded, 77 if ranks
        disagree. Sends one ``resumed`` datagram per rank once they agree."""
        if self._restored:
            return self.step
        self._mark("restoring")
        if self.warm_regroup and stale_ddp(self.model):
            raise RuntimeError(
                "run.model is a DistributedDataParallel of an earlier process group: build "
                "the wrapper inside `with group:` of `for group in run.groups()` and pass it "
                "to run.rewrap()"
            )
        explicit = self.config.resume_from not in ("latest", "none")
        remote = urlparse(self.config.resume_from).scheme if explicit else ""
        if remote in REMOTE_SCHEMES:
            # Never a path: Path("s3://b/p/step_40") is a local directory that does not
            # exist, and the rank would report a missing COMMIT instead of the real fault.
            self._exit(
                ExitCode.CHECKPOINT_INVALID,
                f"{Env.RESUME_FROM}={self.config.resume_from} is a remote URI; ranks load "
                f"only local step directories: the node agent stages checkpoints onto the "
                f"node's disk before the ranks start ({Env.STAGE_FROM}) and names the staged "
                f"copy in {Env.RESUME_FROM}",
            )
        chosen: tuple[int, str] | None = None
        paths: dict[tuple[int, str], Path] = {}
        world_at_save = self.world_size
        if (self.root is not None and self.config.resume_from != "none") or explicit:
            error = self._stage() if not explicit else None
            try:
                chosen, paths, world_at_save = self._agree_on_checkpoint(explicit, error)
                self._mark("agreed")
            except CheckpointUnusable as e:
                self._exit(ExitCode.CHECKPOINT_INVALID, f"checkpoint unusable: {e}")
            except ResumeMismatch as e:
                self._exit(ExitCode.RESUME_MISMATCH, str(e))
        step, digest = 0, None
        if chosen is not None:
            step_dir = paths[chosen]
            try:
                step = self._load(step_dir, world_at_save)
            except (CheckpointError, RuntimeError, ValueError, KeyError) as e:
                if self.warm_regroup and detect_group_loss(e) is not None:
                    raise  # a peer died during the load: the checkpoint is not at fault
                self._exit(ExitCode.CHECKPOINT_INVALID, f"{step_dir}: could not load: {e}")
            digest = chosen[1]
            self._mark("loaded")
        self.confirm_resumed(step, digest)
        if self._timeline is not None:
            self._timeline.mark("resumed")
            self._timeline.resume_step = step
        if digest and self.rank == 0:
            print(f"resumed from step {step} ({paths[chosen]})", file=sys.stderr)  # type: ignore[index]
        return step

    def _stage(self) -> str | None:
        """One rank per node brings the newest complete remote checkpoint to local
        disk; returns why it failed (None if it did not)."""
        if not self.upload_uri:
            return None
        error = None
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            from orchestrator.cloud.storage import (
                StorageError,
                list_checkpoints,
                stage_checkpoint,
            )

            try:
                if any(c.complete for c in list_checkpoints(self.upload_uri)):
                    assert self.root is not None
                    staged = stage_checkpoint(self.upload_uri, str(self.root))
                    print(f"staged step {staged.step} from {self.upload_uri}", file=sys.stderr)
            except StorageError as e:
                error = f"staging from {self.upload_uri}: {e}"
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()
        return error

    def _local_candidates(self, explicit: bool) -> tuple[list[tuple[int, str, Path, int]], str]:
        """(step, digest, path, world size) of complete checkpoints here (sizes and
        COMMIT checked; checksums are checked once one is chosen), and why others
        were skipped."""
        if explicit:
            p = self.config.resume_from
            dirs = [Path(urlparse(p).path) if p.startswith("file://") else Path(p)]
        else:
            dirs = [d for _s, d in step_dirs(self.root)] if self.root else []
        found, skipped = [], []
        for d in dirs:
            try:
                m = verify_checkpoint(d, deep=False)
            except CheckpointError as e:
                skipped.append(str(e))
                continue
            digest = manifest_digest((d / MANIFEST_NAME).read_bytes())
            found.append((m.step, digest, d, m.world_size))
        return found, "; ".join(skipped)

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _agree_on_checkpoint(
        self, explicit: bool, error: str | None
    ) -> tuple[tuple[int, str] | None, dict[tuple[int, str], Path], int]:
        found, skipped = self._local_candidates(explicit)
        if skipped and (explicit or int(os.environ.get("LOCAL_RANK", "0")) == 0):
            print(f"rank {self.rank}: skipped: {skipped}", file=sys.stderr)
        if explicit and not found and skipped:
            error = skipped
        paths = {(s, d): p for s, d, p, _w in found}
        worlds = {(s, d): w for s, d, _p, w in found}
        excluded: set[tuple[int, str]] = set()
        while True:
            mine = tuple(k for k in paths if k not in excluded)
            views = [
                RankCandidates(r, tuple(map(tuple, c)), e)  # type: ignore[arg-type]
                for r, (c, e) in enumerate(self._all_gather((list(mine), error)))
            ]
            chosen = choose_checkpoint(views, explicit=explicit)
            if chosen is None:
                return None, paths, self.world_size
            # Checksums: one rank per node reads the files (the node's ranks share a
            # disk); every rank learns the verdict, so all fall back together.
            verdict = None
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                try:
                    verify_checkpoint(paths[chosen], deep=True)
                except CheckpointError as e:
                    verdict = str(e)
            bad = [v for v in self._all_gather(verdict) if v]
            if not bad:
                return chosen, paths, worlds[chosen]
            if explicit:
                raise CheckpointUnusable("; ".join(bad))
            print(f"rank {self.rank}: step {chosen[0]} rejected: {bad[0]}", file=sys.stderr)
            excluded.add(chosen)

    # --- the loop ---------------------------------------------------------------------

    def steps(self, max_steps: int) -> Iterator[int]:
        """Yield each step to run, from the restored one up to ``max_steps``.

        Before each: the stop agreement (SIGTERM -> emergency save -> exit 75) and
        the control file. After each (when the loop asks for the next): progress,
        monitors, reference pass, periodic save."""
        if max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {max_steps}")
        self.restore()
        self._max_steps = max_steps
        while self.step < max_steps:
            if self.should_stop():
                self.stop_and_exit()
            if self._leave_due is not None:
                self._save_and_leave(self._leave_due)
            self._skip_batches()
            self._begin_step()
            yield self.step
            self.end_step()

    def _skip_batches(self) -> None:
        """rollback_skip: at the window's first step, move the data past its batches."""
        window = self.config.skip_steps
        if window is None or self.step != window[0] or self._skipped:
            return
        self._skipped = True
        first, last = window
        if self.sampler is None:
            print(
                f"rank {self.rank}: cannot skip the batches of steps {first}-{last}: "
                "the run has no ResumableSampler",
                file=sys.stderr,
                flush=True,
            )
            return
        for _ in range(last - first + 1):
            self.sampler.advance()
        print(
            f"rank {self.rank}: skipped the batches of steps {first}-{last} (rollback_skip)",
            file=sys.stderr,
            flush=True,
        )

    def _begin_step(self) -> None:
        self._times.started = time.perf_counter()
        self._times.first_bucket = None
        self._times.waited = 0.0
        self._report = None
        self._spike_applied = False
        if self._schedule is not None:
            self._schedule.before_step()
        kind, self._fault_now = self._fault_now, None
        if kind is None:
            return
        self._note_fault(kind)
        if kind is FaultKind.NAN:
            self._nan_next = True
        elif kind is FaultKind.SPIKE:
            self._spike_left = chaos.SPIKE_STEPS
        else:
            chaos.raise_fault(kind)  # uncaught: the rank dies with the real error's text

    def _note_fault(self, kind: FaultKind) -> None:
        self.injected.append((self.step, kind))
        print(f"rank {self.rank}: chaos: {kind} at step {self.step}", file=sys.stderr, flush=True)

    def _take_fault(self) -> None:
        """The control file's fault, if its token is new and it names this rank."""
        req = self._control.fault
        if req is None or req.token in self._faults_taken:
            return
        self._faults_taken.add(req.token)  # once per token, even on ranks it spares
        if req.applies_to(self.rank):
            self._fault_now = req.kind

    def perturb_loss(self, loss: Any) -> Any:
        """The loss to backpropagate: ``loss`` itself, except during an injected chaos
        spike (``SPIKE_FACTOR`` x ``loss``, so the gradients spike too). Route each
        micro-batch's loss through it in the forward to let ``skyresume chaos spike``
        reach the model; without it only the reported loss spikes."""
        if self._spike_left <= 0:
            return loss
        self._spike_applied = True
        return loss * chaos.SPIKE_FACTOR

    def should_stop(self) -> bool:
        """The step-boundary agreement (a collective: every rank calls it at the same
        step). True on every rank if any rank was signalled. Also applies a new
        checkpoint interval once every rank read the same one from the control file."""
        import torch

        if not self._polled or self.step % max(1, self.config.control_every) == 0:
            self._control.poll()
            self._polled = True
            self._take_fault()
        every = self._control.checkpoint_every or 0
        named = self._control.membership
        gen = named.generation if named is not None and self.warm_regroup else 0
        # The generation each rank read rides along (MAX and -MIN, like the interval), so
        # ranks leave for a new membership only once every one of them has read it.
        flags = torch.tensor(
            [1 if self._stop.requested_here else 0, every, -every, gen, -gen], dtype=torch.int64
        )
        if self._fault_now is FaultKind.TRANSPORT:
            self._note_fault(FaultKind.TRANSPORT)
            # In place of this step's collective, as a broken link fails it: uncaught.
            raise chaos.transport_error()
        if self.distributed:
            import torch.distributed as dist

            t0 = time.perf_counter()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            self._times.waited += time.perf_counter() - t0
        stop, hi, lo, gen_hi, gen_lo = (int(x) for x in flags)
        group = self._group
        agreed_gen = gen_hi if gen_hi == -gen_lo else None
        if agreed_gen is not None and agreed_gen > self.generation and group and group.active:
            self._leave_due = agreed_gen
        if hi == -lo and hi > 0 and hi != self.checkpoint_every:
            if self.rank == 0:
                print(
                    f"checkpoint interval {self.checkpoint_every} -> {hi} steps (control file)",
                    file=sys.stderr,
                )
            self.checkpoint_every = hi
        return bool(stop)

    def _save_now(self) -> None:
        """Save this step synchronously on every rank (after the save in flight),
        unless it is saved already: the stop's emergency save, a planned leave's."""
        ckpt = self.checkpointer
        if ckpt is None:
            return
        try:
            ckpt.wait()  # the periodic save in flight first, then this one synchronously
        except CheckpointError as e:  # every rank gets the same outcome
            print(f"rank {self.rank}: {e}; saving this step anyway", file=sys.stderr)
        if self._last_saved != self.step:
            use_async, ckpt.use_async = ckpt.use_async, False
            try:
                ckpt.save(self.state_dict(), self.step)
            finally:
                ckpt.use_async = use_async
            self._last_saved = self.step

    def stop_and_exit(self) -> None:
        """Save the emergency checkpoint (all ranks, same step) and exit 75."""
        ckpt = self.checkpointer
        if ckpt is not None:
            self._save_now()
            ckpt.close()
        print(f"rank {self.rank}: stop requested; saved step {self.step}", file=sys.stderr)
        self._exit(ExitCode.PREEMPTED_SAVED, f"stop requested; saved step {self.step}")

    def report(self, *, loss: Any, grad_norm: Any = None) -> None:
        """This step's loss and (global) grad norm. Call it after backward and
        **before** ``optimizer.step()``: if any rank saw NaN/Inf, every rank exits 76
        here, with the weights untouched (a collective)."""
        import torch

        loss_f = float(loss.detach() if hasattr(loss, "detach") else loss)
        if self._nan_next:  # chaos: this rank's loss is NaN once
            self._nan_next = False
            loss_f = math.nan
        if self._spike_left > 0 and not self._spike_applied:
            loss_f *= chaos.SPIKE_FACTOR  # the script did not call perturb_loss this step
        gn = None if grad_norm is None else float(grad_norm)
        bad = torch.tensor(
            [0 if math.isfinite(loss_f) and (gn is None or math.isfinite(gn)) else 1]
        )
        if self.distributed:
            import torch.distributed as dist

            t0 = time.perf_counter()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            self._times.waited += time.perf_counter() - t0
        if bad.item():
            self.optimizer.zero_grad(set_to_none=True)  # the weights are untouched
            self._anomaly(
                AnomalyKind.NAN,
                f"loss {loss_f}, grad norm {gn} on rank {self.rank}",
                onset_step=self.step,  # a NaN has no persistence: it begins where it is seen
            )
            print(
                f"rank {self.rank}: non-finite loss/grad at step {self.step}; no update applied",
                file=sys.stderr,
            )
            if self.checkpointer is not None:
                self.checkpointer.close()  # the last periodic save predates the NaN
            self._exit(ExitCode.NAN_DETECTED, f"non-finite loss/grad at step {self.step}")
        self._report = (loss_f, gn)

    def end_step(self) -> None:
        """Close the step: count it, report it, watch it, maybe save."""
        index = self.step  # the step just run: anomalies name it (see the module doc)
        self.step += 1
        self.samples += self.global_batch or 0
        if self._schedule is not None:
            self._schedule.after_step(self.samples)  # before any save: it holds the scheduler
        self._spike_left = max(0, self._spike_left - 1)
        if self.sampler is not None:
            self.sampler.advance()
        now = time.perf_counter()
        dt = now - self._times.started
        loss, gn = self._report or (None, None)
        self.reporter.progress(
            step=self.step,
            step_time=dt,
            loss=loss,  # type: ignore[arg-type]
            grad_norm=gn,  # type: ignore[arg-type]
            samples_per_s=(self.global_batch or 0) / dt if dt > 0 else 0.0,
            max_steps=self._max_steps,
        )
        if self._timeline is not None:
            self._first_step_after_regroup()
        if gn is not None:
            self._grad_norms.append((index, gn))
        if loss is not None:
            self._observe(self._loss_spikes.observe(index, loss))
        first = self._times.first_bucket
        compute = (first - self._times.started) if first is not None else dt - self._times.waited
        self._times.window.append(max(compute, 0.0))
        every = self.config.straggler_every
        if every and self.step % every == 0:
            self._share_step_times()
        save_due = self._save_due()
        ref_every = self.config.reference_every
        if self.reference_fn is not None and (
            save_due or (ref_every and self.step % ref_every == 0)
        ):
            self._check_reference()
        if save_due:
            self.maybe_checkpoint()

    def _save_due(self) -> bool:
        every = self.checkpoint_every
        final = self._max_steps is not None and self.step >= self._max_steps
        return bool(
            self.checkpointer is not None
            and every
            and self.step % every == 0
            and not final
            and self._last_saved != self.step
        )

    def maybe_checkpoint(self, *, force: bool = False) -> bool:
        """Start the periodic save if one is due at this step (every rank calls it at
        the same step; ``steps()`` does). Returns whether a save started."""
        if self.checkpointer is None or not (force or self._save_due()):
            return False
        self.checkpointer.save(self.state_dict(), self.step)
        self._last_saved = self.step
        return True

    def finish(self, *, save: bool = False) -> None:
        """Wait for the save in flight (and with ``save``, save this final step), send
        the ``exit`` datagram and tear the process group down."""
        if self.checkpointer is not None:
            if save and self._last_saved != self.step:
                self.maybe_checkpoint(force=True)
            self.checkpointer.close()
        self.reporter.send("exit", code=int(ExitCode.OK), reason=f"finished at step {self.step}")
        self._stop.restore()
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()

    # --- process groups (elastic: warm regroup) ----------------------------------------

    def groups(self) -> Iterator[Group]:
        """Each process group the run trains on; train inside ``with group:``.

            for group in run.groups():
                with group:
                    ddp = DDP(model)  # what uses the group is built per group
                    run.rewrap(ddp)
                    for step in run.steps(max_steps):
                        ...
            run.finish()

        One group, exceptions propagating as without it, unless warm regroup is on
        (``warm_regroup``: an elastic run, ``REGROUP_TIMEOUT_S`` set). Then a lost
        peer's collective error, or a newer membership generation in the control file
        at a step boundary (every rank saves that step first), ends the group, not the
        process: the rank destroys the process group, sends a ``regroup`` datagram,
        waits for a newer ``Membership``, joins its group (``tcp://``, its new rank and
        world, the same collective timeout), replans batch, lr factor and sampler for
        the new world, and yields the next group, whose ``restore()`` loads the
        membership's checkpoint. The model, optimizer and the process stay. A rank
        that cannot re-form exits ``REGROUP_FAILED`` for a cold restart."""
        while True:
            group = Group(self.generation, self.rank, self.world_size, warm=self.warm_regroup)
            self._group = group
            yield group
            self._group = None
            end = group.end
            if end is None:  # finished (or never entered): the run is done with groups
                return
            self._regroup(end)

    def rewrap(self, model: Any) -> None:
        """The model as wrapped for the current process group (a DDP built inside the
        group): its state is saved and restored through it, and Run times compute with
        a comm hook on it. A DDP of an earlier group is refused at ``restore()``."""
        self.model = model
        self._hook_ddp()

    def _adopt_generation_at_start(self) -> None:
        """A rank starting cold belongs to the generation its control file names (the
        agent writes the membership before it starts ranks); only a newer one re-forms."""
        import torch.distributed as dist

        self._group_timeout = process_group_timeout(collective_timeout_from_env())
        self._backend = dist.get_backend()
        self._control.poll()
        named = self._control.membership
        if named is None:
            return
        self.generation = named.generation
        try:
            want: tuple[int, int] | None = (named.world_size, named.global_rank(_local_rank()))
        except ValueError:
            want = None
        if want != (self.world_size, self.rank):
            print(
                f"rank {self.rank}: warning: the control file's generation {named.generation} "
                f"is world {named.world_size}, this process group is rank {self.rank} of "
                f"{self.world_size}; taking it as generation {named.generation}",
                file=sys.stderr,
            )

    def _save_and_leave(self, generation: int) -> None:
        """Every rank read ``generation`` at this boundary: save it, then leave."""
        self._leave_due = None
        ckpt = self.checkpointer
        self._save_now()
        saved = self._last_saved if ckpt is not None else None
        if self.rank == 0:
            print(
                f"generation {generation} named at step {self.step}: saved step {saved}; "
                f"leaving generation {self.generation}",
                file=sys.stderr,
                flush=True,
            )
        raise LeaveForMembership(generation, saved)

    def _regroup(self, end: GroupEnd) -> None:
        """From a group that ended to the next one's first ``restore()`` (see ``groups``)."""
        import torch.distributed as dist

        if sharded_on_group(self.model):
            # The lost rank's shards are gone and the survivors' cannot move to a new
            # mesh in place: the only way on is a cold start from the checkpoint.
            if end.reason is RegroupReason.MEMBERSHIP:  # saved: as a stop does
                self._exit(ExitCode.PREEMPTED_SAVED, f"sharded model: saved step {end.saved_step}")
            self._exit(ExitCode.REGROUP_FAILED, f"sharded model cannot regroup warm: {end.error}")
        self._timeline = RegroupTimeline(self.generation)
        first_line = (end.error or "").splitlines()[0] if end.error else ""
        print(
            f"rank {self.rank}: generation {self.generation} ended at step {self.step} "
            f"({end.reason}{': ' + first_line if first_line else ''}); waiting up to "
            f"{self.config.regroup_timeout_s:g} s for a newer membership",
            file=sys.stderr,
            flush=True,
        )
        # Said at once: the service holds this node warm on it, and the save in flight
        # below may take its collective's timeout to fail.
        self._send_regroup(self.generation, end)
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            try:
                ckpt.close()  # its thread's collectives fail fast too, or time out
            except CheckpointError as e:
                print(f"rank {self.rank}: {e} (never committed)", file=sys.stderr)
        drop_ddp_hooks(self.model)
        self.optimizer.zero_grad(set_to_none=True)  # a half-done step's gradients
        try:
            dist.destroy_process_group()
        except Exception as e:  # nothing can be formed over a group torch still holds
            self._exit(ExitCode.REGROUP_FAILED, f"destroy_process_group failed: {e}")
        newer_than = self.generation
        while True:
            membership = self._await_membership(newer_than)
            self._mark("membership")
            failed = self._join(membership)
            if failed is None:
                self._mark("formed")
                break
            print(f"rank {self.rank}: gen {membership.generation}: {failed}", file=sys.stderr)
            self._send_regroup(membership.generation, GroupEnd(RegroupReason.FORM_FAILED, failed))
            newer_than = membership.generation
        self._adopt_world(membership)

    def _mark(self, phase: str) -> None:
        if self._timeline is not None:
            self._timeline.mark(phase)

    def _first_step_after_regroup(self) -> None:
        """The new group's first completed step: where the regroup's seconds went, on
        stderr (every rank; a benchmark reads the earliest rank's completion time, as
        it reads a restarted torchrun's first progress datagram)."""
        timeline, self._timeline = self._timeline, None
        assert timeline is not None
        print(
            timeline.first_step_line(self.rank, self.generation, self.step),
            file=sys.stderr,
            flush=True,
        )

    def _send_regroup(self, generation: int, end: GroupEnd) -> None:
        self.reporter.send(
            "regroup",
            generation=generation,
            reason=str(end.reason),
            error=end.error,
            step=self.step,
            saved_step=end.saved_step,
            pid=os.getpid(),
        )

    def _await_membership(self, newer_than: int) -> Membership:
        def read() -> Membership | None:
            self._control.poll()
            return self._control.membership

        try:
            return await_membership(
                read,
                newer_than,
                self.config.regroup_timeout_s,
                stopped=lambda: self._stop.requested_here,
            )
        except (MembershipTimeout, StoppedWhileWaiting) as e:
            self._exit(ExitCode.REGROUP_FAILED, f"{e}; restart this rank cold")
            raise  # unreachable: _exit raises

    def _join(self, m: Membership) -> str | None:
        """Form ``m``'s process group; None when formed, else why not (the group is
        then torn down again, so a newer membership can be tried)."""
        import torch.distributed as dist

        try:
            rank = m.global_rank(_local_rank())
        except ValueError as e:
            self._exit(ExitCode.REGROUP_FAILED, f"{e}; this rank is not in the new group")
        t0 = time.perf_counter()
        # Under torchrun every rank is told to use the agent's store (the first group's,
        # hosted by node 0's torchrun): for the new group rank 0 must host its own, or
        # every rank waits as a client of a store nobody serves.
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        if rank != 0:  # rank 0 hosts the store: connect once it listens (see await_store)
            await_store(m.master_addr, m.master_port, self._group_timeout.total_seconds())
        try:
            dist.init_process_group(
                self._backend,
                init_method=m.init_method,
                rank=rank,
                world_size=m.world_size,
                timeout=self._group_timeout,
            )
        except (RuntimeError, ValueError) as e:  # DistStoreError, DistNetworkError: peers
            with contextlib.suppress(Exception):
                if dist.is_initialized():
                    dist.destroy_process_group()
            return f"could not form the group at {m.init_method}: {type(e).__name__}: {e}"
        # What a script or library reads from torchrun's variables must name this group.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(m.world_size),
            GROUP_RANK=str(m.node_rank),
            LOCAL_WORLD_SIZE=str(m.nproc_per_node),
            MASTER_ADDR=m.master_addr,
            MASTER_PORT=str(m.master_port),
        )
        print(
            f"rank {self.rank} -> {rank} of {m.world_size}: generation {m.generation} formed "
            f"at {m.init_method} in {time.perf_counter() - t0:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        return None

    def _adopt_world(self, m: Membership) -> None:
        """Everything of Run that depends on the world, for the group just formed; the
        next ``restore()`` loads ``m``'s checkpoint, as a cold start would."""
        import torch.distributed as dist

        self.generation = m.generation
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.reporter.rank = self.rank
        self.config = replace(self.config, resume_from=m.resume_from, expected_step=m.resume_step)
        self.elastic = self.config.elastic_plan(self.world_size, self.full_global_batch)
        self._plan_world()
        if self.sampler is not None:
            self.sampler.reslice(self.rank, self.world_size, self.global_batch)
        self.checkpointer = self._make_checkpointer()  # its own gloo group, in the new world
        # As a cold start: the next restore() decides the step, and per-process
        # monitors start over (their history is of steps the resume may redo).
        self._restored = False
        self._last_saved = None
        self._skipped = False
        self._polled = False
        self._leave_due = None
        self._fault_now = None
        self._nan_next = False
        self._spike_left = 0
        self._times = _StepTimes()
        self._stragglers = StragglerRun(self.config.straggler_persist)
        self._loss_spikes = SpikeDetector(self.config.spike)
        self._grad_norms.clear()
        self._uploads_seen = 0
        self.last_straggler = None

    # --- monitors ---------------------------------------------------------------------

    def _observe(self, spike: Spike | None) -> None:
        if spike is None:
            return
        evidence = spike.evidence("loss")
        before = [g for s, g in self._grad_norms if s < spike.onset_step]
        at_onset = next((g for s, g in self._grad_norms if s == spike.onset_step), None)
        gn_median = statistics.median(before) if before else None
        if at_onset is not None and gn_median is not None:
            evidence += f"; grad norm {at_onset:.4g} at the onset vs median {gn_median:.4g}"
        self.findings.append(Finding("loss_spike", spike.onset_step, spike.onset_value, evidence))
        print(f"rank {self.rank}: loss spike: {evidence}", file=sys.stderr, flush=True)
        self._anomaly(
            AnomalyKind.SPIKE,
            f"loss_spike on rank {self.rank}: {evidence}",
            step=spike.onset_step,
            metric="loss",
            onset_step=spike.onset_step,
            detected_step=spike.detected_step,
            value=spike.onset_value,
            peak=spike.peak,
            median=spike.median,
            threshold=spike.threshold,
            persist=self.config.spike.persist,
            grad_norm=at_onset,
            grad_norm_median=gn_median,
        )

    def _share_step_times(self) -> None:
        import torch

        mine = statistics.fmean(self._times.window) if self._times.window else 0.0
        self._times.window.clear()
        if not self.distributed:
            return
        import torch.distributed as dist

        times = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world_size)]
        dist.all_gather(times, torch.tensor([mine], dtype=torch.float64))
        per_rank = [float(t) for t in times]
        slowest, ratio, finding = detect_straggler(
            self.step, per_rank, ratio_threshold=self.config.straggler_ratio
        )
        self.last_straggler = (slowest, ratio)
        finding = self._stragglers.observe(slowest, finding)
        if finding is not None:
            self.findings.append(finding)
            if self.rank == 0:  # one report per finding, not one per rank
                # Which rank is slow, so the service can blame its node, not rank 0's.
                self._anomaly(AnomalyKind.STRAGGLER, finding.evidence, slow_rank=slowest)

    def _check_reference(self) -> None:
        import torch

        assert self.reference_fn is not None
        was_training = bool(getattr(self.model, "training", True))
        self.model.eval()
        try:
            with torch.no_grad():
                value = float(self.reference_fn())
        finally:
            self.model.train(was_training)
        losses = [float(v) for v in self._all_gather(value)]
        finding = detect_reference_divergence(self.step, losses, rtol=self.config.reference_rtol)
        if finding is None:
            return
        self.findings.append(finding)
        self._anomaly(AnomalyKind.SILENT_CORRUPTION, finding.evidence)
        print(f"rank {self.rank}: {finding.evidence}", file=sys.stderr)
        if self.checkpointer is not None:
            self.checkpointer.close()  # an earlier save predates the divergence
        self._exit(ExitCode.SILENT_CORRUPTION, finding.evidence)

    def _hook_ddp(self) -> None:
        """Time when this rank's first gradient bucket is ready: compute before any
        wait on slower peers (DDP's all-reduce makes every rank's whole step as slow
        as the slowest one, so whole-step times cannot tell who is slow)."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(self.model, DistributedDataParallel):
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        times = self._times

        # No annotations: DDP checks them against dist.GradBucket, and under
        # ``from __future__ import annotations`` they would be strings.
        def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]
            if times.first_bucket is None:
                times.first_bucket = time.perf_counter()
            return allreduce_hook(state, bucket)

        # A user's own hook wins: then compute is step time minus the run's waits.
        with contextlib.suppress(RuntimeError):
            self.model.register_comm_hook(None, timed_allreduce)

    # --- reporting --------------------------------------------------------------------

    def _on_commit(self, c: Committed) -> None:
        self._uploads_seen += 1
        # A run's first upload times its clients' first connections, not the links.
        first = self._uploads_seen == 1
        slow = detect_slow_link(c.step, list(c.uploads)) if self.rank == 0 and not first else None
        if slow is not None:
            # Which rank's link is slow, so the service can blame its node.
            rank, finding = slow
            self.findings.append(finding)
            self._anomaly(AnomalyKind.SLOW_LINK, finding.evidence, step=c.step, slow_rank=rank)
        if self.rank == 0:
            self.reporter.send(
                "checkpoint",
                step=c.step,
                path=str(c.path),
                uploaded_uri=c.uploaded_uri,
                world_size=c.world_size,
                blocking_s=None if c.blocking_s is None else round(c.blocking_s, 4),
            )

    def _anomaly(
        self, kind: AnomalyKind, detail: str, *, step: int | None = None, **fields: Any
    ) -> None:
        step = self.step if step is None else step
        self.reporter.send("anomaly", kind=kind.value, step=step, detail=detail, **fields)

    def _exit(self, code: ExitCode, reason: str) -> NoReturn:
        self.reporter.send("exit", code=int(code), reason=reason)
        if code != ExitCode.PREEMPTED_SAVED:
            print(f"rank {self.rank}: error: {reason}", file=sys.stderr)
        # The flag-only handler stays until the process is gone, over any framework's:
        # torchrun forwards the agent's SIGTERM, so a second one can come while this rank
        # unwinds and shuts the interpreter down, and a default handler put back here
        # would end a rank that saved at -15 instead of ``code``, which the agent reads
        # as killed before it saved. A caller that catches RunExit and goes on calls
        # ``release_signals()``.
        self._stop.reinstall()
        raise RunExit(code, reason)

    # --- for framework integrations (training.integrations) ---------------------------
    # A Hugging Face Trainer, Accelerate or Lightning run keeps its own loop and its own
    # checkpoint format; it drives Run's protocol through these (and should_stop, report,
    # end_step, reporter), never through Run's internals (docs/training.md).

    @classmethod
    def for_framework(cls, config: RunConfig, *, optimizer: Any) -> Run:
        """A Run that saves nothing itself (no Checkpointer: the framework's own files are
        committed by the integration) but stages from and agrees on ``config``'s
        checkpoint URI. ``optimizer`` is what a NaN's ``zero_grad`` clears."""
        run = cls(
            replace(config, checkpoint_uri="", use_async=False), model=None, optimizer=optimizer
        )
        run.config = config  # resume_from, expected_step, seed, keep as configured
        run.root, run.upload_uri, _durable = checkpoint_tiers(
            config.checkpoint_uri, config.local_dir
        )
        return run

    def begin_step(self) -> None:
        """Open a step the framework runs: its timer starts, and a chaos fault taken at
        the last boundary is raised here (OOM, Xid, user error) or armed (NaN, spike)."""
        self._begin_step()

    def agree_on_checkpoint(self) -> tuple[int, str, Path, int] | None:
        """(step, manifest digest, local step directory, world size that saved it) of
        the checkpoint every rank agrees to resume from, staged first from a remote URI
        (one rank per node); None for a fresh start. Loads nothing. Exits 78
        (unusable) or 77 (no agreement) on every rank, as ``restore`` does. A collective."""
        explicit = self.config.resume_from not in ("latest", "none")
        if explicit and urlparse(self.config.resume_from).scheme in REMOTE_SCHEMES:
            self._exit(
                ExitCode.CHECKPOINT_INVALID,
                f"{Env.RESUME_FROM}={self.config.resume_from} is a remote URI; the node "
                "agent stages checkpoints onto the node's disk and names the staged copy",
            )
        if not explicit and (self.root is None or self.config.resume_from == "none"):
            return None
        error = self._stage() if not explicit else None
        try:
            chosen, paths, world_at_save = self._agree_on_checkpoint(explicit, error)
        except CheckpointUnusable as e:
            self._exit(ExitCode.CHECKPOINT_INVALID, f"checkpoint unusable: {e}")
        except ResumeMismatch as e:
            self._exit(ExitCode.RESUME_MISMATCH, str(e))
        if chosen is None:
            return None
        return chosen[0], chosen[1], paths[chosen], world_at_save

    def confirm_resumed(self, step: int, digest: str | None) -> None:
        """The framework loaded ``step`` of the checkpoint with ``digest`` (None: it
        started fresh): every rank's (step, digest) must agree and the staged
        ``expected_step`` hold (77 otherwise); then Run counts from ``step`` and sends
        the ``resumed`` datagram. A collective."""
        try:
            agree_on_resume(
                step if digest else None, digest, expected_step=self.config.expected_step
            )
        except ResumeMismatch as e:
            self._exit(ExitCode.RESUME_MISMATCH, str(e))
        self.step = step
        self._last_saved = step if digest else None
        self.resumed_digest = digest
        self._restored = True
        # With warm regroup the generation says which group resumed (every rank of it
        # must say the same step); without, the datagram is as it always was.
        generation = {"generation": self.generation} if self.warm_regroup else {}
        self.reporter.send("resumed", step=step, manifest_digest=digest, **generation)

    def note_saved(self, step: int) -> None:
        """A save of ``step`` was committed outside Run (the framework's): none is due
        again at this step."""
        self._last_saved = step

    def exit_with(self, code: ExitCode, reason: str) -> None:
        """The ``exit`` datagram, then ``RunExit(code)``; Run's flag-only handler stays
        installed (see ``_exit``)."""
        self._exit(code, reason)

    def take_signals(self) -> None:
        """Run's flag-only SIGTERM/SIGUSR1 handler again, over one a framework installed
        after Run was built (Lightning's, at fit start); ``release_signals`` still puts
        back the handlers Run found."""
        self._stop.reinstall()

    def release_signals(self) -> None:
        """The signal handlers Run found, back (``finish`` does it too, and tears the
        process group down, which a framework's run keeps)."""
        self._stop.restore()
