"""Planner candidates from SkyPilot's own catalog, read in process.

The planner (:mod:`orchestrator.domain.planner`) is pure; this module is its one
source of rows. It asks SkyPilot's catalog (``sky.catalog.list_accelerators``, the
same tables ``sky show-gpus`` and SkyPilot's optimizer read) for every region that
offers each of the job's accelerators, with on-demand and spot prices and the GPU's
memory, and turns them into :class:`~orchestrator.domain.planner.Candidate` rows.

Planning needs the catalog only, never cloud credentials. SkyPilot downloads a
missing catalog file on first read; on a machine that cannot reach GitHub that is
a long wait and then a stack trace, so :func:`require_catalog` looks for the files
first (without importing ``sky``) and says how to get them. The layout is
SkyPilot's: ``$SKY_RUNTIME_DIR/.sky/catalogs/v8/<cloud>/vms.csv`` (``$SKY_RUNTIME_DIR``
defaults to ``~``), plus ``common/accelerators.csv`` and ``common/metadata.csv``. A
hand-placed file (no ``.meta`` md5 beside it) is used as is and never re-downloaded.

``sky`` is imported inside the functions: it takes about 1.5 s and the CLI must
start fast.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator.contract import Cloud
from orchestrator.domain.planner import Candidate

CATALOG_SCHEMA_VERSION = "v8"  # sky.skylet.constants.CATALOG_SCHEMA_VERSION in 0.14

#: Clouds whose catalog is a vms.csv table the planner can read offline.
CATALOG_CLOUDS: tuple[Cloud, ...] = ("aws", "gcp", "azure", "lambda", "runpod")

COMMON_FILES = ("common/accelerators.csv", "common/metadata.csv")

_MEMORY_FORM = re.compile(
    r"^(?:(?P<maker>nvidia|amd|google):)?(?P<gb>[1-9][0-9]*)GB(?P<plus>\+?)(?::(?P<count>[1-9][0-9]*))?$",
    re.IGNORECASE,
)
_NAME_FORM = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9_.\-]*)(?::(?P<count>[1-9][0-9]*))?$")


class CatalogUnavailable(RuntimeError):
    """The catalog files planning needs are not on this machine."""


class UnknownAccelerator(ValueError):
    """An accelerator (or count) that no allowed cloud's catalog offers."""


def catalog_root() -> Path:
    """Where SkyPilot 0.14 reads its catalogs (``sky.catalog.common``)."""
    runtime = os.path.expanduser(os.environ.get("SKY_RUNTIME_DIR", "~"))
    return Path(runtime) / ".sky" / "catalogs" / CATALOG_SCHEMA_VERSION


def clouds_with_catalogs(root: Path | None = None) -> list[str]:
    root = root or catalog_root()
    return [c for c in CATALOG_CLOUDS if (root / c / "vms.csv").is_file()]


def require_catalog(clouds: Sequence[str] = ()) -> list[str]:
    """The clouds to plan over; raises :class:`CatalogUnavailable` with a how-to.

    ``clouds`` empty means every cloud that has a catalog here.
    """
    root = catalog_root()
    how = (
        f"SkyPilot reads its catalogs from {root}. Get them on a machine with internet "
        "access by running `sky show-gpus --all` (it downloads the tables of every "
        f"enabled cloud), or copy a {CATALOG_SCHEMA_VERSION}/ catalog directory there "
        "(or point SKY_RUNTIME_DIR at a directory holding .sky/catalogs/"
        f"{CATALOG_SCHEMA_VERSION}/); no cloud credentials are needed to plan"
    )
    missing_common = [f for f in COMMON_FILES if not (root / f).is_file()]
    if missing_common:
        raise CatalogUnavailable(f"no SkyPilot catalog: {', '.join(missing_common)} missing. {how}")
    present = clouds_with_catalogs(root)
    wanted = [c.lower() for c in clouds] or present
    unknown = [c for c in wanted if c not in CATALOG_CLOUDS]
    if unknown:
        raise CatalogUnavailable(
            f"cannot plan over {', '.join(unknown)}: it has no price catalog the planner "
            f"reads (catalog clouds: {', '.join(CATALOG_CLOUDS)})"
        )
    lacking = [c for c in wanted if c not in present]
    if lacking or not wanted:
        what = ", ".join(f"{c}/vms.csv" for c in lacking) or "any <cloud>/vms.csv"
        raise CatalogUnavailable(f"no SkyPilot catalog for {what}. {how}")
    return wanted


@dataclass(frozen=True)
class AcceleratorRequest:
    """One entry of a job's ``accelerators``: a name or a memory form, and a count."""

    text: str
    name: str | None
    count: int
    memory_gb: int | None = None
    at_least: bool = False
    manufacturer: str | None = None


def parse_accelerator(text: str) -> AcceleratorRequest:
    """``A100:8``, ``H100``, ``nvidia:40GB+:8``, ``80GB:8`` (SkyPilot's forms)."""
    m = _MEMORY_FORM.match(text.strip())
    if m:
        return AcceleratorRequest(
            text=text,
            name=None,
            count=int(m["count"] or 1),
            memory_gb=int(m["gb"]),
            at_least=bool(m["plus"]),
            manufacturer=(m["maker"] or "").lower() or None,
        )
    m = _NAME_FORM.match(text.strip())
    if not m:
        raise UnknownAccelerator(
            f"{text!r} is not an accelerator: use NAME[:COUNT] (A100:8) or a memory form "
            "(nvidia:40GB+:8)"
        )
    return AcceleratorRequest(text=text, name=m["name"], count=int(m["count"] or 1))


def _names_for(req: AcceleratorRequest) -> list[str]:
    if req.name is not None:
        return [req.name]
    from sky.utils import accelerator_registry

    assert req.memory_gb is not None
    names: list[str] = accelerator_registry.get_devices_by_memory(
        req.memory_gb, req.at_least, manufacturer=req.manufacturer
    )
    return names


def _known_names(clouds: Sequence[str]) -> list[str]:
    from sky import catalog

    offered = catalog.list_accelerators(gpus_only=True, clouds=list(clouds))
    return sorted(offered)


def _memory_table() -> dict[str, float]:
    """GPU -> memory (GB as SkyPilot's metadata.csv states it), for rows whose GpuInfo
    SkyPilot could not parse (its GCP table, for one)."""
    from sky.catalog import common

    df: Any = common.read_catalog("common/metadata.csv")
    return {str(g): float(m) for g, m in zip(df["GPU"], df["MemoryGB"], strict=True)}


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def gather_candidates(
    accelerators: Sequence[str],
    *,
    clouds: Sequence[str] = (),
    regions: Sequence[str] = (),
) -> list[Candidate]:
    """Every (cloud, region, instance type) offering each requested accelerator.

    ``preference`` on each row is the index of the request it came from. Raises
    :class:`CatalogUnavailable` (nothing to read) or :class:`UnknownAccelerator`
    (a request that no allowed cloud offers, naming what is offered).
    """
    use_clouds = require_catalog(clouds)
    requests = [parse_accelerator(a) for a in accelerators]
    if not requests:
        raise UnknownAccelerator(
            "the job names no accelerators; the planner ranks GPU offerings only "
            "(CPU-only jobs run on the local launcher)"
        )
    from sky import catalog

    memory = _memory_table()
    out: list[Candidate] = []
    for pref, req in enumerate(requests):
        found: list[Candidate] = []
        counts_offered: set[int] = set()
        for name in _names_for(req):
            rows = catalog.list_accelerators(
                gpus_only=True,
                name_filter=f"^{re.escape(name)}$",
                clouds=use_clouds,
                case_sensitive=False,
                all_regions=True,
            )
            for acc_name, infos in rows.items():
                for info in infos:
                    count = int(info.accelerator_count)
                    counts_offered.add(count)
                    if count != req.count or not info.instance_type:
                        continue
                    if regions and not _region_allowed(regions, info.cloud, info.region):
                        continue
                    gpu_mem = _num(info.device_memory) or memory.get(acc_name)
                    price = _num(info.price)
                    if price is None:
                        continue
                    found.append(
                        Candidate(
                            cloud=str(info.cloud).lower(),
                            region=str(info.region),
                            instance_type=str(info.instance_type),
                            accelerator=str(acc_name),
                            accelerator_count=count,
                            gpu_memory_gib=gpu_mem,
                            price_per_node_hour=price,
                            spot_price_per_node_hour=_num(info.spot_price),
                            preference=pref,
                        )
                    )
        if not found and not counts_offered:
            what = (
                f"no accelerator with {req.memory_gb}GB{'+' if req.at_least else ''}"
                if req.name is None
                else f"accelerator {req.name!r}"
            )
            raise UnknownAccelerator(
                f"{req.text!r}: {what} is not offered by {', '.join(use_clouds)} in this "
                f"catalog; offered: {', '.join(_known_names(use_clouds)) or 'none'}"
            )
        if not found and not regions:
            raise UnknownAccelerator(
                f"{req.text!r}: no instance type offers {req.count} of them on "
                f"{', '.join(use_clouds)}; counts offered: "
                f"{', '.join(str(c) for c in sorted(counts_offered))}"
            )
        out.extend(found)
    # The same offering can answer several requests (A100-80GB and nvidia:40GB+):
    # keep it once, under the job's earliest preference.
    unique: dict[tuple[str, str, str], Candidate] = {}
    for c in out:
        unique.setdefault((c.cloud, c.region, c.instance_type), c)
    return list(unique.values())


def gather_instance_type(
    instance_type: str, *, clouds: Sequence[str] = (), regions: Sequence[str] = ()
) -> list[Candidate]:
    """Every (cloud, region) offering a CPU instance type (a task option that names an
    ``instance_type`` and no accelerators), priced from SkyPilot's catalog: its
    cheapest zone on demand, and spot where the catalog has a spot price. Raises
    :class:`UnknownAccelerator` when no allowed cloud offers it."""
    use_clouds = require_catalog(clouds)
    from sky import catalog

    out: list[Candidate] = []
    for cloud in use_clouds:
        try:
            found = catalog.get_region_zones_for_instance_type(instance_type, False, clouds=cloud)
        except ValueError:
            continue  # not this cloud's instance type
        for region in found:
            name = str(region.name)
            if regions and not _region_allowed(regions, cloud, name):
                continue
            price = catalog.get_hourly_cost(instance_type, False, name, None, clouds=cloud)
            try:
                spot: float | None = catalog.get_hourly_cost(
                    instance_type, True, name, None, clouds=cloud
                )
            except ValueError:
                spot = None
            out.append(
                Candidate(
                    cloud=cloud.lower(), region=name, instance_type=instance_type,
                    accelerator=None, accelerator_count=0, gpu_memory_gib=None,
                    price_per_node_hour=float(price),
                    spot_price_per_node_hour=None if spot is None else float(spot),
                )
            )  # fmt: skip
    if not out:
        raise UnknownAccelerator(
            f"instance type {instance_type!r} is not offered by {', '.join(use_clouds)} "
            "in this catalog"
        )
    return out


def _region_allowed(regions: Sequence[str], cloud: str, region: str) -> bool:
    for r in regions:
        r = r.lower().replace(":", "/")
        if "/" in r:
            c, reg = r.split("/", 1)
            if c == cloud.lower() and reg in ("*", region.lower()):
                return True
        elif r == region.lower():
            return True
    return False


@dataclass(frozen=True)
class TaskDemand:
    """What a plain SkyPilot task asks for, in the planner's terms."""

    accelerators: tuple[str, ...]
    spot: bool
    num_nodes: int
    options: tuple[tuple[str, tuple[str, ...], tuple[str, ...], int], ...]
    """One (accelerator, clouds, regions, preference) per resource option: ``ordered``
    options keep their order as preference, ``any_of`` options are all preference 0."""
    pins: tuple[tuple[str | None, str | None], ...] = ()
    """Per option (same order as ``options``): the (instance type, zone) it names, if
    any: an option pinned to ``p4de.24xlarge`` or ``us-east-1a`` offers only that."""


def demand_from_task(task: Any) -> TaskDemand:
    """Accelerators, places, spot and nodes from a ``sky.Task``'s resources, one
    option per resource (an ``any_of`` or ``ordered`` entry, each with its infra)."""
    accels: list[str] = []
    options: list[tuple[str, tuple[str, ...], tuple[str, ...], int]] = []
    pins: list[tuple[str | None, str | None]] = []
    spots: set[bool] = set()
    ordered = isinstance(task.resources, list)
    for i, r in enumerate(task.resources):
        cloud = str(r.cloud).lower() if r.cloud is not None else None
        clouds = (cloud,) if cloud else ()
        if r.region is not None:
            regions: tuple[str, ...] = (f"{cloud}/{r.region}" if cloud else str(r.region),)
        else:
            regions = ()
        for name, count in (r.accelerators or {}).items():
            entry = f"{name}:{int(count)}"
            if entry not in accels:
                accels.append(entry)
            options.append((entry, clouds, regions, i if ordered else 0))
            pins.append((r.instance_type, r.zone))
        if not r.accelerators and r.instance_type:
            # A CPU option (no accelerators) offers exactly its instance type: planned
            # over the regions that have it (gather_instance_type), accelerator "".
            options.append(("", clouds, regions, i if ordered else 0))
            pins.append((r.instance_type, r.zone))
        spots.add(bool(r.use_spot))
    return TaskDemand(
        accelerators=tuple(accels),
        spot=spots == {True},
        num_nodes=int(task.num_nodes),
        options=tuple(options),
        pins=tuple(pins),
    )


def gather_for_task(demand: TaskDemand, *, clouds: Sequence[str] = ()) -> list[Candidate]:
    """Candidates for every resource option of a SkyPilot task, each option filtered
    by its own infra (so ``A100-80GB`` on ``gcp/us-central1`` never becomes
    ``A100-80GB`` on AWS). ``clouds`` further limits all of them."""
    if not demand.options:
        raise UnknownAccelerator(
            "the SkyPilot task names no accelerators and no instance type; the planner "
            "ranks GPU offerings, or a CPU option's own instance_type"
        )
    allowed = {c.lower() for c in clouds}
    out: dict[tuple[str, str, str], Candidate] = {}
    pins = demand.pins or ((None, None),) * len(demand.options)
    for (accel, opt_clouds, opt_regions, pref), (itype, zone) in zip(
        demand.options, pins, strict=True
    ):
        use = [c for c in opt_clouds if not allowed or c in allowed] if opt_clouds else clouds
        if opt_clouds and not use:
            continue
        found = (
            gather_candidates([accel], clouds=use, regions=opt_regions)
            if accel
            else gather_instance_type(str(itype), clouds=use, regions=opt_regions)
        )
        for c in found:
            if itype is not None and c.instance_type != itype:
                continue  # the option names its instance type: only that one
            if zone is not None:
                if zone[:1].isalpha() and not zone.startswith(c.region):
                    continue  # a zone of another region (Azure's "1", "2" name none)
                c = replace(c, zone=zone)  # and its zone: the placement carries it
            key = (c.cloud, c.region, c.instance_type)
            if key not in out or out[key].preference > pref:
                out[key] = replace(c, preference=pref)
    return list(out.values())


# --- SkyPilot's own optimizer as the oracle ------------------------------------------

_OFFLINE_LOCK = threading.RLock()


def _enabled_for_planning(clouds: Sequence[str] = ()) -> list[Any]:
    """The clouds planning treats as enabled: those with a catalog here (limited to
    ``clouds`` when given), as SkyPilot cloud objects."""
    from sky.utils import registry

    wanted = [c.lower() for c in clouds] or clouds_with_catalogs() or list(CATALOG_CLOUDS)
    out = []
    for name in wanted:
        if name not in CATALOG_CLOUDS or name not in (clouds_with_catalogs() or CATALOG_CLOUDS):
            continue
        cloud = registry.CLOUD_REGISTRY.from_str(name)
        if cloud is not None:
            out.append(cloud)
    return out


@contextlib.contextmanager
def offline_clouds(clouds: Sequence[str] = ()) -> Iterator[list[Any]]:
    """SkyPilot's enabled-cloud lookups answer "the clouds with a catalog here" while
    the block runs, as SkyPilot's own tests seed them: planning and parsing a task
    (``ports:`` asks for the enabled clouds) need no credentials and no ``sky check``.
    One block at a time in this process (the lookups are module functions)."""
    from sky import check as sky_check
    from sky import clouds as sky_clouds

    with _OFFLINE_LOCK:
        enabled = _enabled_for_planning(clouds)
        saved = (
            sky_check.get_cached_enabled_clouds_or_refresh,
            sky_check.check_capability,
            sky_check.check,
        )
        sky_check.get_cached_enabled_clouds_or_refresh = lambda *_a, **_k: list(enabled)
        sky_check.check_capability = lambda *_a, **_k: {}
        sky_check.check = lambda *_a, **_k: {}
        # An image_id's size is asked of the cloud's API (AWS retries for ~30 s without
        # credentials): offline it is unknown, and SkyPilot checks it again at launch.
        sized = [sky_clouds.AWS, sky_clouds.GCP, sky_clouds.Azure]
        own = {cls: cls.__dict__.get("get_image_size") for cls in sized}
        for cls in sized:
            cls.get_image_size = classmethod(lambda _cls, _image, _region: 0.0)  # type: ignore[method-assign,assignment]
        try:
            yield enabled
        finally:
            (
                sky_check.get_cached_enabled_clouds_or_refresh,
                sky_check.check_capability,
                sky_check.check,
            ) = saved
            for cls, fn in own.items():
                if fn is None:
                    delattr(cls, "get_image_size")
                else:
                    setattr(cls, "get_image_size", fn)  # noqa: B010 (mypy: a method)


class SkyPilotRefused(UnknownAccelerator):
    """SkyPilot's optimizer finds no resource for the task (its reason, one line)."""


def _one_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2])


@dataclass(frozen=True)
class OracleResult:
    """What SkyPilot's optimizer says of a task, on this machine's catalog."""

    candidates: tuple[Candidate, ...]
    """Every (cloud, region, instance type) SkyPilot would launch, per option."""
    best: Candidate
    """SkyPilot's own choice (``task.best_resources``)."""


def _candidate_of(r: Any, pref: int, memory: dict[str, float]) -> Candidate | None:
    accels = r.accelerators or {}
    name, count = next(iter(accels.items())) if accels else (None, 0)
    try:
        on_demand = float(r.copy(use_spot=False).get_cost(3600))
    except (ValueError, AssertionError):
        on_demand = math.nan
    try:
        spot: float | None = float(r.copy(use_spot=True).get_cost(3600))
    except (ValueError, AssertionError):
        spot = None
    if spot is not None and math.isnan(spot):
        spot = None
    if math.isnan(on_demand):
        if not r.use_spot or spot is None:
            return None
        on_demand = spot  # a spot-only offering: its on-demand price is unknown
    gpu_mem: float | None = None
    if name is not None:
        gpu_mem = memory.get(str(name))
    return Candidate(
        cloud=str(r.cloud).lower(),
        region=str(r.region),
        instance_type=str(r.instance_type),
        accelerator=None if name is None else str(name),
        accelerator_count=int(count),
        gpu_memory_gib=gpu_mem,
        price_per_node_hour=on_demand,
        spot_price_per_node_hour=spot,
        zone=None,
        preference=pref,
        spot=bool(r.use_spot),
    )


def oracle_for_task(task: Any, *, clouds: Sequence[str] = ()) -> OracleResult:
    """SkyPilot's optimizer, in process and offline, on this machine's catalog: the
    launchable resources it accepts for each of the task's options (its own
    ``_fill_in_launchable_resources``: the cheapest instance type per cloud that
    satisfies accelerators, cpus, memory, disk, image regions, ports..., in every
    region and zone it allows), and its own pick. An option SkyPilot cannot place is
    skipped as SkyPilot skips it; when none is left, :class:`SkyPilotRefused` carries
    SkyPilot's reason in one line. Raises :class:`CatalogUnavailable` without one."""
    import copy

    import sky
    from sky import exceptions, optimizer

    require_catalog(clouds)
    memory = _memory_table()
    with offline_clouds(clouds):
        work = copy.deepcopy(task)
        dag = sky.Dag()
        dag.add(work)
        try:
            sky.Optimizer.optimize(dag, minimize=sky.OptimizeTarget.COST, quiet=True)
        except (exceptions.ResourcesUnavailableError, exceptions.NoCloudAccessError) as e:
            raise SkyPilotRefused(f"SkyPilot refuses it: {_one_line(e)}") from None
        except (ValueError, ImportError, AssertionError) as e:
            raise SkyPilotRefused(f"SkyPilot refuses it: {_one_line(e)}") from None
        best_r = work.best_resources
        ordered = isinstance(task.resources, list)
        probe = copy.deepcopy(task)
        out: dict[tuple[str, str, str, bool], Candidate] = {}
        options = list(probe.resources)
        for i, res in enumerate(options):
            probe.set_resources(res)
            requested = next(iter(probe.resources))
            try:
                launchable, _, _, _ = optimizer._fill_in_launchable_resources(
                    task=probe, blocked_resources=None, quiet=True
                )
            except (exceptions.ResourcesUnavailableError, ValueError, ImportError):
                continue
            for lr in launchable.get(requested, []):
                c = _candidate_of(lr, i if ordered else 0, memory)
                if c is None:
                    continue
                key = (c.cloud, c.region, c.instance_type, bool(c.spot))
                old = out.get(key)
                if (
                    old is None
                    or c.preference < old.preference
                    or (
                        c.preference == old.preference
                        and (c.spot_price_per_node_hour or 0)
                        < (old.spot_price_per_node_hour or math.inf)
                    )
                ):
                    out[key] = c
    best = _candidate_of(best_r, 0, memory)
    assert best is not None
    pinned_zone = {str(r.zone) for r in task.resources if r.zone}
    cands = tuple(
        replace(c, zone=next(iter(pinned_zone))) if len(pinned_zone) == 1 else c
        for c in out.values()
    )
    return OracleResult(cands, best)
