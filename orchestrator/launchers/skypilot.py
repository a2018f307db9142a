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
   optimizer has nothing left to choose and cannot wander to another region; the
   rest of the chosen resource option (image, disk, ports, labels...) is kept
   (:func:`pinned_resources`), and a task whose nodes would have no torch is
   refused (:func:`require_node_image`);
3. **submit, then poll**: ``sky.launch`` / ``sky.exec`` / ``sky.down`` are requests
   to SkyPilot's API server, which answers each with a request id at once and runs
   it in its own workers (a launch provisions for minutes). The launcher submits
   and returns the id in the handle; :meth:`SkyPilotLauncher.progress` reads the
   request's status with ``sky.api_status`` (PENDING/RUNNING -> PROVISIONING,
   FAILED -> FAILED with the exception SkyPilot stored for it, which ``sky.get``
   re-raises at once for a finished request; SUCCEEDED means the job is queued, so
   then the job's own status: RUNNING -> UP, FAILED_SETUP -> FAILED). Nothing here waits
   on a request that is still running: the reconciler calls these inside its
   database transaction, under a 10 s lease. Each SDK call is bounded by a
   timeout, because the SDK's own reads have no read timeout.

Recovery is skyresume's: tasks go through ``sky.launch`` as plain clusters, never
``sky.jobs.launch``, so SkyPilot's managed-job recovery (which polls every ~15 s,
never reads spot notices and, per its issue 10021, does not block the region that
preempted it) never runs; ``retry_until_up`` stays off so a launch that cannot get
capacity fails fast and the reconciler re-plans with that region cooled down.
A refill or a restart in place is refused (RefillRefused, RestartRefused) where
SkyPilot would run it on the wrong VMs or beside an old job; the reconciler then
launches fresh. SkyPilot's behaviour this relies on, with ``sky/...`` references:
``../shared/SKYPILOT.md``; what the launcher does about it: docs/planner.md.

``sky`` is imported inside functions (about 1.5 s); nothing here runs at import.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import os
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from orchestrator.cloud.metadata import DEFAULT_ENDPOINTS
from orchestrator.contract import PROVIDERS, Env, Provider
from orchestrator.domain.plan import Placement
from orchestrator.domain.planner import Candidate, FailureRecord
from orchestrator.domain.reconcile import LauncherAbilities
from orchestrator.domain.spec import JobSpec, SpecError, TaskSpec, load_yaml_document
from orchestrator.launchers.base import (
    CapacityError,
    ClusterState,
    ClusterStatus,
    DownResult,
    LaunchError,
    LaunchHandle,
    LaunchPhase,
    LaunchProgress,
    LaunchRequest,
    RefillRefused,
    RestartRefused,
    SubmitUncertain,
    TaskRejected,
)


def _templates_dir(module: Path = Path(__file__)) -> Path:
    """The task templates: inside the package where the service was installed from
    its wheel, which ships them as ``orchestrator/_task_templates`` (pyproject's
    force-include), else beside it in a checkout (``task_templates/``)."""
    here = module.resolve()
    packaged = here.parents[1] / "_task_templates"
    if packaged.is_dir():
        return packaged
    return here.parents[2] / "task_templates"


TEMPLATES_DIR = _templates_dir()
DEFAULT_TEMPLATE = "skypilot-gpu"

#: What the service's own SkyPilot client runs with (:func:`sky_client_environment`):
#: no usage telemetry (nodes and services often have no internet; every SDK call is a
#: ``usage_lib.entrypoint``), and never a local API server started behind our back by
#: ``check_server_healthy_or_start`` (sky/server/common.py): a fresh server has a new,
#: empty request database, so every request id the store holds would be lost.
SKY_CLIENT_ENV = {
    "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
    "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1",
}

#: The agent's node directory, per attempt and try (``~`` is the node's home): two
#: agents on one node (an old job SkyPilot had not cancelled yet) never share one.
#: The agent reads it as ``NodeEnv.NODE_DIR`` (the agent package is stdlib only, so
#: the name is repeated here rather than imported from it).
NODE_DIR_ENV = "SKYRESUME_NODE_DIR"

#: Leak backstop: every launch asks SkyPilot to tear the cluster down after this long
#: with no job running (autodown; spot clusters cannot autostop). A live attempt always
#: has its agent's job running, so only an abandoned cluster idles this long.
AUTODOWN_IDLE_MINUTES = 60


def sky_client_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Set :data:`SKY_CLIENT_ENV` in the service's environment (an operator's own value
    wins). Called where the service builds this launcher, never at import: a test or
    tool that starts its own local API server must still be able to."""
    env = os.environ if environ is None else environ
    for k, v in SKY_CLIENT_ENV.items():
        env.setdefault(k, v)


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


def task_name_for(request: LaunchRequest) -> str:
    """The SkyPilot task's name: its cluster's name for this try (``-t<try>`` after a
    failed request of the attempt). A refill or an exec runs on the *previous* cluster,
    so this name is what keys them per try: an earlier request is adopted only when it
    is of the same try, never a failed one of the try before."""
    return cluster_name_for(request.job_id, request.attempt, request.launch_try)


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
    # The agent polls its cloud's real metadata endpoint; a cloud whose notices it cannot
    # read (kubernetes, lambda...) runs with notices off, never with another's poller.
    provider = p.cloud if p.cloud in PROVIDERS else "none"
    metadata_url = DEFAULT_ENDPOINTS[Provider(provider)] if provider != "none" else ""
    env.update(
        {
            "SKYRESUME_PACKAGE": package,
            "SKYRESUME_COMMAND": command,
            "SKYRESUME_RANKS_PER_NODE": str(request.ranks_per_node),
            "SKYRESUME_PROVIDER": provider,
            "SKYRESUME_METADATA_URL": metadata_url,
            "SKYRESUME_GRACE_S": f"{request.grace_s:g}",
            NODE_DIR_ENV: f"~/skyresume/{task_name_for(request)}",
            # Nodes often have no internet: SkyPilot's own code on them sends no telemetry.
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
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
    except ImportError as e:  # e.g. infra: k8s without SkyPilot's kubernetes extra
        raise TaskRejected(f"{what}: SkyPilot cannot check it here: {_first_line(e)}") from None
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

    from orchestrator.launchers.catalog import offline_clouds

    # Parsing asks SkyPilot for the enabled clouds (``ports:`` does): offline, they
    # are the clouds with a catalog here, never a "run sky check".
    with offline_clouds(), _sky_errors(what):
        task = sky.Task.from_yaml_config(
            dict(config), secrets_overrides=list((secrets or {}).items()) or None
        )
        task.validate(skip_file_mounts=True, skip_workdir=True)
    return task


#: Resource fields the placement decides: replaced when a task is pinned. Everything
#: else the user wrote in the chosen option (image_id, disk_size, disk_tier, ports,
#: labels, cpus, memory, autostop, network_tier, accelerator_args...) is kept.
_PLACEMENT_FIELDS = frozenset(
    {"infra", "cloud", "region", "zone", "instance_type", "accelerators", "use_spot",
     "spot_recovery", "job_recovery", "any_of", "ordered"}
)  # fmt: skip


def resource_options(resources: Any) -> list[dict[str, Any]]:
    """A task's ``resources`` section as its options, each as SkyPilot merges it: the
    section's own fields, overridden by each ``any_of`` / ``ordered`` entry's."""
    if not isinstance(resources, dict) or not resources:
        return [{}]
    base = {k: v for k, v in resources.items() if k not in ("any_of", "ordered")}
    entries = resources.get("any_of") or resources.get("ordered")
    if not isinstance(entries, list) or not entries:
        return [base]
    return [{**base, **e} if isinstance(e, dict) else dict(base) for e in entries]


def _offers(option: dict[str, Any], p: Placement) -> int:
    """How well a resource option names the placement: 2 when it (or one of the
    resources it expands to) is the placement's accelerator on the placement's
    cloud/region/zone/instance type, 1 when only its cloud agrees, 0 otherwise."""
    import sky

    try:
        expanded = sky.Resources.from_yaml_config(dict(option))
    except Exception:  # the task itself is validated elsewhere, with its error
        return 0
    best = 0
    for r in expanded if isinstance(expanded, (set, list)) else [expanded]:
        cloud = str(r.cloud).lower() if r.cloud is not None else None
        if cloud not in (None, p.cloud):
            continue
        accels = {str(k).lower(): int(v) for k, v in (r.accelerators or {}).items()}
        want = {p.accelerator.lower(): p.accelerator_count} if p.accelerator else {}
        same = (
            accels == want
            and r.region in (None, p.region)
            and (r.zone in (None, p.zone))
            and r.instance_type in (None, p.instance_type)
        )
        best = max(best, 2 if same else 1)
    return best


def pinned_resources(
    resources: Any, placement: Placement, *, image_id: str | None = None
) -> dict[str, Any]:
    """The resources section that pins ``placement``, built on the task's own option
    that offers it (the first, in the order written): the user's image, disk, ports,
    labels, cpus/memory and autostop survive; only where and what is replaced.
    ``image_id`` (the operator's default node image) fills in where the option has none."""
    options = resource_options(resources)
    scored = [(_offers(o, placement), -i, o) for i, o in enumerate(options)]
    score, _, option = max(scored, key=lambda t: (t[0], t[1]))
    # An option of another cloud carries nothing: its image or disk tier means nothing here.
    kept = {k: v for k, v in option.items() if k not in _PLACEMENT_FIELDS} if score else {}
    if image_id and not kept.get("image_id"):
        kept["image_id"] = image_id
    return {**kept, **resources_for(placement)}


#: A setup that installs torch itself (any pip/uv/conda line naming it).
_INSTALLS_TORCH = re.compile(r"(?m)^[^#\n]*\b(pip|uv|conda|mamba)\b[^#\n]*\btorch\b")


def require_node_image(config: dict[str, Any], what: str) -> None:
    """Refuse a task whose nodes would have no torch: SkyPilot's default images
    (Ubuntu 22.04, Python 3.10: enough for the agent, which runs on 3.9-3.13) have
    pip but not torch, and the agent starts training under torchrun. So either the
    pinned resources name an image (``image_id``, or ``image_id: docker:<image>``), or
    the setup installs torch."""
    res = config.get("resources")
    if isinstance(res, dict) and res.get("image_id"):
        return
    if _INSTALLS_TORCH.search(str(config.get("setup") or "")):
        return
    raise TaskRejected(
        f"{what}: no node image is named, and SkyPilot's default image has no torch "
        "(the agent runs every rank under torchrun). Set resources.image_id in the "
        "SkyPilot YAML (an image with Python 3.9+ and torch; image_id: docker:<image> "
        "for a container), or SKYRESUME_SKYPILOT_IMAGE_ID for every job, or install "
        "torch in the task's setup"
    )


def _pin(
    config: dict[str, Any], request: LaunchRequest, what: str, *,
    image_id: str | None = None, require_image: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """``config`` with its resources pinned to the request's placement (and its
    num_nodes), as SkyPilot YAML: what :func:`task_from_config` then loads."""
    pinned = dict(config)
    pinned["resources"] = pinned_resources(config.get("resources"), request.placement,
                                           image_id=image_id)  # fmt: skip
    pinned["num_nodes"] = request.placement.num_nodes
    if require_image:
        require_node_image(pinned, what)
    return pinned


def _validate_pinned(task: Any, request: LaunchRequest, what: str) -> Any:
    with _sky_errors(f"{what}: pinning {request.placement.instance_type}"):
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
    config["name"] = task_name_for(request)
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
    envs: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A user's own SkyPilot task config, kept as written (name, setup, envs,
    file_mounts, workdir, resources), with its ``run`` handed to the agent as the
    command: the node's setup (installing the agent) runs first, then the user's; the
    launcher pins ``resources`` (keeping the chosen option's own fields) and
    ``num_nodes``.

    The user's run script runs under the agent as ``bash -c '<run>'`` on every node,
    with the SKYPILOT_* variables it reads still set."""
    what = f"SkyPilot task {path}"
    envs_given = envs
    user = load_task_config(Path(path), what=what)
    run = user.get("run")
    if not isinstance(run, str) or not run.strip():
        raise TaskRejected(f"{what}: it has no run section for the agent to start")
    node = load_task_config(template_path(DEFAULT_TEMPLATE, templates_dir), what="template")
    config = dict(user)
    config["name"] = task_name_for(request)
    envs = {str(k): "" if v is None else str(v) for k, v in (node.get("envs") or {}).items()}
    envs.update({str(k): "" if v is None else str(v) for k, v in (user.get("envs") or {}).items()})
    envs.update(envs_given or {})  # the job spec's task.envs (--env) win over the YAML's
    envs.update(run_envs(request, command=f"bash -c {shlex.quote(run)}", package=package))
    config["envs"] = envs
    user_setup = user.get("setup") or ""
    config["setup"] = f"{node['setup'].rstrip()}\n{user_setup}".rstrip() + "\n"
    config["run"] = node["run"]
    return config


def build_task(
    request: LaunchRequest,
    *,
    template: str = DEFAULT_TEMPLATE,
    templates_dir: Path = TEMPLATES_DIR,
    token: str = "",
    package: str = "skyresume",
    image_id: str | None = None,
    require_image: bool = False,
) -> Any:
    """A ``sky.Task`` from a template, rendered with the run's context and pinned to
    the request's placement. Raises TaskRejected naming what SkyPilot refused (and,
    with ``require_image``, a task whose nodes would have no torch)."""
    config = template_config(request, template=template, templates_dir=templates_dir,
                             package=package)  # fmt: skip
    what = f"template {template!r}"
    config = _pin(config, request, what, image_id=image_id, require_image=require_image)
    secrets = {"SKYRESUME_AGENT_TOKEN": token} if token else None
    task = task_from_config(config, what=what, secrets=secrets)
    return _validate_pinned(task, request, what)


def build_task_from_user_yaml(
    path: str | Path,
    request: LaunchRequest,
    *,
    token: str = "",
    package: str = "skyresume",
    templates_dir: Path = TEMPLATES_DIR,
    image_id: str | None = None,
    require_image: bool = False,
    envs: dict[str, str] | None = None,
    secrets: dict[str, str] | None = None,
) -> Any:
    """A user's own SkyPilot task (:func:`user_yaml_config`) as a ``sky.Task`` pinned
    to the planner's choice (which came from those same resources), the chosen
    option's own fields kept; SkyPilot refuses what it refuses in the YAML as written."""
    what = f"SkyPilot task {path}"
    given = load_task_config(Path(path), what=what)
    if envs:
        given["envs"] = {**(given.get("envs") or {}), **envs}
    task_from_config(given, what=what, secrets=secrets)
    config = user_yaml_config(path, request, package=package, templates_dir=templates_dir,
                              envs=envs)  # fmt: skip
    config = _pin(config, request, what, image_id=image_id, require_image=require_image)
    all_secrets = {**(secrets or {}), **({"SKYRESUME_AGENT_TOKEN": token} if token else {})}
    task = task_from_config(config, what=what, secrets=all_secrets or None)
    return _validate_pinned(task, request, what)


def task_yaml(task: Any) -> str:
    """The task as SkyPilot will read it: ``sky.Task.to_yaml_config`` (what the SDK
    dumps into the request it sends), secrets redacted, SkyPilot's private keys out."""
    import yaml

    config = task.to_yaml_config(use_user_specified_yaml=False)
    config = {k: v for k, v in config.items() if not str(k).startswith("_")}
    if config.get("secrets"):
        config["secrets"] = {k: "<redacted>" for k in config["secrets"]}
    return str(yaml.safe_dump(config, sort_keys=False, default_flow_style=False))


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


#: A stockout as SkyPilot records it: the exceptions its failover loop met on the way
#: (``ResourcesUnavailableError.failover_history``, sky/exceptions.py). Only these,
#: met in that history, say "no capacity here"; a ResourcesUnavailableError is also
#: raised for bad credentials or configs, an unsupported request, a catalog or image
#: problem (sky/backends/cloud_vm_ray_backend.py), which re-planning cannot fix.
_NOT_CAPACITY = frozenset(
    {
        "ProvisionUnsupportedError",
        "InvalidClusterNameError",
        "NotSupportedError",
        "CloudUserIdentityError",
        "InvalidCloudCredentials",
        "InvalidCloudConfigs",
    }
)
#: SkyPilot's own wording for the credential and config cases it wraps in a
#: ResourcesUnavailableError (sky/backends/cloud_vm_ray_backend.py, _retry_zones).
_NOT_CAPACITY_TEXT = ("invalid cloud credentials", "invalid cloud config")

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
#: What ``check_server_healthy_or_start`` raises (a RuntimeError) where the service's
#: SKYPILOT_DISABLE_LOCAL_API_SERVER=1 stopped it from starting a local API server:
#: the server is down, which is a transport failure like any other.
_NO_LOCAL_SERVER_TEXT = "starting a local API server on this machine is disabled"


def is_stop_failover(e: BaseException) -> bool:
    """SkyPilot's ``StopFailoverError`` (sky/provision/common.py): a provision of an
    ever-up cluster failed and the cluster could not be stopped afterwards (AWS refuses
    to stop spot instances): the refill found no capacity. The class is not in
    ``sky.exceptions``, so the client's ``deserialize_exception`` cannot rebuild it and
    hands over a plain ``Exception('StopFailoverError: <message>')`` instead."""
    if "StopFailoverError" in {c.__name__ for c in type(e).__mro__}:
        return True
    return type(e) is Exception and str(e).startswith("StopFailoverError:")


def is_capacity_error(e: BaseException) -> bool:
    """Whether a launch failed for want of capacity or quota where it was pinned.

    - ``StopFailoverError``: a refill's stockout (:func:`is_stop_failover`);
    - ``ResourcesUnavailableError`` with a ``failover_history``: capacity when some
      entry of it is a ResourcesUnavailableError of its own (a zone or region that
      could not provision) and not one of SkyPilot's credential or config wrappers;
      a history of only unsupported requests, bad names or identities is not;
    - ``ResourcesUnavailableError`` with no history: SkyPilot raised it before trying
      anything (the optimizer found the pinned offering unavailable, or an ever-up
      cluster's "previous status ... sky start" after its refill failed): capacity of
      this placement, so the job re-plans elsewhere.
    """
    if is_stop_failover(e):
        return True
    names = {c.__name__ for c in type(e).__mro__}
    if "ResourcesUnavailableError" not in names:
        return False
    if any(t in str(e).lower() for t in _NOT_CAPACITY_TEXT):
        return False
    history = list(getattr(e, "failover_history", None) or [])
    if not history:
        return True
    return any(_capacity_entry(h) for h in history)


def _capacity_entry(h: BaseException) -> bool:
    names = {c.__name__ for c in type(h).__mro__}
    if names & _NOT_CAPACITY:
        return False
    if is_stop_failover(h):
        return True
    return "ResourcesUnavailableError" in names and not any(
        t in str(h).lower() for t in _NOT_CAPACITY_TEXT
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


class JobStatus(StrEnum):
    """A job's status on a cluster (``sky.skylet.job_lib.JobStatus``): a launch or an
    exec request succeeds once its job is *queued*; setup and run happen inside it."""

    INIT = "INIT"
    PENDING = "PENDING"  # waiting for resources: behind another job on the cluster
    SETTING_UP = "SETTING_UP"
    RUNNING = "RUNNING"
    FAILED_DRIVER = "FAILED_DRIVER"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # run exited non-zero (the agent reports why itself)
    FAILED_SETUP = "FAILED_SETUP"
    CANCELLED = "CANCELLED"


class SkyCallTimeout(TimeoutError):
    """An SDK call did not return within its bound (its thread is left to finish)."""


class _Call:
    """One SDK call in a daemon thread of its own (see :func:`_bounded`); kept by the
    launcher when it outlives its bound, so a late answer is still adopted."""

    def __init__(self, what: str, fn: Callable[..., Any], args: Any, kw: Any) -> None:
        ctx = contextvars.copy_context()
        self.box: dict[str, Any] = {}

        def call() -> None:
            try:
                self.box["value"] = ctx.run(fn, *args, **kw)
            except BaseException as e:  # SkyPilot raises SystemExit on some bad input
                self.box["error"] = e

        self.thread = threading.Thread(target=call, name=f"skyresume-{what}", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self) -> Any:
        if "error" in self.box:
            raise self.box["error"]
        return self.box.get("value")


def _bounded(seconds: float, what: str, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` in a daemon thread, waited on for at most ``seconds``.

    The SDK's reads have no read timeout (``sky.get`` and ``sky.api_status`` pass
    ``timeout=(connect, None)``) and its POSTs retry transient errors with backoff:
    a hung API server would hold the reconciler's transaction, and so its lease,
    for as long as it hangs. The context is copied because the SDK keeps the
    server's API version in context variables."""
    call = _Call(what, fn, args, kw)
    call.thread.join(seconds)
    if not call.done():
        e = SkyCallTimeout(f"{what} did not answer within {seconds:g} s")
        e.call = call  # type: ignore[attr-defined]
        raise e
    return call.result()


def _is_transport_error(e: BaseException) -> bool:
    if isinstance(e, (SkyCallTimeout, ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(e).__mro__}
    if names & _TRANSPORT_ERRORS:
        return True
    if isinstance(e, RuntimeError) and _NO_LOCAL_SERVER_TEXT in str(e):
        return True
    # requests' exceptions, without importing requests here
    return type(e).__module__.startswith(("requests.", "urllib3."))


def _field(rec: Any, name: str) -> Any:
    return rec.get(name) if isinstance(rec, dict) else getattr(rec, name, None)


def _value(raw: Any) -> str:
    """An enum's value (SkyPilot's ClusterStatus, JobStatus) or a plain string, upper."""
    return str(getattr(raw, "value", raw) or "").upper()


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


def job_of(result: Any) -> int | None:
    """The job id of a finished launch's or exec's result ``(job_id, handle)``."""
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], int):
        return int(result[0])
    return None


def _lost_nodes(rec: Any) -> bool:
    """A cluster record SkyPilot refreshed to INIT because some (not all) of its nodes
    were terminated (sky/backends/backend_utils.py: "one or more nodes terminated";
    ``init_kind`` "unhealthy" in 0.14's StatusResponse)."""
    if _value(_field(rec, "status")) != "INIT":
        return False
    reason = str(_field(rec, "init_status_reason") or "")
    return "nodes terminated" in reason


def _package_of(rec: Any) -> str | None:
    """The agent package the cluster's last launch installed (``SKYRESUME_PACKAGE`` in
    the task YAML SkyPilot keeps as ``last_creation_yaml``); None when not known."""
    import yaml

    text = _field(rec, "last_creation_yaml")
    if not isinstance(text, str) or not text:
        return None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    envs = doc.get("envs") if isinstance(doc, dict) else None
    value = envs.get("SKYRESUME_PACKAGE") if isinstance(envs, dict) else None
    return str(value) if value is not None else None


class SkyPilotLauncher:
    """The Launcher protocol over the SkyPilot SDK (see the module docstring).

    Every SDK call is submitted and answered by request id, never waited on: a
    launch takes minutes and is polled with :meth:`progress`; reads are bounded by
    ``poll_timeout_s``, submissions by ``submit_timeout_s``. Cluster records come
    from one ``sky.status()`` of every cluster, read at most every ``status_ttl_s``
    and shared by all jobs (each call is a request SkyPilot persists)."""

    name = "skypilot"
    #: A relaunch in place runs the task again on the same cluster (``sky.exec``);
    #: staging happens on the nodes themselves, chaos needs the local launcher.
    #: A lost node is replaced by launching the next attempt onto the same cluster:
    #: SkyPilot's provisioner keeps the instances still running and starts only the
    #: missing ones (sky/provision/aws/instance.py run_instances: count - running).
    #: Either may be refused (RefillRefused, RestartRefused): then a fresh launch.
    abilities = LauncherAbilities(
        restarts_in_place=True, keeps_survivors=True, refills_clusters=True, confirms_down=True
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
        image_id: str | None = None,
        status_ttl_s: float = 20.0,
        job_poll_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
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
        #: The node image for tasks that name none (SKYRESUME_SKYPILOT_IMAGE_ID).
        self.image_id = image_id or getattr(settings, "skypilot_image_id", None) or None
        self.status_ttl_s = status_ttl_s
        self.job_poll_s = job_poll_s
        self.clock = clock
        #: request id -> "cloud/region instance type", for the failure message; after
        #: a service restart the request's own body says it (_placement_of_body).
        self._placements: dict[str, str] = {}
        self._lock = threading.Lock()
        #: (read at, {cluster name: record}) of the last ``sky.status()``.
        self._records: tuple[float, dict[str, Any]] | None = None
        #: A finished request's result never changes: read once.
        self._results: dict[str, Any] = {}
        #: (cluster, job id) -> (read at, progress): a job's status, polled at most
        #: every ``job_poll_s`` however often the reconciler asks.
        self._jobs: dict[tuple[str, int], tuple[float, LaunchProgress]] = {}
        #: Submissions that outlived their bound, by key: their late answer is adopted,
        #: and nothing is submitted again for the key while one may still land.
        self._late: dict[str, _Call] = {}

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
            gather_candidates,
            oracle_for_task,
        )

        try:
            if spec.task.skypilot_yaml and not spec.accelerator_names:
                # The accelerators live in the user's YAML: plan its own options.
                what = f"SkyPilot task {spec.task.skypilot_yaml}"
                config = load_task_config(Path(spec.task.skypilot_yaml), what=what)
                sky_task = task_from_config(config, what=what)
                # SkyPilot's own optimizer decides what is launchable (oracle_for_task).
                return list(oracle_for_task(sky_task, clouds=spec.clouds).candidates)
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
        """The job's ``sky.Task``, pinned to the request's placement; TaskRejected for
        a task whose nodes would have no torch (:func:`require_node_image`)."""
        task = task or getattr(request, "task", None)
        token = self.token_for(request.job_id, request.attempt)
        if task is not None and task.skypilot_yaml:
            return build_task_from_user_yaml(
                task.skypilot_yaml,
                request,
                token=token,
                package=self.package,
                templates_dir=self.templates_dir,
                image_id=self.image_id,
                require_image=True,
                envs=dict(getattr(task, "envs", None) or {}),
                secrets=dict(getattr(task, "secrets", None) or {}),
            )
        template = (task.template if task is not None else None) or self.template
        return build_task(
            request,
            template=template,
            templates_dir=self.templates_dir,
            token=token,
            package=self.package,
            image_id=self.image_id,
            require_image=True,
        )

    def render_yaml(self, request: LaunchRequest, task: TaskSpec | None = None) -> str:
        """The SkyPilot task YAML a launch of ``request`` would submit, as SkyPilot
        reads it (:func:`task_yaml`): nothing is asked of SkyPilot's API server."""
        return task_yaml(self.build(request, task))

    def node_config(
        self, request: LaunchRequest, task: TaskSpec | None = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """(the task config every node runs, its secrets), as :meth:`build` renders
        them but without SkyPilot (the local provisioner runs the same task)."""
        task = task or request.task
        token = self.token_for(request.job_id, request.attempt)
        if task is not None and task.skypilot_yaml:
            config = user_yaml_config(
                task.skypilot_yaml, request, package=self.package,
                templates_dir=self.templates_dir, envs=dict(getattr(task, "envs", None) or {}),
            )  # fmt: skip
        else:
            template = (task.template if task is not None else None) or self.template
            config = template_config(
                request, template=template, templates_dir=self.templates_dir, package=self.package
            )
        secrets = {str(k): str(v) for k, v in (config.pop("secrets", None) or {}).items()}
        secrets.update(getattr(task, "secrets", None) or {})
        if token:
            secrets["SKYRESUME_AGENT_TOKEN"] = token
        return config, secrets

    def launch(self, request: LaunchRequest, task: TaskSpec | None = None) -> LaunchHandle:
        """Submit ``sky.launch`` of a new cluster (no retry_until_up; autodown after
        :data:`AUTODOWN_IDLE_MINUTES` idle, a backstop against leaks) and return with
        its request id; provisioning is polled by :meth:`progress`. Idempotent per
        launch key (job, attempt, try: the cluster's name): a launch request SkyPilot
        already holds for it is answered with, not submitted again, whatever its
        status (a failed try stays failed; the next try has a cluster of its own).
        SubmitUncertain when SkyPilot could not be asked, or the submission did not
        answer in time: ask again with the same key."""
        name = self.cluster_for(request)
        p = request.placement
        where = f"{p.cloud}/{p.region} {p.instance_type}"
        sky_task = self.build(request, task or request.task)  # TaskRejected at once
        node_ids = self._node_ids(request)
        earlier = self._earlier_request(name, "sky.launch", task_name=None)
        if earlier:
            self._placements.setdefault(earlier, where)
            return LaunchHandle(name, self.name, node_ids, request_id=earlier)
        rid = self._submit(
            name, f"SkyPilot could not launch {name} on {where}", "sky.launch", "launch",
            sky_task, cluster_name=name, **self._launch_flags(sky_task),
        )  # fmt: skip
        self._placements[rid] = where
        return LaunchHandle(name, self.name, node_ids, request_id=rid)

    def cluster_for(self, request: LaunchRequest) -> str:
        """The cluster a launch of ``request`` makes (its key): one per attempt and try
        here; one per node in ``skypilot_grouping.SkyPilotNodeLauncher``."""
        return cluster_name_for(request.job_id, request.attempt, request.launch_try)

    @staticmethod
    def _launch_flags(sky_task: Any) -> dict[str, Any]:
        """sky.launch's flags: never retry_until_up (a stockout fails fast and the job
        re-plans), and autodown as a leak backstop unless the user's resources set
        their own autostop (which sky.launch then applies)."""
        own = any(getattr(r, "autostop_config", None) is not None for r in sky_task.resources)
        if own:
            return {"retry_until_up": False, "idle_minutes_to_autostop": None, "down": False}
        return {
            "retry_until_up": False,
            "idle_minutes_to_autostop": AUTODOWN_IDLE_MINUTES,
            "down": True,
        }

    def _submit(self, key: str, what: str, kind: str, attr: str, *args: Any, **kw: Any) -> str:
        """Submit one request for ``key`` and return its id. A submission that
        outlives ``submit_timeout_s`` is kept: until its thread ends nothing else is
        submitted for the key (SubmitUncertain), and once it ends its answer is the
        key's request (adopted by the next call)."""
        late = self._late.get(key)
        if late is not None:
            if not late.done():
                raise SubmitUncertain(
                    f"{what}: an earlier {kind} of {key} is still being submitted; "
                    "asking again with the same key"
                )
            del self._late[key]
            try:
                return str(late.result())
            except Exception:  # its failure was the earlier call's: submit now
                pass
        self._require_server(what)
        try:
            rid = _bounded(self.submit_timeout_s, kind, getattr(self.sdk, attr), *args, **kw)
        except SkyCallTimeout as e:
            self._late[key] = e.call  # type: ignore[attr-defined]
            raise SubmitUncertain(
                f"{what}: {e} (it may have been accepted: the same key asks again)"
            ) from None
        except Exception as e:
            raise _submit_error(e, what) from None
        return str(rid)

    def _require_server(self, what: str) -> None:
        """``sky.api_info()`` (which never starts a server) must say healthy before
        anything is submitted: a server that is down is a transport failure, never a
        reason to start one (its request database would be new and empty)."""
        try:
            info = _bounded(self.poll_timeout_s, "sky.api_info", self.sdk.api_info)
        except Exception as e:
            raise LaunchError(f"{what}: SkyPilot's API server: {_first_line(e)}") from None
        status = _value(_field(info, "status"))
        if status != "HEALTHY":
            raise LaunchError(f"{what}: SkyPilot's API server is {status.lower() or 'unknown'}")

    def restart(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """Submit the new attempt's task on the cluster that is already up (``sky.exec``:
        no provisioning, no setup) and return with its request id, polled like a
        launch; the nodes are the same, the attempt is new. Idempotent per try: the
        task is named after the try, and an exec of that task SkyPilot holds for the
        cluster is answered with.

        RestartRefused, before anything is submitted, when ``sky.exec`` cannot work:
        the cluster is not UP (SkyPilot would refuse it: sky/execution.py), or its
        nodes hold another agent package than this service serves (exec skips setup,
        so the old agent would refuse the new service). Before the exec, every job on
        the cluster is cancelled (an exec only queues another job beside them)."""
        sky_task = self.build(request, request.task)
        cluster = previous.cluster_name
        node_ids = self._node_ids(request)
        earlier = self._earlier_request(cluster, "sky.exec", task_name=sky_task.name)
        if earlier:
            return LaunchHandle(cluster, self.name, node_ids, previous.hosts, earlier)
        what = f"SkyPilot could not restart on {cluster}"
        rec = self._record(cluster, what)
        status = _value(_field(rec, "status")) if rec is not None else "not listed"
        if status != "UP":
            raise RestartRefused(f"{what}: the cluster is {status}; sky.exec needs it UP")
        installed = _package_of(rec)
        if installed is not None and installed != self.package:
            raise RestartRefused(
                f"{what}: its nodes hold agent package {installed!r}, this service serves "
                f"{self.package!r}, and sky.exec skips setup"
            )
        self._cancel_jobs(cluster, what, RestartRefused)
        rid = self._submit(
            f"{cluster}/{sky_task.name}", what, "sky.exec", "exec", sky_task, cluster_name=cluster
        )
        return LaunchHandle(cluster, self.name, node_ids, previous.hosts, rid)

    def refill(self, previous: LaunchHandle, request: LaunchRequest) -> LaunchHandle:
        """Submit ``sky.launch`` of the new attempt's task onto the previous attempt's
        cluster: SkyPilot keeps the nodes still running (the healthy ones), provisions
        only the missing ones, runs setup and then the task on all of them, node ranks
        and IPs its own. Polled like a launch; idempotent per try (the task is named
        after it).

        Before it is submitted: the cluster is refreshed from the cloud, and must be
        INIT with nodes terminated (a doomed node still running would be kept: a
        notice's VM, a partitioned host); then every job on it is cancelled (a launch
        only queues another job beside the old one). RefillRefused otherwise: nothing
        was submitted, and the next try is a fresh launch."""
        p = request.placement
        where = f"{p.cloud}/{p.region} {p.instance_type}"
        sky_task = self.build(request, request.task)
        cluster = previous.cluster_name
        node_ids = self._node_ids(request)
        earlier = self._earlier_request(cluster, "sky.launch", task_name=sky_task.name)
        if earlier:
            self._placements.setdefault(earlier, where)
            return LaunchHandle(cluster, self.name, node_ids, request_id=earlier)
        what = f"SkyPilot could not refill {cluster} on {where}"
        rec = self._refreshed_record(cluster, what)
        if rec is None:
            raise RefillRefused(f"{what}: SkyPilot lists no such cluster (nothing to refill)")
        if not _lost_nodes(rec):
            status = _value(_field(rec, "status"))
            why = str(_field(rec, "init_status_reason") or "")
            raise RefillRefused(
                f"{what}: the cluster is {status}{f' ({why})' if why else ''}, not INIT with "
                "nodes terminated: a refill would keep every VM still running, the doomed "
                "one included"
            )
        self._cancel_jobs(cluster, what, RefillRefused)
        rid = self._submit(
            f"{cluster}/{sky_task.name}", what, "sky.launch", "launch",
            sky_task, cluster_name=cluster, **self._launch_flags(sky_task),
        )  # fmt: skip
        self._placements[rid] = where
        return LaunchHandle(cluster, self.name, node_ids, request_id=rid)

    def _refreshed_record(self, cluster: str, what: str) -> Any:
        """The cluster's record after SkyPilot asked the cloud
        (``refresh=StatusRefreshMode.FORCE``); None when it lists no such cluster.
        LaunchError when it could not be read."""
        from sky.utils.common import StatusRefreshMode

        sky = self.sdk
        try:
            rid = _bounded(
                self.poll_timeout_s, "sky.status", sky.status,
                cluster_names=[cluster], refresh=StatusRefreshMode.FORCE, all_users=True,
            )  # fmt: skip
            records = _bounded(self.submit_timeout_s, "sky.get", sky.get, rid)
        except Exception as e:
            # Not SubmitUncertain (asked again) as _record's: this read is bounded by
            # submit_timeout_s and runs inside the reconciler's transaction, so asking
            # again every tick held SQLite's write lock 30 s a tick (the API timed out).
            raise LaunchError(f"{what}: sky.status: {_first_line(e)}") from None
        found = [r for r in records or [] if _field(r, "name") == cluster]
        with self._lock:  # the shared records learn what the cloud said, too
            if self._records is not None:
                if found:
                    self._records[1][cluster] = found[0]
                else:
                    self._records[1].pop(cluster, None)
        return found[0] if found else None

    def _record(self, cluster: str, what: str) -> Any:
        """The cluster's record from the shared ``sky.status()`` (None: not listed).
        SubmitUncertain when SkyPilot could not be read: nothing was submitted, and
        the same try asks again (an unanswered read is not a refused verb)."""
        records, error = self._cluster_records()
        if records is None:
            raise SubmitUncertain(f"{what}: sky.status: {error} (nothing submitted)")
        return records.get(cluster)

    def _cancel_jobs(self, cluster: str, what: str, refusal: type[LaunchError]) -> None:
        """``sky.cancel(cluster, all=True, _try_cancel_if_cluster_is_init=True)``, waited
        for: an exec or a launch onto a cluster only queues a new job, so the old one
        (an agent still "training", holding GPUs or a port) must end first. A cancel
        SkyPilot refused is ``refusal`` (the verb cannot be made safe); one that could
        not be asked is a LaunchError (ask again)."""
        sky = self.sdk
        try:
            rid = _bounded(
                self.poll_timeout_s, "sky.cancel", sky.cancel,
                cluster, all=True, _try_cancel_if_cluster_is_init=True,
            )  # fmt: skip
            _bounded(self.submit_timeout_s, "sky.get", sky.get, rid)
        except Exception as e:
            if _is_transport_error(e):  # unanswered: ask again (SubmitUncertain)
                raise SubmitUncertain(f"{what}: sky.cancel: {_first_line(e)}") from None
            raise refusal(
                f"{what}: its old jobs could not be cancelled first: "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from None

    def _earlier_request(self, cluster: str, kind: str, *, task_name: str | None) -> str:
        """The id of the newest ``kind`` request SkyPilot holds for ``cluster`` (and,
        for a refill or an exec, for the task named ``task_name``, which names the
        try): an unfinished one first. SubmitUncertain when SkyPilot cannot be asked:
        not knowing whether the request was already submitted must never become
        submitting it twice, nor count as a failed launch."""
        sky = self.sdk
        key = cluster if task_name is None else f"{cluster}/{task_name}"
        late = self._late.get(key)
        if late is not None and late.done() and "value" in late.box:
            del self._late[key]
            return str(late.box["value"])  # the late answer of our own submission
        try:
            records = _bounded(
                self.poll_timeout_s,
                "sky.api_status",
                sky.api_status,
                cluster_name=cluster,
                all_status=True,
            )
        except Exception as e:
            raise SubmitUncertain(
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
        ``sky.api_status`` for its status, ``sky.get`` once it is finished (the server
        answers a finished request at once), and then its job's status: the request
        succeeds once the job is queued, and setup runs inside the job. Never raises."""
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
            return self._lost_request(handle)
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
        if rid in self._results:
            result = self._results[rid]
        else:
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
            self._results[rid] = result
        job = job_of(result)
        hosts = hosts_of(result)
        if job is None:  # no job was queued (SkyPilot gives None for some backends)
            return LaunchProgress(LaunchPhase.UP, f"{kind} {rid} SUCCEEDED", hosts=hosts)
        return self._job_progress(handle.cluster_name, job, f"{kind} {rid}", hosts)

    def _job_progress(
        self, cluster: str, job: int, what: str, hosts: tuple[str, ...]
    ) -> LaunchProgress:
        """The launch's job, read with ``sky.job_status(cluster, [job])`` at most every
        ``job_poll_s``: UP once it runs; FAILED_SETUP a launch failure (not capacity)
        with its log's tail; PENDING provisioning "behind" the job it waits for."""
        now = self.clock()
        cached = self._jobs.get((cluster, job))
        if cached is not None and now - cached[0] < self.job_poll_s:
            return cached[1]
        p = self._read_job(cluster, job, what, hosts)
        if p.phase is not LaunchPhase.UNKNOWN:
            self._jobs[(cluster, job)] = (now, p)
        return p

    def _read_job(
        self, cluster: str, job: int, what: str, hosts: tuple[str, ...]
    ) -> LaunchProgress:
        sky = self.sdk
        try:
            rid = _bounded(self.poll_timeout_s, "sky.job_status", sky.job_status, cluster, [job])
            statuses = _bounded(self.poll_timeout_s, "sky.get", sky.get, rid) or {}
        except Exception as e:
            return LaunchProgress(
                LaunchPhase.UNKNOWN, f"{what}: job {job} on {cluster}: {_first_line(e)}"
            )
        raw = statuses.get(job, statuses.get(str(job))) if isinstance(statuses, dict) else None
        name = _value(raw)
        try:
            status = JobStatus(name)
        except ValueError:
            return LaunchProgress(
                LaunchPhase.UNKNOWN, f"{what}: job {job} on {cluster}: status {name or 'none'}"
            )
        if status in (JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.FAILED):
            # It ran: from here the agent reports (a FAILED run is its exit, reported).
            return LaunchProgress(LaunchPhase.UP, f"{what}: job {job} {status.value}", hosts=hosts)
        if status is JobStatus.FAILED_SETUP:
            tail = self._log_tail(cluster, job)
            return LaunchProgress(
                LaunchPhase.FAILED,
                f"setup failed on {cluster} (job {job})" + (f": {tail}" if tail else ""),
            )
        if status in (JobStatus.FAILED_DRIVER, JobStatus.CANCELLED):
            return LaunchProgress(
                LaunchPhase.FAILED, f"job {job} on {cluster} is {status.value} before it ran"
            )
        if status is JobStatus.PENDING:
            ahead = self._ahead_of(cluster, job)
            behind = f"waiting behind job {ahead}" if ahead is not None else "waiting for resources"
            return LaunchProgress(LaunchPhase.PROVISIONING, f"{what}: job {job} PENDING, {behind}")
        return LaunchProgress(LaunchPhase.PROVISIONING, f"{what}: job {job} {status.value}")

    #: Lines of a failed setup's log carried in the failure (the end says why).
    LOG_TAIL_LINES = 20

    def _log_tail(self, cluster: str, job: int) -> str:
        """The last lines of the job's log (setup's output is its start), read with
        ``sky.tail_logs(follow=False, tail=N)`` into a buffer, bounded; "" when it
        could not be read (the failure stands without it)."""
        buf = io.StringIO()
        try:
            _bounded(
                self.poll_timeout_s, "sky.tail_logs", self.sdk.tail_logs,
                cluster, job, False, tail=self.LOG_TAIL_LINES, output_stream=buf,
            )  # fmt: skip
        except Exception:
            return ""
        text = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
        lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
        return " | ".join(lines[-self.LOG_TAIL_LINES :])[-2000:]

    def _ahead_of(self, cluster: str, job: int) -> int | None:
        """The earliest unfinished job before ``job`` on the cluster (``sky.queue``)."""
        sky = self.sdk
        try:
            rid = _bounded(
                self.poll_timeout_s, "sky.queue", sky.queue, cluster, skip_finished=True,
                all_users=True,
            )  # fmt: skip
            jobs = _bounded(self.poll_timeout_s, "sky.get", sky.get, rid) or []
        except Exception:
            return None
        ids = sorted(
            int(_field(j, "job_id")) for j in jobs
            if isinstance(_field(j, "job_id"), int) and int(_field(j, "job_id")) < job
        )  # fmt: skip
        return ids[0] if ids else None

    def _lost_request(self, handle: LaunchHandle) -> LaunchProgress:
        """A request SkyPilot does not list. The SDK answers [] when a local API
        server is not running (UNKNOWN: a transport failure); a server that is up and
        does not know it was restarted (its request database is new) or dropped it:
        then the cluster says what became of it, and a lost request is never a
        stockout."""
        rid, cluster = handle.request_id, handle.cluster_name
        try:
            self._require_server(f"request {rid} of {cluster}")
        except LaunchError as e:
            return LaunchProgress(LaunchPhase.UNKNOWN, str(e))
        records, error = self._cluster_records(fresh=True)
        if records is None:
            return LaunchProgress(
                LaunchPhase.UNKNOWN, f"request {rid} not listed; sky.status: {error}"
            )
        rec = records.get(cluster)
        lost = f"SkyPilot lists no request {rid} for {cluster} (its API server lost it)"
        if rec is None:
            return LaunchProgress(LaunchPhase.FAILED, f"{lost}, and no such cluster")
        status = _value(_field(rec, "status"))
        if status != "UP":
            return LaunchProgress(LaunchPhase.FAILED, f"{lost}; the cluster is {status}")
        job = self._newest_job(cluster)
        if job is None:
            return LaunchProgress(LaunchPhase.FAILED, f"{lost}; the cluster is UP with no job")
        hosts = hosts_of((job, _field(rec, "handle")))
        return self._job_progress(cluster, job, f"cluster {cluster}", hosts)

    def _newest_job(self, cluster: str) -> int | None:
        sky = self.sdk
        try:
            rid = _bounded(self.poll_timeout_s, "sky.queue", sky.queue, cluster, all_users=True)
            jobs = _bounded(self.poll_timeout_s, "sky.get", sky.get, rid) or []
        except Exception:
            return None
        ids = [int(_field(j, "job_id")) for j in jobs if isinstance(_field(j, "job_id"), int)]
        return max(ids) if ids else None

    def _failed(self, handle: LaunchHandle, rec: Any, e: BaseException) -> LaunchProgress:
        cluster = handle.cluster_name
        if _field(rec, "name") == "sky.exec":
            what = f"SkyPilot could not restart on {cluster}"
        else:
            where = self._placements.get(handle.request_id) or _placement_of_body(rec)
            what = f"SkyPilot could not launch {cluster}" + (f" on {where}" if where else "")
        name = "StopFailoverError" if is_stop_failover(e) else type(e).__name__
        text = _first_line(e).removeprefix("StopFailoverError: ")
        return LaunchProgress(
            LaunchPhase.FAILED, f"{what}: {name}: {text}", capacity=is_capacity_error(e)
        )

    def _progress_from_cluster(self, handle: LaunchHandle) -> LaunchProgress:
        records, error = self._cluster_records()
        if records is None:
            return LaunchProgress(LaunchPhase.UNKNOWN, f"sky.status: {error}")
        rec = records.get(handle.cluster_name)
        if rec is None:
            return LaunchProgress(LaunchPhase.UNKNOWN, f"cluster {handle.cluster_name} not listed")
        status = _value(_field(rec, "status"))
        if status == "UP":
            return LaunchProgress(LaunchPhase.UP, f"cluster {handle.cluster_name} is UP")
        if status == "INIT":
            return LaunchProgress(LaunchPhase.PROVISIONING, f"cluster {handle.cluster_name} INIT")
        return LaunchProgress(LaunchPhase.FAILED, f"cluster {handle.cluster_name} is {status}")

    def node_disk(self, job_id: str, attempt: int, index: int) -> Path:
        raise LaunchError("SkyPilot nodes stage their checkpoint themselves: no node disk here")

    @staticmethod
    def _node_ids(request: LaunchRequest) -> tuple[str, ...]:
        # The run section names nodes the same way: <job>-a<attempt>-n<rank>.
        return tuple(
            f"{request.job_id}-a{request.attempt}-n{k}" for k in range(request.placement.num_nodes)
        )

    def _cluster_records(self, *, fresh: bool = False) -> tuple[dict[str, Any] | None, str]:
        """Every cluster's record (all users: a new user hash must not hide ours), from
        one ``sky.status()`` shared by all jobs and read at most every
        ``status_ttl_s`` (``fresh`` reads it now). (None, why) when it could not be read;
        a failed read is not cached, the last good one is not used past its time."""
        now = self.clock()
        with self._lock:
            cached = self._records
            if not fresh and cached is not None and now - cached[0] < self.status_ttl_s:
                return cached[1], ""
        sky = self.sdk
        try:
            rid = _bounded(self.poll_timeout_s, "sky.status", sky.status, all_users=True)
            records = _bounded(self.poll_timeout_s, "sky.get", sky.get, rid)
        except Exception as e:
            return None, _first_line(e)
        by_name = {str(_field(r, "name")): r for r in records or []}
        with self._lock:
            self._records = (now, by_name)
        return by_name, ""

    def status(self, handle: LaunchHandle) -> ClusterStatus:
        """The cluster's record from the shared ``sky.status()`` (SkyPilot's cached
        record, no cloud refresh; :meth:`_cluster_records`)."""
        records, error = self._cluster_records()
        if records is None:  # an unreadable provider is UNKNOWN, never DOWN
            return ClusterStatus(ClusterState.UNKNOWN, detail=f"sky.status: {error}")
        return status_from_records(handle, list(records.values()))

    def down(self, handle: LaunchHandle) -> None:
        """Cancel the cluster's unfinished launch and exec requests
        (``sky.api_cancel``: a launch still PENDING survives a ``sky.down``, and
        provisions later), then submit ``sky.down`` unless one is under way, and
        return: :meth:`confirm_down` says when the cluster is gone. A down SkyPilot
        runs later on a cluster that no longer exists fails there
        (ClusterDoesNotExist), which confirm_down reads as gone. LaunchError when
        SkyPilot could not be asked."""
        sky = self.sdk
        name = handle.cluster_name
        what = f"SkyPilot could not tear down {name}"
        try:
            active = _bounded(
                self.poll_timeout_s, "sky.api_status", sky.api_status, cluster_name=name
            )
        except Exception as e:
            raise LaunchError(f"{what}: sky.api_status: {_first_line(e)}") from None
        mine = [r for r in active or [] if _field(r, "cluster_name") == name]
        unfinished = [
            r for r in mine if str(_field(r, "status")) in ("PENDING", "WAITING", "RUNNING")
        ]
        cancel = [
            str(_field(r, "request_id"))
            for r in unfinished
            if _field(r, "name") in ("sky.launch", "sky.exec")
        ]
        if cancel:
            try:
                _bounded(self.poll_timeout_s, "sky.api_cancel", sky.api_cancel, cancel, silent=True)
            except Exception as e:
                raise LaunchError(f"{what}: sky.api_cancel {cancel}: {_first_line(e)}") from None
        if any(_field(r, "name") == "sky.down" for r in unfinished):
            return
        self._submit(f"{name}/down", what, "sky.down", "down", name)

    def confirm_down(self, handle: LaunchHandle) -> DownResult:
        """Gone when a fresh ``sky.status()`` lists no such cluster and SkyPilot holds
        no unfinished launch, exec or down for it; never raises."""
        name = handle.cluster_name
        try:
            active = _bounded(
                self.poll_timeout_s, "sky.api_status", self.sdk.api_status, cluster_name=name
            )
        except Exception as e:
            return DownResult(False, f"sky.api_status: {_first_line(e)}")
        busy = [
            f"{_field(r, 'name')} {_field(r, 'request_id')}"
            for r in active or []
            if _field(r, "cluster_name") == name
            and str(_field(r, "status")) in ("PENDING", "WAITING", "RUNNING")
        ]
        if busy:
            return DownResult(False, f"{name}: still running {', '.join(busy)}")
        records, error = self._cluster_records(fresh=True)
        if records is None:
            return DownResult(False, f"sky.status: {error}")
        rec = records.get(name)
        if rec is not None:
            return DownResult(False, f"{name} is still listed ({_value(_field(rec, 'status'))})")
        return DownResult(True, f"{name} is gone")


def _submit_error(e: BaseException, what: str) -> LaunchError:
    """The error for a request SkyPilot did not accept: CapacityError for a stockout,
    TaskRejected for what SkyPilot's validation refused, LaunchError otherwise (an
    API server that could not be reached)."""
    text = f"{what}: {_first_line(e)}"
    if is_capacity_error(e):
        return CapacityError(text)
    if _is_transport_error(e):
        return LaunchError(text)
    if isinstance(e, (ValueError, TypeError, KeyError, AssertionError, SystemExit)) or (
        type(e).__module__.startswith("sky.") or "jsonschema" in type(e).__module__
    ):
        return TaskRejected(f"{what}: SkyPilot rejected it: {_first_line(e)}")
    return LaunchError(text)


def status_from_records(handle: LaunchHandle, records: Any) -> ClusterStatus:
    """Map ``sky.status`` records (StatusResponse objects or dicts) to ClusterStatus.

    Only UP (every node) and STOPPED (none) say anything about the nodes. INIT is
    "still provisioning", or "some nodes are gone", or "its ray status check failed"
    on a healthy cluster; a cluster not listed may be another user hash's, or gone:
    both are UNKNOWN, and the agents' heartbeats tell which nodes are alive."""
    for rec in records or []:
        if _field(rec, "name") != handle.cluster_name:
            continue
        status = _value(_field(rec, "status"))
        if status == "UP":
            return ClusterStatus(ClusterState.UP, handle.node_ids, "UP")
        if status == "INIT":
            why = _field(rec, "init_status_reason")
            return ClusterStatus(ClusterState.UNKNOWN, (), "INIT" + (f": {why}" if why else ""))
        if status == "STOPPED":
            return ClusterStatus(ClusterState.DOWN, (), "STOPPED")
        return ClusterStatus(ClusterState.UNKNOWN, (), f"unrecognised status {status!r}")
    return ClusterStatus(ClusterState.UNKNOWN, (), "not listed by sky.status")


@dataclass(frozen=True)
class RenderedTask:
    """What a launch of a job would submit to SkyPilot (``skyresume submit --dry-run``)."""

    cluster_name: str
    placement: str
    """``cloud/region[/zone] instance type, nodes x accelerators, spot|on-demand``."""
    task_yaml: str
    """The task as SkyPilot reads it (:func:`task_yaml`), secrets redacted."""


def render_job(spec: JobSpec, *, launcher: Any = None, settings: Any = None) -> RenderedTask:
    """The SkyPilot task the first attempt of ``spec`` would be launched with: placed
    by the same selection as the reconciler's, built and pinned exactly as
    :meth:`SkyPilotLauncher.launch` builds it, and nothing asked of SkyPilot's API
    server. With the SkyPilot launcher, its own (package, node image, history);
    otherwise one made from ``settings`` for this alone: what the job would be on
    SkyPilot. TaskRejected or LaunchError naming why it could not be rendered."""
    builder = launcher if isinstance(launcher, SkyPilotLauncher) else SkyPilotLauncher(settings)
    placement = builder.placement_for(spec)
    request = LaunchRequest(
        job_id="dry-run",
        attempt=1,
        placement=placement,
        command=spec.task.command or "",
        env={Env.JOB_ID: "dry-run", Env.ATTEMPT: "1", Env.CHECKPOINT_URI: spec.checkpoint.uri},
        ranks_per_node=spec.ranks_per_node,
        grace_s=spec.restarts.grace_period_s,
        task=spec.task,
    )
    p = placement
    where = f"{p.cloud}/{p.region}" + (f"/{p.zone}" if p.zone else "")
    accel = f" x {p.accelerator}:{p.accelerator_count}" if p.accelerator else ""
    what = f"{where} {p.instance_type}, {p.num_nodes} nodes{accel}, "
    what += "spot" if p.spot else "on-demand"
    return RenderedTask(
        cluster_name=cluster_name_for(request.job_id, request.attempt),
        placement=what,
        task_yaml=builder.render_yaml(request, spec.task),
    )
