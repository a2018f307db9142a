"""The SkyPilot launcher: real clouds through the SkyPilot SDK.

What it does, per attempt:

1. **place** (:meth:`SkyPilotLauncher.placement_for`): candidates from SkyPilot's
   catalog (:mod:`orchestrator.launchers.catalog`), ranked by the pure planner
   (:mod:`orchestrator.domain.planner`) with the failure history the caller has;
2. **build** a ``sky.Task`` (:func:`build_task`): from a template in
   ``task_templates/`` (its run section starts ``skyresume-agent`` around the user's
   command, using ``SKYPILOT_NODE_RANK`` / ``SKYPILOT_NODE_IPS`` /
   ``SKYPILOT_NUM_NODES`` / ``SKYPILOT_NUM_GPUS_PER_NODE``) or from the user's own
   SkyPilot YAML (:func:`build_task_from_user_yaml`), with the run's context in
   ``envs``, the agent's token in ``secrets``, and ``resources`` pinned to the
   planner's one choice (infra, instance type, accelerators, spot), so SkyPilot's
   optimizer has nothing left to choose and cannot wander to another region;
3. **launch / status / down** through the SDK's request ids (``sky.launch``,
   ``sky.status``, ``sky.down``, each answered by ``sky.get``).

Recovery is skyresume's: tasks go through ``sky.launch`` as plain clusters, never
``sky.jobs.launch``, so SkyPilot's managed-job recovery (which polls every ~15 s,
never reads spot notices and, per its issue 10021, does not block the region that
preempted it) never runs; ``retry_until_up`` stays off so a launch that cannot get
capacity fails fast and the reconciler re-plans with that region cooled down.

``sky`` is imported inside functions (about 1.5 s); nothing here runs at import.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchestrator.contract import Env
from orchestrator.domain.plan import Placement
from orchestrator.domain.planner import Candidate, FailureRecord
from orchestrator.domain.reconcile import LauncherAbilities
from orchestrator.domain.spec import JobSpec, SpecError, TaskSpec, load_yaml_document
from orchestrator.launchers.base import (
    CapacityError,
    ClusterState,
    ClusterStatus,
    LaunchError,
    LaunchHandle,
    LaunchRequest,
)

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "task_templates"
DEFAULT_TEMPLATE = "skypilot-gpu"

#: Metadata endpoints the agent polls on each provider (orchestrator.cloud.metadata).
METADATA_URLS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}

#: SkyPilot's cluster-name rule, and a length every cloud accepts.
_CLUSTER_NAME_MAX = 35


class TaskRejected(LaunchError):
    """SkyPilot refused the task (bad YAML, unknown field, invalid resources)."""


def cluster_name_for(job_id: str, attempt: int) -> str:
    """``sr-<job id>-a<attempt>``: lower case, letters first, under 35 characters."""
    base = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-") or "job"
    suffix = f"-a{attempt}"
    return ("sr-" + base)[: _CLUSTER_NAME_MAX - len(suffix)].rstrip("-") + suffix


def template_path(name: str, templates_dir: Path = TEMPLATES_DIR) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", name):
        raise TaskRejected(f"template name {name!r} is not a plain file name")
    path = templates_dir / f"{name}.yaml"
    if not path.is_file():
        known = sorted(
            p.stem for p in templates_dir.glob("*.yaml") if not p.stem.startswith("job.")
        )
        raise TaskRejected(
            f"no task template {name!r} in {templates_dir}; templates: {', '.join(known)}"
        )
    return path


def resources_for(placement: Placement) -> dict[str, Any]:
    """The resources section that pins one placement (SkyPilot YAML form)."""
    infra = f"{placement.cloud}/{placement.region}"
    if placement.zone:
        infra += f"/{placement.zone}"
    res: dict[str, Any] = {
        "infra": infra,
        "instance_type": placement.instance_type,
        "use_spot": placement.spot,
    }
    if placement.accelerator:
        res["accelerators"] = {placement.accelerator: placement.accelerator_count}
    return res


def run_envs(request: LaunchRequest, *, command: str, package: str = "skyresume") -> dict[str, str]:
    """Everything the template's run section reads, as task envs."""
    p = request.placement
    env = dict(request.env)
    if p.knobs is not None:
        env[Env.MICRO_BATCH] = str(p.knobs.micro_batch)
        env[Env.GRAD_ACCUM] = str(p.knobs.grad_accum)
        env[Env.ACTIVATION_CHECKPOINT_EVERY] = str(p.knobs.activation_checkpoint_every)
    env.setdefault(Env.JOB_ID, request.job_id)
    env.setdefault(Env.ATTEMPT, str(request.attempt))
    provider = p.cloud if p.cloud in METADATA_URLS else "none"
    env.update(
        {
            "SKYRESUME_PACKAGE": package,
            "SKYRESUME_COMMAND": command,
            "SKYRESUME_RANKS_PER_NODE": str(request.ranks_per_node),
            "SKYRESUME_PROVIDER": provider,
            "SKYRESUME_METADATA_URL": METADATA_URLS.get(provider, ""),
            "SKYRESUME_GRACE_S": f"{request.grace_s:g}",
        }
    )
    return env


@contextlib.contextmanager
def _sky_errors(what: str) -> Iterator[None]:
    """SkyPilot raises ValueError, its own exceptions, even AssertionError and
    SystemExit on bad input; one clear LaunchError names what was being done."""
    try:
        yield
    except (ValueError, TypeError, KeyError, AssertionError, SystemExit) as e:
        raise TaskRejected(f"{what}: SkyPilot rejected it: {_first_line(e)}") from None
    except Exception as e:
        if type(e).__module__.startswith("sky.") or "jsonschema" in type(e).__module__:
            raise TaskRejected(f"{what}: SkyPilot rejected it: {_first_line(e)}") from None
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    # SkyPilot colours some messages; strip ANSI escapes.
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:3])


def load_task_config(path: Path, *, what: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TaskRejected(f"{what}: cannot read {path}: {e.strerror}") from None
    try:
        doc = load_yaml_document(text, what=what)
    except SpecError as e:
        raise TaskRejected(f"{what} {path}: {e}") from None
    if not isinstance(doc, dict):
        raise TaskRejected(f"{what} {path}: a SkyPilot task must be a mapping")
    return doc


def task_from_config(
    config: dict[str, Any], *, what: str, secrets: dict[str, str] | None = None
) -> Any:
    """``sky.Task.from_yaml_config`` plus ``validate`` (files not checked: they are
    on the service host, not here), with SkyPilot's errors turned into TaskRejected.
    ``secrets`` go in as overrides so they stay out of the YAML text SkyPilot keeps."""
    import sky

    with _sky_errors(what):
        task = sky.Task.from_yaml_config(
            dict(config), secrets_overrides=list((secrets or {}).items()) or None
        )
        task.validate(skip_file_mounts=True, skip_workdir=True)
    return task


def _pin(task: Any, request: LaunchRequest, what: str) -> Any:
    import sky

    with _sky_errors(f"{what}: pinning {request.placement.instance_type}"):
        res = sky.Resources.from_yaml_config(resources_for(request.placement))
        task.set_resources(res)
        task.num_nodes = request.placement.num_nodes
        for r in task.resources:
            r.validate()
    return task


def build_task(
    request: LaunchRequest,
    *,
    template: str = DEFAULT_TEMPLATE,
    templates_dir: Path = TEMPLATES_DIR,
    token: str = "",
    package: str = "skyresume",
) -> Any:
    """A ``sky.Task`` from a template, rendered with the run's context and pinned to
    the request's placement. Raises TaskRejected naming what SkyPilot refused."""
    if not request.command.strip():
        raise TaskRejected("the job has no command to run under the agent")
    path = template_path(template, templates_dir)
    what = f"template {template!r}"
    config = load_task_config(path, what=what)
    config["name"] = cluster_name_for(request.job_id, request.attempt)
    envs = {str(k): "" if v is None else str(v) for k, v in (config.get("envs") or {}).items()}
    envs.update(run_envs(request, command=request.command, package=package))
    config["envs"] = envs
    secrets = {"SKYRESUME_AGENT_TOKEN": token} if token else None
    task = task_from_config(config, what=what, secrets=secrets)
    return _pin(task, request, what)


def build_task_from_user_yaml(
    path: str | Path,
    request: LaunchRequest,
    *,
    token: str = "",
    package: str = "skyresume",
    templates_dir: Path = TEMPLATES_DIR,
) -> Any:
    """A user's own SkyPilot task, kept as written (name, setup, envs, file_mounts,
    workdir), with its ``run`` handed to the agent as the command and its resources
    pinned to the planner's choice (which came from those same resources).

    The user's run script runs under the agent as ``bash -c '<run>'`` on every node,
    with the SKYPILOT_* variables it reads still set by SkyPilot.
    """
    what = f"SkyPilot task {path}"
    user = load_task_config(Path(path), what=what)
    original = task_from_config(dict(user), what=what)  # refuse what SkyPilot refuses
    run = original.run
    if not isinstance(run, str) or not run.strip():
        raise TaskRejected(f"{what}: it has no run section for the agent to start")
    node = load_task_config(template_path(DEFAULT_TEMPLATE, templates_dir), what="template")
    config = dict(user)
    config["name"] = cluster_name_for(request.job_id, request.attempt)
    envs = {str(k): "" if v is None else str(v) for k, v in (node.get("envs") or {}).items()}
    envs.update({str(k): "" if v is None else str(v) for k, v in (user.get("envs") or {}).items()})
    envs.update(run_envs(request, command=f"bash -c {shlex.quote(run)}", package=package))
    config["envs"] = envs
    user_setup = user.get("setup") or ""
    config["setup"] = f"{node['setup'].rstrip()}\n{user_setup}".rstrip() + "\n"
    config["run"] = node["run"]
    config.pop("resources", None)  # pinned below
    config.pop("num_nodes", None)
    secrets = {"SKYRESUME_AGENT_TOKEN": token} if token else None
    task = task_from_config(config, what=what, secrets=secrets)
    return _pin(task, request, what)


def dry_run(task: Any, cluster_name: str) -> None:
    """SkyPilot's own dry-run launch, in this process: optimizer, provisioning config,
    nothing launched. It runs SkyPilot's server-side ``sky.execution.launch``
    directly, because the client SDK's ``sky.launch`` would start a local API server.
    It needs the clouds enabled (``sky check``), the catalog's images and quota
    tables and ``rsync``; with no credentials GCP finishes in seconds, while AWS
    spends about 90 s retrying its client before it gives up on quotas."""
    from sky import execution

    with _sky_errors(f"dry run of {cluster_name}"):
        execution.launch(task, cluster_name=cluster_name, dryrun=True, stream_logs=False)


def _now() -> datetime:
    return datetime.now(UTC)


class SkyPilotLauncher:
    """The Launcher protocol over the SkyPilot SDK (see the module docstring)."""

    name = "skypilot"
    #: A relaunch in place runs the task again on the same cluster (``sky.exec``);
    #: staging happens on the nodes themselves, chaos needs the local launcher.
    abilities = LauncherAbilities(restarts_in_place=True)

    def __init__(
        self,
        settings: Any = None,
        token_for: Callable[[str], str] | None = None,
        *,
        template: str = DEFAULT_TEMPLATE,
        templates_dir: Path = TEMPLATES_DIR,
        package: str = "skyresume",
        history: Callable[[], Iterable[FailureRecord]] | None = None,
        sdk: Any = None,
    ) -> None:
        self.settings = settings
        self.token_for = token_for or (lambda _job: "")
        self.template = template
        self.templates_dir = templates_dir
        self.package = package
        self.history = history or (lambda: ())
        self._sdk = sdk

    @property
    def sdk(self) -> Any:
        """``sky`` itself (the client SDK), imported on first use."""
        if self._sdk is None:
            import sky

            self._sdk = sky
        return self._sdk

    # --- placing ---------------------------------------------------------------

    def candidates(self, spec: JobSpec, *, replacement: bool = False) -> list[Candidate]:
        """What SkyPilot's catalog offers for the job: its accelerators, or the
        resource options of its own task YAML (LaunchError when unreadable).
        ``replacement`` changes nothing here: the catalog is the same for both."""
        from orchestrator.launchers.catalog import (
            CatalogUnavailable,
            UnknownAccelerator,
            demand_from_task,
            gather_candidates,
            gather_for_task,
        )

        try:
            if spec.task.skypilot_yaml and not spec.accelerator_names:
                # The accelerators live in the user's YAML: plan its own options.
                what = f"SkyPilot task {spec.task.skypilot_yaml}"
                config = load_task_config(Path(spec.task.skypilot_yaml), what=what)
                demand = demand_from_task(task_from_config(config, what=what))
                return list(gather_for_task(demand, clouds=spec.clouds))
            return list(
                gather_candidates(spec.accelerator_names, clouds=spec.clouds, regions=spec.regions)
            )
        except (CatalogUnavailable, UnknownAccelerator) as e:
            raise LaunchError(str(e)) from None

    def placement_for(
        self,
        spec: JobSpec,
        *,
        exclude_regions: Sequence[str] = (),
        now: datetime | None = None,
        replacement: bool = False,
    ) -> Placement:
        """The first choice for ``spec`` by the same pure selection the reconciler's
        SELECT step makes (``domain.remedy.select_placement``), with the history this
        launcher was given; LaunchError naming why when nothing qualifies."""
        from orchestrator.domain.remedy import select_placement

        choice = select_placement(
            spec,
            self.candidates(spec, replacement=replacement),
            list(self.history()),
            now or _now(),
            exclude_regions=exclude_regions,
        )
        if choice.placement is None:
            raise LaunchError(f"no placement for job {spec.name!r}: {choice.reason}")
        return choice.placement

    # --- the Launcher protocol ---------------------------------------------------

    def build(self, request: LaunchRequest, task: TaskSpec | None = None) -> Any:
        task = task or getattr(request, "task", None)
        token = self.token_for(request.job_id)
        if task is not None and task.skypilot_yaml:
            return build_task_from_user_yaml(
                task.skypilot_yaml,
                request,
                token=token,
                package=self.package,
                templates_dir=self.templates_dir,
            )
        template = (task.template if task is not None else None) or self.template
        return build_task(
            request,
            template=template,
            templates_dir=self.templates_dir,
            token=token,
            package=self.package,
        )

    def launch(self, request: LaunchRequest, task: TaskSpec | None = None) -> LaunchHandle:
        name = cluster_name_for(request.job_id, request.attempt)
        sky_task = self.build(request, task or request.task)
        current = self.status(LaunchHandle(name, self.name))
        if current.state in (ClusterState.UP, ClusterState.LAUNCHING):
            # Idempotent: a service that restarted mid-launch must not launch twice.
            return LaunchHandle(name, self.name, self._node_ids(request))
        sky = self.sdk
        try:
            sky.get(
                sky.launch(
                    sky_task,
                    cluster_name=name,
                    retry_until_up=False,
                    idle_minutes_to_autostop=None,
                    down=False,
                )
            )
        except Exception as e:
            # ResourcesUnavailableError is SkyPilot's "no capacity or quota for any of
            # the resources it was given": with the task pinned to one placement, that
            # placement is out of stock and the job re-plans.
            error = (
                CapacityError
                if type(e).__name__ in ("ResourcesUnavailableError", "InsufficientCapacityError")
                else LaunchError
            )
            raise error(
                f"SkyPilot could not launch {name} on {request.placement.cloud}/"
                f"{request.placement.region} {request.placement.instance_type}: "
                f"{_first_line(e)}"
            ) from None
        return LaunchHandle(name, self.name, self._node_ids(request))

    def restart(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """Run the new attempt's task on the cluster that is already up (``sky.exec``:
        no provisioning, no setup); the nodes are the same, the attempt is new."""
        sky = self.sdk
        sky_task = self.build(request, request.task)
        try:
            sky.get(sky.exec(sky_task, cluster_name=previous.cluster_name))
        except Exception as e:
            raise LaunchError(
                f"SkyPilot could not restart on {previous.cluster_name}: {_first_line(e)}"
            ) from None
        return LaunchHandle(previous.cluster_name, self.name, self._node_ids(request))

    def node_disk(self, job_id: str, attempt: int, index: int) -> Path:
        raise LaunchError("SkyPilot nodes stage their checkpoint themselves: no node disk here")

    @staticmethod
    def _node_ids(request: LaunchRequest) -> tuple[str, ...]:
        # The run section names nodes the same way: <job>-a<attempt>-n<rank>.
        return tuple(
            f"{request.job_id}-a{request.attempt}-n{k}" for k in range(request.placement.num_nodes)
        )

    def status(self, handle: LaunchHandle) -> ClusterStatus:
        sky = self.sdk
        try:
            records = sky.get(sky.status(cluster_names=[handle.cluster_name]))
        except Exception as e:  # an unreadable provider is UNKNOWN, never DOWN
            return ClusterStatus(ClusterState.UNKNOWN, detail=f"sky.status: {_first_line(e)}")
        return status_from_records(handle, records)

    def down(self, handle: LaunchHandle) -> None:
        sky = self.sdk
        try:
            sky.get(sky.down(handle.cluster_name))
        except Exception as e:
            if type(e).__name__ == "ClusterDoesNotExist":
                return  # already gone: down is idempotent
            raise LaunchError(f"SkyPilot could not tear down {handle.cluster_name}: {e}") from None


def status_from_records(handle: LaunchHandle, records: Any) -> ClusterStatus:
    """Map ``sky.status`` records (StatusResponse objects or dicts) to ClusterStatus."""
    for rec in records or []:
        name = rec.get("name") if isinstance(rec, dict) else getattr(rec, "name", None)
        if name != handle.cluster_name:
            continue
        raw = rec.get("status") if isinstance(rec, dict) else getattr(rec, "status", None)
        status = str(getattr(raw, "value", raw) or "").upper()
        if status == "UP":
            return ClusterStatus(ClusterState.UP, handle.node_ids, "UP")
        if status == "INIT":
            # SkyPilot's INIT is both "still provisioning" and "some nodes are gone";
            # the agents' heartbeats tell which nodes are alive.
            return ClusterStatus(ClusterState.LAUNCHING, (), "INIT")
        if status == "STOPPED":
            return ClusterStatus(ClusterState.DOWN, (), "STOPPED")
        return ClusterStatus(ClusterState.UNKNOWN, (), f"unrecognised status {status!r}")
    return ClusterStatus(ClusterState.DOWN, (), "no such cluster")
