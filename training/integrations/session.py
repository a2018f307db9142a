"""What every framework integration shares: ``FrameworkRun``.

A framework (Hugging Face Trainer, Accelerate, Lightning) keeps its own loop and its
own checkpoint format; skyresume adds, around them, what ``training.Run`` gives a
script of its own:

* **the step-boundary agreements** (SIGTERM/SIGUSR1 flag, control-file interval,
  chaos faults, NaN before the update) and **the reports** (progress, checkpoint,
  anomalies, stragglers), by driving a ``training.Run`` that has no checkpointer of
  its own (``Run.for_framework``): ``begin_step`` / ``report`` / ``end_step`` /
  ``should_stop`` are Run's, so a framework run sends the agent exactly the datagrams
  a Run script sends. Only Run's public surface is used (docs/training.md);
* **commits of the framework's own files** (:meth:`FrameworkRun.commit`): whatever
  the framework wrote for step N on each node becomes ``<root>/step_<N>`` with our
  ``manifest.json`` and, last, ``COMMIT``, uploaded to the job's checkpoint URI
  (each node its own files, then rank 0 checks the listing and writes the manifest
  and COMMIT there). A save counts only once committed: the framework's directory
  alone is never resumed;
* **the resume** (:meth:`FrameworkRun.restore` and :meth:`confirm_resumed`): the same
  staging and agreement as ``Run.restore`` choose the step directory every rank has;
  the framework loads it in its own way; then every rank all-gathers (step, manifest
  digest) and checks the step the framework says it loaded, so a framework that
  silently loaded something else (or nothing) is refused with 77, never trained on;
* **the batch knobs** after an OOM (:meth:`FrameworkRun.batch_plan`): the memory
  planner's micro-batch, mapped by each integration onto the framework's own names,
  with the global batch kept.

Nodes share no disk: a framework writes some files on rank 0 only (weights,
optimizer) and some on every rank (RNG states), so each node's first rank hashes
what its node holds and the lists are merged by rank 0 (the lowest rank that has a
path owns it, uploads it, and its checksum is the manifest's).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from orchestrator.contract import (
    COMMIT_NAME,
    MANIFEST_NAME,
    ExitCode,
    Manifest,
    ManifestFile,
    commit_marker,
    step_dir_name,
)
from training.checkpoint import CheckpointError, step_dirs
from training.elastic import ElasticBatch
from training.knobs import BatchPlan, plan_batch
from training.run import Run, RunConfig, checkpoint_tiers

#: Where a framework writes a save before it is committed as ``step_<N>`` (a name
#: ``step_dirs`` never lists, so a save killed half-way is never a candidate).
SAVING_PREFIX = ".saving-"


@dataclass(frozen=True)
class Resume:
    """The step directory every rank agreed to resume from."""

    path: Path
    step: int
    digest: str
    world_size: int
    """The world size that saved it (the framework may not reshard: see each module)."""


def plan_knobs(config: RunConfig, world_size: int, per_device: int, accumulation: int) -> BatchPlan:
    """See :meth:`FrameworkRun.batch_plan`; usable before the framework starts (an
    Accelerate script builds its DataLoader before the process group exists)."""
    global_batch = config.global_batch or per_device * accumulation * world_size
    return plan_batch(global_batch, world_size, config.micro_batch or per_device)


class _NoOptimizer:
    """Until the framework has built its optimizer: a NaN before that has no update
    to withhold."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def files_under(step_dir: Path) -> list[ManifestFile]:
    """Every file under ``step_dir`` (``/``-separated relative paths), with size and
    sha256, except our own manifest and COMMIT."""
    from orchestrator.cloud.storage import file_sha256

    out = []
    for p in sorted(step_dir.rglob("*")):
        rel = p.relative_to(step_dir).as_posix()
        if not p.is_file() or rel in (MANIFEST_NAME, COMMIT_NAME):
            continue
        out.append(ManifestFile(rel, p.stat().st_size, file_sha256(str(p))))
    return out


def merge_node_listings(
    listings: list[list[ManifestFile] | None],
) -> tuple[list[ManifestFile], dict[str, int]]:
    """(the manifest's files, path -> the rank that owns it). ``listings[r]`` is what
    rank r's node holds (None from ranks that are not their node's first). The lowest
    rank with a path owns it: with ``save_on_each_node`` every node writes the weights,
    and one copy (rank 0's) is the checkpoint's."""
    owners: dict[str, int] = {}
    files: dict[str, ManifestFile] = {}
    for rank, listing in enumerate(listings):
        for f in listing or []:
            if f.path not in owners:
                owners[f.path] = rank
                files[f.path] = f
    return [files[p] for p in sorted(files)], owners


class FrameworkRun:
    """One framework run's agreements, reports, commits and resume (see the module)."""

    def __init__(
        self, framework: str, *, env: Any = None, optimizer: Any = None, **overrides: Any
    ) -> None:
        import torch.distributed as dist

        self.framework = framework
        self.config = RunConfig.from_env(env, **overrides)
        if self.config.elastic_batch is ElasticBatch.SCALE:
            # The framework owns its sampler, scheduler and batch: Run cannot scale them,
            # and training on as if keep were asked would be a silent change of math.
            raise ValueError(
                f"elastic batch scale is not supported with {framework}: the framework's "
                "batch, sampler and scheduler are its own; use elastic batch keep"
            )
        # The Run drives the agreements and reports; it saves nothing itself, because
        # the checkpoint is the framework's own, committed by ``commit``.
        self.run = Run.for_framework(
            self.config, optimizer=optimizer if optimizer is not None else _NoOptimizer()
        )
        self.root, self.upload_uri, self.durable_uri = checkpoint_tiers(
            self.config.checkpoint_uri, self.config.local_dir
        )
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = self.run.rank
        self.world_size = self.run.world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.last_saved: int | None = None
        self.stopped = False
        self._committed: list[int] = []

    # --- the loop (Run's agreements and reports) ---------------------------------------

    @property
    def step(self) -> int:
        return self.run.step

    def save_due(self, step: int, max_steps: int | None = None) -> bool:
        """A periodic save at ``step`` (the interval may move: the control file)."""
        every = self.run.checkpoint_every
        final = max_steps is not None and max_steps > 0 and step >= max_steps
        return bool(
            self.root is not None
            and every
            and step % every == 0
            and not final
            and self.last_saved != step
        )

    def exit_stopped(self) -> None:
        """Every rank saved step N (or had it already): exit 75 (RunExit)."""
        step = self.run.step
        print(f"rank {self.rank}: stop requested; saved step {step}", file=sys.stderr)
        self.run.exit_with(ExitCode.PREEMPTED_SAVED, f"stop requested; saved step {step}")

    def finish(self) -> None:
        """The ``exit`` datagram (code 0) and the previous signal handlers back. The
        process group is the framework's: it is left as it is."""
        self.run.reporter.send(
            "exit", code=int(ExitCode.OK), reason=f"finished at step {self.step}"
        )
        self.run.release_signals()

    # --- knobs ------------------------------------------------------------------------

    def batch_plan(self, per_device: int, accumulation: int) -> BatchPlan:
        """The per-device batch and accumulation to train with. The global batch is
        the job's (``SKYRESUME_RUN_GLOBAL_BATCH``) or else the script's own
        (per_device x accumulation x world size); the memory planner's micro-batch
        (after an OOM, a smaller one) is applied with that global batch kept."""
        return plan_knobs(self.config, self.world_size, per_device, accumulation)

    @property
    def activation_checkpointing(self) -> bool:
        return self.config.activation_checkpoint_every > 0

    # --- resume -----------------------------------------------------------------------

    def restore(self) -> Resume | None:
        """The step directory every rank agrees on, staged first from a remote URI
        (one rank per node); None for a fresh start. Exits 78 (unusable) or 77 (no
        agreement) on every rank, as ``Run.restore`` does. A collective."""
        chosen = self.run.agree_on_checkpoint()
        if chosen is None:
            return None
        step, digest, path, world_at_save = chosen
        return Resume(path, step, digest, world_at_save)

    def confirm_resumed(self, loaded_step: int, resume: Resume | None) -> None:
        """After the framework loaded ``resume`` (or started fresh): every rank's
        (step, digest) must agree, the step the framework reports must be the
        manifest's, and the staged ``expected_step`` must hold (77 otherwise). Then
        the ``resumed`` datagram. A collective."""
        run = self.run
        if resume is not None and loaded_step != resume.step:
            run.exit_with(
                ExitCode.RESUME_MISMATCH,
                f"{self.framework} loaded step {loaded_step} from {resume.path}, "
                f"whose manifest says step {resume.step}",
            )
        if resume is None and loaded_step != 0:
            run.exit_with(
                ExitCode.RESUME_MISMATCH,
                f"{self.framework} resumed step {loaded_step} from a checkpoint skyresume did "
                "not choose (a resume_from_checkpoint/ckpt_path of its own?)",
            )
        digest = resume.digest if resume is not None else None
        run.confirm_resumed(loaded_step, digest)
        self.last_saved = loaded_step if digest else None
        if digest and self.rank == 0:
            print(f"resumed from step {loaded_step} ({resume.path})", file=sys.stderr)  # type: ignore[union-attr]

    # --- commits ----------------------------------------------------------------------

    def saving_dir(self, step: int) -> Path:
        """Where a framework writes step N's save before ``commit`` (under the local tier)."""
        assert self.root is not None, "no checkpoint URI: nothing is saved"
        return self.root / f"{SAVING_PREFIX}{step}"

    def commit(self, src: Path, step: int) -> str | None:
        """Make what the framework wrote into ``src`` on each node the committed
        ``step_<N>``: moved into place, hashed per node, uploaded (remote URIs), then
        manifest.json and COMMIT. Returns the step's URI in the store (None when the
        upload failed: the local copy still counts, as with ``Run``). Every rank
        calls it at the same step, after the framework's save."""
        import torch.distributed as dist

        assert self.root is not None, "no checkpoint URI: nothing is saved"
        if self.distributed:
            dist.barrier()  # every rank's files are written
        dst = self.root / step_dir_name(step)
        listing: list[ManifestFile] | None = None
        if self.local_rank == 0:
            if dst.exists():
                shutil.rmtree(dst)  # a leftover of a killed save of this step
            self.root.mkdir(parents=True, exist_ok=True)
            if src.exists():
                shutil.move(str(src), str(dst))
            else:
                dst.mkdir()
            listing = files_under(dst)
        listings: list[list[ManifestFile] | None] = [listing]
        if self.distributed:
            listings = [None] * self.world_size
            dist.all_gather_object(listings, listing)
        files, owners = merge_node_listings(listings)
        failed = self._upload(dst, step, owners)
        manifest_bytes = b""
        if self.rank == 0:
            manifest = Manifest(
                step=step,
                world_size=self.world_size,
                created=datetime.now(timezone.utc).isoformat(),
                files=tuple(files),
                extra={"framework": self.framework, "global_batch": self.config.global_batch},
            )
            manifest_bytes = manifest.to_json()
            _atomic_write(dst / MANIFEST_NAME, manifest_bytes)
            _atomic_write(dst / COMMIT_NAME, commit_marker(manifest_bytes))
            if self.upload_uri and not failed:
                failed = self._publish(step, manifest, manifest_bytes)
        if self.distributed:
            outcome: list[str | None] = [failed if self.rank == 0 else None]
            dist.broadcast_object_list(outcome, src=0)
            failed = outcome[0] or ""
        uri: str | None
        if self.upload_uri:
            uri = None if failed else f"{self.upload_uri.rstrip('/')}/{dst.name}"
            if failed:
                print(f"rank {self.rank}: upload of step {step} failed: {failed}", file=sys.stderr)
        else:
            uri = f"{self.durable_uri.rstrip('/')}/{dst.name}" if self.durable_uri else None
        self.last_saved = step
        self.run.note_saved(step)
        self._prune_local(step)
        if self.rank == 0:
            self.run.reporter.send(
                "checkpoint",
                step=step,
                path=str(dst),
                uploaded_uri=uri,
                world_size=self.world_size,
                blocking_s=None,
            )
        return uri

    def _upload(self, dst: Path, step: int, owners: dict[str, int]) -> str:
        """Each node's first rank uploads the files it owns; the failures, joined
        (every rank gets the same string). A collective when distributed."""
        import torch.distributed as dist

        failed = ""
        if self.upload_uri and self.local_rank == 0:
            from orchestrator.cloud.storage import StorageError, store_for_uri

            try:
                store, prefix = store_for_uri(self.upload_uri)
                key = "/".join(p for p in (prefix, dst.name) if p)
                for path, owner in owners.items():
                    if owner == self.rank:
                        store.put_file(str(dst / path), f"{key}/{path}")
            except (StorageError, OSError) as e:
                failed = f"rank {self.rank}: {e}"
        if self.upload_uri and self.distributed:
            gathered: list[str | None] = [None] * self.world_size
            dist.all_gather_object(gathered, failed)
            failed = "; ".join(g for g in gathered if g)
        return failed

    def _publish(self, step: int, manifest: Manifest, manifest_bytes: bytes) -> str:
        """Rank 0: every listed file is in the store at its size, then manifest.json
        and, last, COMMIT; old checkpoints pruned there. Returns why not ("" = done)."""
        from orchestrator.cloud.storage import StorageError, store_for_uri
        from training.checkpoint import prune_remote

        assert self.upload_uri is not None
        try:
            store, prefix = store_for_uri(self.upload_uri)
            key = "/".join(p for p in (prefix, step_dir_name(step)) if p)
            listed = {o.key[len(key) + 1 :]: o.size for o in store.list(key + "/")}
            for f in manifest.files:
                if listed.get(f.path) != f.size:
                    raise CheckpointError(
                        f"{key}/{f.path}: not uploaded at {f.size} bytes "
                        f"(found {listed.get(f.path)})"
                    )
            store.put_bytes(f"{key}/{MANIFEST_NAME}", manifest_bytes)
            store.put_bytes(f"{key}/{COMMIT_NAME}", commit_marker(manifest_bytes))
            for gone in prune_remote(self.upload_uri, self.config.keep):
                print(f"pruned {gone} from {self.upload_uri}", file=sys.stderr)
        except (StorageError, CheckpointError, OSError) as e:
            return str(e)
        return ""

    def _prune_local(self, step: int) -> None:
        """Each node's first rank keeps the newest ``keep`` saves this run committed
        and deletes older step directories (a node without rank 0 never holds a
        COMMIT, so a COMMIT-based prune alone would never free its disk)."""
        self._committed.append(step)
        del self._committed[: -self.config.keep]
        if self.local_rank != 0 or self.root is None or len(self._committed) < self.config.keep:
            return
        oldest_kept = min(self._committed)
        for s, path in step_dirs(self.root):
            if s < oldest_kept:
                shutil.rmtree(path, ignore_errors=True)
