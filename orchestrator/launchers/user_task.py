"""A user's SkyPilot task YAML as the service takes it: read once, checked with
SkyPilot's own parser, and kept as text with the job (``jobs.task_yaml``), so every
launch runs what was submitted whatever becomes of the file afterwards (#26).

* :func:`check_task_text` is what ``POST /v1/jobs`` and ``skyresume plan`` both run:
  one document (a job group is named in one line), a mapping, and a task
  ``sky.Task.from_yaml_config`` takes with the spec's envs and secrets. It answers
  the YAML's ``num_nodes`` (the spec's default when it gives none) and one line per
  field skyresume does not run (``service:``, ``pool:``, ``job_recovery``).
* :func:`pin_stored_text` hands a stored text to a launcher. The launchers read a
  task from a path (``skypilot.load_task_config``), so the text is written once
  into a private directory of this process, under its digest, and the spec the
  launcher gets names that file: the user's file is never opened after submit, and
  a replica that did not take the submit launches the same text from the database.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.domain.spec import JobSpec, SpecError, load_yaml_document
from orchestrator.launchers.base import TaskRejected

#: Task fields skyresume does not run: said in one line each, never dropped silently.
_UNSUPPORTED = {
    "service": "SkyServe's service: section (skyresume runs training jobs, not services)",
    "pool": "SkyPilot's pool: section",
}


def unsupported_lines(config: dict[str, Any]) -> list[str]:
    """One line per field of the task that skyresume does not run."""
    out = [
        f"{k}: {why} is not supported; ignored" for k, why in _UNSUPPORTED.items() if k in config
    ]
    res = config.get("resources")
    opts = [res] if isinstance(res, dict) else []
    if isinstance(res, dict):
        opts += [o for o in (res.get("any_of") or res.get("ordered") or []) if isinstance(o, dict)]
    if any("job_recovery" in o or "spot_recovery" in o for o in opts):
        out.append(
            "resources.job_recovery: SkyPilot's managed-job recovery is not used; "
            "skyresume recovers the job itself (restart protocol)"
        )
    return out


def single_document(text: str | bytes, where: str) -> None:
    """TaskRejected naming a job group or a pipeline (several YAML documents) in one
    line; PyYAML's own "expected a single document" says nothing of what to do."""
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError:
        return  # load_yaml_document names the error
    if len(docs) > 1:
        raise TaskRejected(
            f"{where}: {len(docs)} YAML documents (a SkyPilot job group or pipeline); "
            "job groups are not supported: skyresume runs one task per job, give it one"
        )


def task_config_of(text: str, where: str) -> dict[str, Any]:
    """The task's config (a mapping) from its text; TaskRejected naming why not."""
    single_document(text, where)
    try:
        doc = load_yaml_document(text, what=where)
    except SpecError as e:
        raise TaskRejected(f"SkyPilot task {where}: {e}") from None
    if not isinstance(doc, dict):
        raise TaskRejected(f"SkyPilot task {where}: a SkyPilot task must be a mapping")
    return doc


@dataclass(frozen=True)
class CheckedTask:
    """A task YAML that SkyPilot's parser took, as the job stores it."""

    text: str
    """The YAML as read: what every launch of the job runs."""
    config: dict[str, Any]
    """Its config with the spec's envs filled in (what SkyPilot parsed)."""
    task: Any
    """The ``sky.Task`` (secrets as overrides, out of its YAML form)."""
    num_nodes: int
    """The YAML's ``num_nodes`` (SkyPilot's default, 1, when it has none)."""
    notes: tuple[str, ...]
    """One line per field skyresume does not run."""


def check_task_text(
    text: str, where: str, *, envs: dict[str, str] | None = None,
    secrets: dict[str, str] | None = None,
) -> CheckedTask:  # fmt: skip
    """``text`` checked as SkyPilot checks a task at ``sky launch`` (imports sky);
    TaskRejected with SkyPilot's reason in one line."""
    from orchestrator.launchers.skypilot import task_from_config

    config = task_config_of(text, where)
    if envs:  # the spec's envs fill the YAML's empty ones, as at launch
        config["envs"] = {**(config.get("envs") or {}), **envs}
    task = task_from_config(config, what=f"SkyPilot task {where}", secrets=secrets or None)
    return CheckedTask(text, config, task, int(task.num_nodes or 1),
                       tuple(unsupported_lines(config)))  # fmt: skip


def read_task_text(path: Path, where: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TaskRejected(f"SkyPilot task {where}: not UTF-8 text") from None
    except OSError as e:
        raise TaskRejected(f"SkyPilot task: cannot read {where}: {e.strerror}") from None


_copies: Path | None = None
_copies_lock = threading.Lock()


def _copies_dir() -> Path:
    """This process's directory of stored task texts: made by mkdtemp (0700, a name
    no other user can have taken first), so nothing but this service writes there;
    removed when the process exits."""
    global _copies
    with _copies_lock:
        if _copies is None or not _copies.is_dir():
            _copies = Path(tempfile.mkdtemp(prefix="skyresume-tasks-"))
            # Gone with the process: the texts live in the database, and one may hold
            # a task's secrets.
            atexit.register(shutil.rmtree, _copies, ignore_errors=True)
        return _copies


def stored_copy(text: str, name: str) -> Path:
    """A file holding exactly ``text``, named ``<digest>/<name>`` in this process's
    private directory (written once, atomically; rewritten if it was removed)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    safe = Path(name).name or "task.yaml"
    path = _copies_dir() / digest / safe
    with contextlib.suppress(OSError):  # absent or unreadable: written below
        if path.read_text(encoding="utf-8") == text:
            return path
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def pin_stored_text(spec: JobSpec, text: str | None) -> JobSpec:
    """``spec`` as the launcher must see it: its ``task.skypilot_yaml`` naming a copy of
    the text stored at submit. Unchanged for a template job, and for a job stored
    before the text was (``text`` None), which still reads its path."""
    if text is None or not spec.task.skypilot_yaml:
        return spec
    copy = stored_copy(text, spec.task.skypilot_yaml)
    task = spec.task.model_copy(update={"skypilot_yaml": str(copy)})
    return spec.model_copy(update={"task": task})
