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
3. **submit, then poll**: ``sky.launch`` / ``sky.exec`` / ``sky.down`` are requests
   to SkyPilot's API server, which answers each with a request id at once and runs
   it in its own workers (a launch provisions for minutes). The launcher submits
   and returns the id in the handle; :meth:`SkyPilotLauncher.progress` reads the
   request's status with ``sky.api_status`` (PENDING/RUNNING -> PROVISIONING,
   SUCCEEDED -> UP, FAILED -> FAILED with the exception SkyPilot stored for it,
   which ``sky.get`` re-raises at once for a finished request). Nothing here waits
   on a request that is still running: the reconciler calls these inside its
   database transaction, under a 10 s lease. Each SDK call is bounded by a
   timeout, because the SDK's own reads have no read timeout.

Recovery is skyresume's: tasks go through ``sky.launch`` as plain clusters, never
``sky.jobs.launch``, so SkyPilot's managed-job recovery (which polls every ~15 s,
never reads spot notices and, per its issue 10021, does not block the region that
preempted it) never runs; ``retry_until_up`` stays off so a launch that cannot get
capacity fails fast and the reconciler re-plans with that region cooled down.

``sky`` is imported inside functions (about 1.5 s); nothing here runs at import.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
import shlex
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from enum import StrEnum
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
    LaunchPhase,
    LaunchProgress,
    LaunchRequest,
    TaskRejected,
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


def cluster_name_for(job_id: str, attempt: int, launch_try: int = 0) -> str:
    """``sr-<job id>-a<attempt>`` (``-t<try>`` after a failed request of the attempt):
    lower case, letters first, under 35 characters. The name is the launch's key
    (``LaunchRequest.launch_key``): SkyPilot is asked whether it holds a request for it
    before anything is submitted."""
    base = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-") or "job"
    suffix = f"-a{attempt}" + (f"-t{launch_try}" if launch_try else "")
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


def template_config(
    request: LaunchRequest,
    *,
    template: str = DEFAULT_TEMPLATE,
    templates_dir: Path = TEMPLATES_DIR,
    package: str = "skyresume",
) -> dict[str, Any]:
    """A template's task config, rendered with the run's context (SkyPilot YAML form,
    as a dict; no ``sky`` import): what every launcher runs on a node."""
    if not request.command.strip():
        raise TaskRejected("the job has no command to run under the agent")
    path = template_path(template, templates_dir)
    config = load_task_config(path, what=f"template {template!r}")
    config["name"] = cluster_name_for(request.job_id, request.attempt)
    envs = {str(k): "" if v is None else str(v) for k, v in (config.get("envs") or {}).items()}
    envs.update(run_envs(request, command=request.command, package=package))
    config["envs"] = envs
    return config


def user_yaml_config(
    path: str | Path,
    request: LaunchRequest,
    *,
    package: str = "skyresume",
    templates_dir: Path = TEMPLATES_DIR,
) -> dict[str, Any]:
    """A user's own SkyPilot task config, kept as written (name, setup, envs,
    file_mounts, workdir), with its ``run`` handed to the agent as the command: the
    node's setup (installing the agent) runs first, then the user's; ``resources``
    and ``num_nodes`` are left for the launcher to pin.

    The user's run script runs under the agent as ``bash -c '<run>'`` on every node,
    with the SKYPILOT_* variables it reads still set."""
    what = f"SkyPilot task {path}"
    user = load_task_config(Path(path), what=what)
    run = user.get("run")
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
    config.pop("resources", None)  # pinned by the launcher
    config.pop("num_nodes", None)
    return config


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
    config = template_config(request, template=template, templates_dir=templates_dir,
                             package=package)  # fmt: skip
    what = f"template {template!r}"
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
    """A user's own SkyPilot task (:func:`user_yaml_config`) as a ``sky.Task`` pinned
    to the planner's choice (which came from those same resources); SkyPilot refuses
    what it refuses in the YAML as written."""
    what = f"SkyPilot task {path}"
    task_from_config(load_task_config(Path(path), what=what), what=what)
    config = user_yaml_config(path, request, package=package, templates_dir=templates_dir)
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


#: SkyPilot's exceptions for "no capacity or quota for the resources it was given"
#: (``sky.exceptions``): with the task pinned to one placement, that placement is out
#: of stock and the job re-plans (CapacityError, ``LaunchProgress.capacity``).
CAPACITY_ERRORS = frozenset({"ResourcesUnavailableError", "InsufficientCapacityError"})

#: Raised by the SDK when its API server cannot be reached or spoken to: the request
#: was not answered, which says nothing about the task or the cluster.
_TRANSPORT_ERRORS = frozenset(
    {
        "ApiServerConnectionError",
        "ApiServerAuthenticationError",
        "APIVersionMismatchError",
        "NetworkBlocked",
    }
)


class RequestStatus(StrEnum):
    """A SkyPilot API request's status (``sky.server.requests.requests.RequestStatus``)."""

    PENDING = "PENDING"  # queued on the API server
    WAITING = "WAITING"  # parked (newer servers; older clients see RUNNING)
    RUNNING = "RUNNING"  # a worker of the API server is running it (provisioning)
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # its exception is stored with it; ``sky.get`` re-raises it
    CANCELLED = "CANCELLED"  # ``sky api cancel`` (or another client) aborted it

    def is_terminal(self) -> bool:
        return self in (RequestStatus.SUCCEEDED, RequestStatus.FAILED, RequestStatus.CANCELLED)


class SkyCallTimeout(TimeoutError):
    """An SDK call did not return within its bound (its thread is left to finish)."""


def _bounded(seconds: float, what: str, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` in a daemon thread, waited on for at most ``seconds``.

    The SDK's reads have no read timeout (``sky.get`` and ``sky.api_status`` pass
    ``timeout=(connect, None)``) and its POSTs retry transient errors with backoff:
    a hung API server would hold the reconciler's transaction, and so its lease,
    for as long as it hangs. The context is copied because the SDK keeps the
    server's API version in context variables."""
    ctx = contextvars.copy_context()
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = ctx.run(fn, *args, **kw)
        except BaseException as e:  # SkyPilot raises SystemExit on some bad input
            box["error"] = e

    thread = threading.Thread(target=call, name=f"skyresume-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise SkyCallTimeout(f"{what} did not answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _is_transport_error(e: BaseException) -> bool:
    if isinstance(e, (SkyCallTimeout, ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(e).__mro__}
    if names & _TRANSPORT_ERRORS:
        return True
    # requests' exceptions, without importing requests here
    return type(e).__module__.startswith(("requests.", "urllib3."))


def _is_capacity_error(e: BaseException) -> bool:
    return bool({c.__name__ for c in type(e).__mro__} & CAPACITY_ERRORS)


def _field(rec: Any, name: str) -> Any:
    return rec.get(name) if isinstance(rec, dict) else getattr(rec, name, None)


def _task_text(rec: Any) -> str:
    """The task YAML a request was submitted with (its body, as ``api_status`` lists
    it for the request's owner), or "" when the server did not include it."""
    try:
        body = json.loads(_field(rec, "request_body") or "null")
    except (TypeError, ValueError):
        return ""
    task = body.get("task") if isinstance(body, dict) else None
    return task if isinstance(task, str) else ""


def _names_task(rec: Any, task_name: str) -> bool:
    return re.search(rf"(?m)^name: {re.escape(task_name)}\s*$", _task_text(rec)) is not None


def _placement_of_body(rec: Any) -> str:
    """``cloud/region instance type`` from a request's task YAML (best effort)."""
    text = _task_text(rec)
    infra = re.search(r"(?m)^\s+infra: (\S+)", text)
    itype = re.search(r"(?m)^\s+instance_type: (\S+)", text)
    return " ".join(m.group(1) for m in (infra, itype) if m)


def hosts_of(result: Any) -> tuple[str, ...]:
    """Node addresses from a finished launch's result ``(job_id, handle)``: the
    handle's ``stable_internal_external_ips`` (head first), external where there is
    one; () when SkyPilot gave none."""
    handle = result[1] if isinstance(result, (tuple, list)) and len(result) == 2 else None
    pairs = getattr(handle, "stable_internal_external_ips", None) or ()
    hosts = []
    for pair in pairs:
        internal, external = (*tuple(pair), None, None)[:2]
        if external or internal:
            hosts.append(str(external or internal))
    return tuple(hosts)


class SkyPilotLauncher:
    """The Launcher protocol over the SkyPilot SDK (see the module docstring).

    Every SDK call is submitted and answered by request id, never waited on: a
    launch takes minutes and is polled with :meth:`progress`; reads are bounded by
    ``poll_timeout_s``, submissions by ``submit_timeout_s``."""

    name = "skypilot"
    #: A relaunch in place runs the task again on the same cluster (``sky.exec``);
    #: staging happens on the nodes themselves, chaos needs the local launcher.
    #: A lost node is replaced by launching the next attempt onto the same cluster:
    #: SkyPilot's provisioner keeps the instances still running and starts only the
    #: missing ones (sky/provision/aws/instance.py run_instances: count - running).
    abilities = LauncherAbilities(
        restarts_in_place=True, keeps_survivors=True, refills_clusters=True
    )

    def __init__(
        self,
        settings: Any = None,
        token_for: Callable[[str, int], str] | None = None,
        *,
        template: str = DEFAULT_TEMPLATE,
        templates_dir: Path = TEMPLATES_DIR,
        package: str = "skyresume",
        history: Callable[[], Iterable[FailureRecord]] | None = None,
        sdk: Any = None,
        poll_timeout_s: float = 5.0,
        submit_timeout_s: float = 30.0,
    ) -> None:
        self.settings = settings
        self.token_for = token_for or (lambda _job, _attempt: "")
        self.template = template
        self.templates_dir = templates_dir
        self.package = package
        self.history = history or (lambda: ())
        self._sdk = sdk
        self.poll_timeout_s = poll_timeout_s
        self.submit_timeout_s = submit_timeout_s
        #: request id -> "cloud/region instance type", for the failure message; after
        #: a service restart the request's own body says it (_placement_of_body).
        self._placements: dict[str, str] = {}

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
        """The job's ``sky.Task``, pinned to the request's placement."""
        task = task or getattr(request, "task", None)
        token = self.token_for(request.job_id, request.attempt)
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

    def node_config(
        self, request: LaunchRequest, task: TaskSpec | None = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """(the task config every node runs, its secrets), as :meth:`build` renders
        them but without SkyPilot (the local provisioner runs the same task)."""
        task = task or request.task
        token = self.token_for(request.job_id, request.attempt)
        if task is not None and task.skypilot_yaml:
            config = user_yaml_config(
                task.skypilot_yaml, request, package=self.package, templates_dir=self.templates_dir
            )
        else:
            template = (task.template if task is not None else None) or self.template
            config = template_config(
                request, template=template, templates_dir=self.templates_dir, package=self.package
            )
        secrets = {str(k): str(v) for k, v in (config.pop("secrets", None) or {}).items()}
        if token:
            secrets["SKYRESUME_AGENT_TOKEN"] = token
        return config, secrets

    def launch(self, request: LaunchRequest, task: TaskSpec | None = None) -> LaunchHandle:
        """Submit ``sky.launch`` (a plain cluster: no retry_until_up, no autostop, no
        down) and return with its request id; provisioning is polled by
        :meth:`progress`. Idempotent per job and attempt: a launch request SkyPilot
        already holds for this attempt's cluster is answered with, not submitted
        again, whatever its status (a failed attempt stays failed; the next attempt
        has a cluster name of its own). SkyPilot keeps finished requests for
        ``api_server.requests_retention_hours`` (24 h by default); the cluster's own
        status is not read here, because ``sky.status`` waits behind a busy API
        server (seconds, measured) and an unreadable one proved nothing anyway."""
        name = cluster_name_for(request.job_id, request.attempt, request.launch_try)
        p = request.placement
        where = f"{p.cloud}/{p.region} {p.instance_type}"
        sky_task = self.build(request, task or request.task)  # TaskRejected at once
        node_ids = self._node_ids(request)
        earlier = self._earlier_request(name, "sky.launch", task_name=None)
        if earlier:
            self._placements.setdefault(earlier, where)
            return LaunchHandle(name, self.name, node_ids, request_id=earlier)
        sky = self.sdk
        try:
            rid = _bounded(
                self.submit_timeout_s,
                "sky.launch",
                sky.launch,
                sky_task,
                cluster_name=name,
                retry_until_up=False,
                idle_minutes_to_autostop=None,
                down=False,
            )
        except Exception as e:
            raise _submit_error(e, f"SkyPilot could not launch {name} on {where}") from None
        self._placements[str(rid)] = where
        return LaunchHandle(name, self.name, node_ids, request_id=str(rid))

    def restart(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """Submit the new attempt's task on the cluster that is already up (``sky.exec``:
        no provisioning, no setup) and return with its request id, polled like a
        launch; the nodes are the same, the attempt is new. Idempotent per attempt:
        the task is named after the attempt, and an exec of that task SkyPilot holds
        for the cluster is answered with."""
        sky_task = self.build(request, request.task)
        cluster = previous.cluster_name
        node_ids = self._node_ids(request)
        earlier = self._earlier_request(cluster, "sky.exec", task_name=sky_task.name)
        if earlier:
            return LaunchHandle(cluster, self.name, node_ids, previous.hosts, earlier)
        sky = self.sdk
        try:
            rid = _bounded(
                self.submit_timeout_s, "sky.exec", sky.exec, sky_task, cluster_name=cluster
            )
        except Exception as e:
            raise _submit_error(e, f"SkyPilot could not restart on {cluster}") from None
        return LaunchHandle(cluster, self.name, node_ids, previous.hosts, str(rid))

    def refill(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """Submit ``sky.launch`` of the new attempt's task onto the previous attempt's
        cluster: SkyPilot keeps the nodes still running (the healthy ones), provisions
        only the missing ones, runs setup and then the task on all of them, node ranks
        and IPs its own. Polled like a launch; idempotent per attempt (the task is
        named after it)."""
        p = request.placement
        where = f"{p.cloud}/{p.region} {p.instance_type}"
        sky_task = self.build(request, request.task)
        cluster = previous.cluster_name
        node_ids = self._node_ids(request)
        earlier = self._earlier_request(cluster, "sky.launch", task_name=sky_task.name)
        if earlier:
            self._placements.setdefault(earlier, where)
            return LaunchHandle(cluster, self.name, node_ids, request_id=earlier)
        sky = self.sdk
        try:
            rid = _bounded(
                self.submit_timeout_s,
                "sky.launch",
                sky.launch,
                sky_task,
                cluster_name=cluster,
                retry_until_up=False,
                idle_minutes_to_autostop=None,
                down=False,
            )
        except Exception as e:
            raise _submit_error(e, f"SkyPilot could not refill {cluster} on {where}") from None
        self._placements[str(rid)] = where
        return LaunchHandle(cluster, self.name, node_ids, request_id=str(rid))

    def _earlier_request(self, cluster: str, kind: str, *, task_name: str | None) -> str:
        """The id of the newest ``kind`` request SkyPilot holds for ``cluster`` (and,
        for an exec, for the task named ``task_name``): an unfinished one first.
        LaunchError when SkyPilot cannot be asked: not knowing whether the request
        was already submitted must never become submitting it twice."""
        sky = self.sdk
        try:
            records = _bounded(
                self.poll_timeout_s,
                "sky.api_status",
                sky.api_status,
                cluster_name=cluster,
                all_status=True,
            )
        except Exception as e:
            raise LaunchError(
                f"cannot tell whether SkyPilot already has a {kind} of {cluster} "
                f"(sky.api_status: {_first_line(e)}); not submitting it again blind"
            ) from None
        mine = [
            r
            for r in records or []
            if _field(r, "name") == kind
            and _field(r, "cluster_name") == cluster  # older servers ignore the filter
            and (task_name is None or _names_task(r, task_name))
        ]
        if not mine:
            return ""

        def rank(r: Any) -> tuple[bool, float]:
            unfinished = str(_field(r, "status")) in ("PENDING", "WAITING", "RUNNING")
            return (unfinished, float(_field(r, "created_at") or 0.0))

        return str(_field(max(mine, key=rank), "request_id"))

    def progress(self, handle: LaunchHandle) -> LaunchProgress:
        """Where the launch (or exec) request of ``handle`` is, read without waiting:
        ``sky.api_status`` for its status, and ``sky.get`` only once it is finished
        (the server answers a finished request at once). Never raises."""
        try:
            if not handle.request_id:
                return self._progress_from_cluster(handle)
            return self._progress_of_request(handle)
        # SkyPilot raises SystemExit on some input; progress must still answer.
        except (Exception, SystemExit) as e:  # a provider that cannot be read is not a dead cluster
            return LaunchProgress(LaunchPhase.UNKNOWN, f"SkyPilot: {_first_line(e)}")

    def _progress_of_request(self, handle: LaunchHandle) -> LaunchProgress:
        sky, rid = self.sdk, handle.request_id
        records = _bounded(self.poll_timeout_s, "sky.api_status", sky.api_status, request_ids=[rid])
        rec = next((r for r in records or [] if _field(r, "request_id") == rid), None)
        if rec is None:
            # The SDK answers [] when a local API server is not running; a server can
            # also have dropped old requests. Neither says the launch failed.
            return LaunchProgress(
                LaunchPhase.UNKNOWN, f"SkyPilot lists no request {rid} for {handle.cluster_name}"
            )
        raw = str(_field(rec, "status") or "")
        try:
            status = RequestStatus(raw)
        except ValueError:
            return LaunchProgress(LaunchPhase.UNKNOWN, f"request {rid}: unknown status {raw!r}")
        kind = str(_field(rec, "name") or "request")
        if not status.is_terminal():
            msg = _field(rec, "status_msg")
            detail = f"{kind} {rid} {status.value}" + (f": {msg}" if msg else "")
            return LaunchProgress(LaunchPhase.PROVISIONING, detail)
        if status is RequestStatus.CANCELLED:
            return LaunchProgress(
                LaunchPhase.FAILED, f"{kind} of {handle.cluster_name} was cancelled ({rid})"
            )
        try:
            result = _bounded(self.poll_timeout_s, "sky.get", sky.get, rid)
        except Exception as e:
            if _is_transport_error(e):
                return LaunchProgress(LaunchPhase.UNKNOWN, f"sky.get {rid}: {_first_line(e)}")
            if status is RequestStatus.SUCCEEDED:  # it succeeded, its result is unreadable
                return LaunchProgress(LaunchPhase.UP, f"{kind} {rid} SUCCEEDED")
            return self._failed(handle, rec, e)
        if status is RequestStatus.FAILED:  # listed failed, yet get returned
            return LaunchProgress(LaunchPhase.FAILED, f"{kind} {rid} FAILED")
        return LaunchProgress(LaunchPhase.UP, f"{kind} {rid} SUCCEEDED", hosts=hosts_of(result))

    def _failed(self, handle: LaunchHandle, rec: Any, e: BaseException) -> LaunchProgress:
        cluster = handle.cluster_name
        if _field(rec, "name") == "sky.exec":
            what = f"SkyPilot could not restart on {cluster}"
        else:
            where = self._placements.get(handle.request_id) or _placement_of_body(rec)
            what = f"SkyPilot could not launch {cluster}" + (f" on {where}" if where else "")
        return LaunchProgress(
            LaunchPhase.FAILED,
            f"{what}: {type(e).__name__}: {_first_line(e)}",
            capacity=_is_capacity_error(e),
        )

    def _progress_from_cluster(self, handle: LaunchHandle) -> LaunchProgress:
        st = self.status(handle)
        if st.state is ClusterState.UP:
            return LaunchProgress(LaunchPhase.UP, f"cluster {handle.cluster_name} is UP")
        if st.state is ClusterState.LAUNCHING:
            return LaunchProgress(LaunchPhase.PROVISIONING, f"cluster {handle.cluster_name} INIT")
        if st.state is ClusterState.DOWN:
            return LaunchProgress(LaunchPhase.FAILED, f"cluster {handle.cluster_name}: {st.detail}")
        return LaunchProgress(LaunchPhase.UNKNOWN, st.detail)

    def node_disk(self, job_id: str, attempt: int, index: int) -> Path:
        raise LaunchError("SkyPilot nodes stage their checkpoint themselves: no node disk here")

    @staticmethod
    def _node_ids(request: LaunchRequest) -> tuple[str, ...]:
        # The run section names nodes the same way: <job>-a<attempt>-n<rank>.
        return tuple(
            f"{request.job_id}-a{request.attempt}-n{k}" for k in range(request.placement.num_nodes)
        )

    def status(self, handle: LaunchHandle) -> ClusterStatus:
        """``sky.status`` of the cluster (SkyPilot's cached record, no cloud refresh),
        submitted and answered within ``poll_timeout_s`` each."""
        sky = self.sdk
        try:
            rid = _bounded(
                self.poll_timeout_s,
                "sky.status",
                sky.status,
                cluster_names=[handle.cluster_name],
            )
            records = _bounded(self.poll_timeout_s, "sky.get", sky.get, rid)
        except Exception as e:  # an unreadable provider is UNKNOWN, never DOWN
            return ClusterStatus(ClusterState.UNKNOWN, detail=f"sky.status: {_first_line(e)}")
        return status_from_records(handle, records)

    def down(self, handle: LaunchHandle) -> None:
        """Submit ``sky.down`` and return: the teardown takes minutes and is SkyPilot's
        to finish (``status`` shows it gone). Idempotent: a teardown SkyPilot is
        already running for the cluster is not submitted again, and a cluster that
        does not exist is already down. LaunchError when it could not be submitted."""
        sky = self.sdk
        name = handle.cluster_name
        try:
            active = _bounded(
                self.poll_timeout_s, "sky.api_status", sky.api_status, cluster_name=name
            )
        except Exception:
            active = []  # unreadable: submitting a second down is harmless, missing one is not
        if any(
            _field(r, "name") == "sky.down" and _field(r, "cluster_name") == name
            for r in active or []
        ):
            return
        try:
            _bounded(self.submit_timeout_s, "sky.down", sky.down, name)
        except Exception as e:
            if type(e).__name__ == "ClusterDoesNotExist":
                return  # already gone: down is idempotent
            raise LaunchError(f"SkyPilot could not tear down {name}: {_first_line(e)}") from None


def _submit_error(e: BaseException, what: str) -> LaunchError:
    """The error for a request SkyPilot did not accept: CapacityError for a stockout,
    TaskRejected for what SkyPilot's validation refused, LaunchError otherwise (an
    API server that could not be reached or did not answer in time)."""
    text = f"{what}: {_first_line(e)}"
    if _is_capacity_error(e):
        return CapacityError(text)
    if isinstance(e, SkyCallTimeout):
        return LaunchError(f"{text} (it may have been submitted: the next launch asks first)")
    if _is_transport_error(e):
        return LaunchError(text)
    if isinstance(e, (ValueError, TypeError, KeyError, AssertionError, SystemExit)) or (
        type(e).__module__.startswith("sky.") or "jsonschema" in type(e).__module__
    ):
        return TaskRejected(f"{what}: SkyPilot rejected it: {_first_line(e)}")
    return LaunchError(text)


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
