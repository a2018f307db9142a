"""SkyPilot's own example and test YAMLs (``corpus/``, each file's origin in
``corpus/SOURCES``), planned the way ``skyresume plan`` plans them and compared with
SkyPilot's optimizer run on the same catalog (this package's test catalog).

For each YAML SkyPilot accepts, our first choice is SkyPilot's own (cloud, region,
instance type) or one of its equally priced ones; for each it refuses, we refuse
too, with SkyPilot's reason; nothing raises a traceback. The launch task built from
our choice keeps every resource field the YAML wrote (what ``submit --dry-run``
shows). One in-process optimizer, one catalog, for the whole corpus."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.launchers.base import LaunchError, LaunchRequest
from orchestrator.launchers.catalog import SkyPilotRefused, UnknownAccelerator, offline_clouds

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

CORPUS = Path(__file__).parent / "corpus"
FILES = sorted(CORPUS.glob("*.yaml"))
NOW = datetime(2026, 12, 2, tzinfo=UTC)


def test_the_corpus_is_skypilots_own_yamls_with_their_sources():
    rows = [ln.split("\t") for ln in (CORPUS / "SOURCES").read_text().splitlines() if ln]
    assert len(FILES) >= 40
    assert {r[0] for r in rows} == {f.name for f in FILES}
    for name, repo, path, commit in rows:
        assert repo == "skypilot-org/skypilot" and len(commit) == 40
        assert name == path.replace("/", "__")
    assert len(MULTI_NODE) >= 12  # multi-node ones first


def _docs(path: Path) -> list[dict[str, Any]]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    except yaml.YAMLError:
        return []  # not YAML at all: SkyPilot refuses it, and so do we


@dataclass
class Outcome:
    name: str
    sky: Any = None  # (cloud, region, instance type, $/h) or the refusal's text
    ours: Any = None
    ours_price: float | None = None
    refused: str | None = None
    error: BaseException | None = None


def _skypilot_alone(path: Path) -> Any:
    """SkyPilot's optimizer on the YAML as SkyPilot loads it, nothing of ours."""
    import sky
    from sky import exceptions

    if len(_docs(path)) > 1:
        return "multi-document"
    with offline_clouds():
        try:
            task = sky.Task.from_yaml(str(path))
            dag = sky.Dag()
            dag.add(task)
            sky.Optimizer.optimize(dag, quiet=True)
        except (exceptions.ResourcesUnavailableError, ValueError, ImportError) as e:
            return f"refused: {e}"
        except yaml.YAMLError as e:
            return f"refused: {e}"
        r = task.best_resources
        return (str(r.cloud).lower(), r.region, r.instance_type, r.get_cost(3600) * task.num_nodes)


def _ours(path: Path) -> Outcome:
    from orchestrator.commands import plan as plan_module
    from orchestrator.commands.plan import _load
    from orchestrator.domain.planner import rank
    from orchestrator.launchers.catalog import oracle_for_task

    def refuse(message: str, code: int = 1) -> None:
        raise LaunchError(message)  # what ``plan`` prints as its one error line

    out = Outcome(path.name)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan_module, "fail", refuse)
            _, spec, demand, task, _, _ = _load(path)
        cands = oracle_for_task(task, clouds=spec.clouds).candidates
        strict = any(o[3] > 0 for o in demand.options)
        ranking = rank(spec, cands, [], NOW, strict_preference=strict)
        top = ranking.ranked[0]
        p = top.placement
        out.ours = (p.cloud, p.region, p.instance_type)
        out.ours_price = top.price_per_job_hour
    except (SkyPilotRefused, UnknownAccelerator, LaunchError) as e:
        out.refused = str(e)
    except BaseException as e:  # a traceback: counted, and the test fails on it
        out.error = e
    return out


_DONE: dict[str, Outcome] = {}


def _outcomes(files: list[Path]) -> list[Outcome]:
    for f in files:
        if f.name not in _DONE:
            o = _ours(f)
            o.sky = _skypilot_alone(f)
            _DONE[f.name] = o
    return [_DONE[f.name] for f in files]


#: The multi-node YAMLs (SOURCES lists them first): the default run's share.
MULTI_NODE = [f for f in FILES if any(d.get("num_nodes", 1) != 1 for d in _docs(f))]


@pytest.fixture(scope="module")
def outcomes(sky) -> list[Outcome]:
    return _outcomes(MULTI_NODE)


@pytest.mark.long
def test_the_whole_corpus_plans_as_skypilot_does(sky):
    _check(_outcomes(FILES), at_least=20)


def test_the_multi_node_corpus_plans_as_skypilot_does(outcomes):
    _check(outcomes, at_least=5)


def _check(outcomes: list[Outcome], at_least: int) -> None:
    errors = [(o.name, repr(o.error)) for o in outcomes if o.error is not None]
    assert errors == []  # 0 tracebacks
    accepted = [o for o in outcomes if isinstance(o.sky, tuple)]
    same = [
        o
        for o in accepted
        if o.ours is not None
        and (o.ours == o.sky[:3] or abs((o.ours_price or 0) - o.sky[3]) < 1e-6)
    ]
    assert len(accepted) >= at_least
    missed = [(o.name, o.ours, o.sky, o.refused) for o in accepted if o not in same]
    assert len(same) >= 0.95 * len(accepted), missed
    # Where SkyPilot refuses, so do we, with its reason (its first line).
    for o in outcomes:
        if isinstance(o.sky, str) and o.sky.startswith("refused"):
            assert o.refused is not None, (o.name, o.ours)
            first = o.sky.removeprefix("refused: ").strip().splitlines()[0].strip()
            if "requires kubernetes which is not enabled" in first:
                # SkyPilot's parser stops first here, on its missing kubernetes extra
                assert "Kubernetes" in o.refused and "Traceback" not in o.refused, o.refused
            elif "while scanning" in first or "expected a single document" in first:
                assert "unreadable YAML" in o.refused, (o.name, o.refused)
            else:
                assert first[:50] in o.refused, (o.name, first, o.refused)
        if o.sky == "multi-document":
            assert o.refused is not None and "YAML documents" in o.refused


def _fields(option: dict[str, Any]) -> dict[str, Any]:
    keep = ("image_id", "disk_size", "disk_tier", "network_tier", "ports", "labels", "cpus",
            "memory", "autostop")  # fmt: skip
    return {k: option[k] for k in keep if k in option}


def test_the_launch_task_keeps_every_resource_field_of_the_yaml(outcomes):
    """What ``submit --dry-run`` shows: the task pinned to our choice still has the
    YAML's own image, disk, network tier, ports, labels, cpus/memory and autostop."""
    from orchestrator.domain.plan import Placement
    from orchestrator.launchers.skypilot import build_task_from_user_yaml, resource_options

    checked = 0
    for o in outcomes:
        if o.ours is None:
            continue
        docs = _docs(CORPUS / o.name)
        config = docs[0] if len(docs) == 1 else {}
        if not isinstance(config.get("run"), str):
            continue  # no run section: nothing for the agent to start
        cloud, region, itype = o.ours
        accels = {}
        for opt in resource_options(config.get("resources")):
            want = _fields(opt)
            if not want:
                continue
            placement = Placement(cloud, region, itype, None, 0, 1, False)
            with offline_clouds():
                import sky

                probe = sky.Resources(infra=f"{cloud}/{region}", instance_type=itype)
                accels = probe.accelerators or {}
            if accels:
                ((name, count),) = accels.items()
                placement = Placement(cloud, region, itype, name, int(count), 1, False)
            task = build_task_from_user_yaml(
                CORPUS / o.name,
                LaunchRequest(job_id="j-1", attempt=1, placement=placement, command="x"),
            )
            (r,) = list(task.resources)
            got = copy.deepcopy(r.to_yaml_config())
            for k, v in want.items():
                if k == "autostop":
                    assert r.autostop_config is not None
                    continue
                if k == "image_id" and isinstance(v, str):
                    v = {region: v} if not v.startswith("docker:") else v
                have = got.get(k)
                if k == "image_id" and isinstance(v, dict) and isinstance(have, dict):
                    assert all(
                        have.get(kk) == vv for kk, vv in v.items() if kk in (region, "docker")
                    ), (o.name, k, have)
                elif k == "ports":
                    assert [str(x) for x in (have or [])] == [str(v)] or have == v, (o.name, have)
                elif k in ("disk_tier", "network_tier"):
                    assert str(have).lower() == str(v).lower(), (o.name, k, have)
                else:
                    assert have == v, (o.name, k, have, v)
            checked += 1
            break  # the option our choice came from (first that names fields)
    assert checked >= 6
