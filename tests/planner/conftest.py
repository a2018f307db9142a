"""Fixtures for the planner and SkyPilot launcher tests.

* ``no_network`` (autouse): any non-loopback connect or name lookup raises, so no
  test can reach GitHub (SkyPilot's catalog downloads), a cloud API or DNS. CLI
  subprocesses get the same guard through ``netguard/sitecustomize.py``.
* ``sky_home``: a temporary SkyPilot runtime directory (``SKY_RUNTIME_DIR`` and
  ``HOME``) seeded with the small catalog in ``catalog/v8`` (AWS p4d, p4de, p5, g5;
  GCP a2, a3; common accelerators and metadata tables), set *before* ``sky`` is
  imported because SkyPilot fixes its catalog path at import time.
* ``sky``: the module, imported once for the package (it takes about 1.5 s).
* ``enabled_clouds``: AWS and GCP enabled the way SkyPilot's own tests do it
  (``tests/common.py`` patches ``sky.check``'s cached enabled-cloud lookup), for
  the optimizer.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CATALOG = HERE / "catalog" / "v8"
NETGUARD = HERE / "netguard"
REPO = HERE.parents[1]

sys.path.insert(0, str(NETGUARD))
from orchestrator_netguard import install  # noqa: E402


@pytest.fixture(autouse=True, scope="package")
def no_network() -> Iterator[None]:
    undo = install()
    yield
    undo()


def seed_runtime_dir(root: Path, catalog: Path = CATALOG) -> Path:
    """``root/.sky/catalogs/v8`` as SkyPilot 0.14 reads it (hand-placed: no .meta)."""
    dest = root / ".sky" / "catalogs" / "v8"
    shutil.copytree(catalog, dest, dirs_exist_ok=True)
    return root


def repoint_catalogs(catalog_dir: str) -> str | None:
    """Point a ``sky`` imported earlier in this session (tests/awsemu reads SkyPilot's
    own constants and calls in-process) at ``catalog_dir``; the directory it had, or
    None when sky is not imported yet. SkyPilot fixes the directory at import, and its
    modules open their tables then (``accelerator_registry``'s and each cloud
    catalog's module-level ``read_catalog``), so moving the directory alone would
    leave those tables under the earlier HOME, and the planner tests would try GitHub.
    (Re-importing sky instead fails: its Prometheus metrics register twice.)"""
    common = sys.modules.get("sky.catalog.common")
    if common is None:
        return None
    before: str = common._ABSOLUTE_VERSIONED_CATALOG_DIR
    common._ABSOLUTE_VERSIONED_CATALOG_DIR = catalog_dir
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "sky" or name.startswith("sky.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, common.LazyDataFrame) and value._filename.startswith(
                before + os.sep
            ):
                rel = os.path.relpath(value._filename, before)
                setattr(module, attr, common.read_catalog(rel))
    return before


@pytest.fixture(scope="package")
def sky_home(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[Path]:
    root = seed_runtime_dir(tmp_path_factory.mktemp("skyhome"))
    # A dry run packages SkyPilot itself as a wheel (5-20 s) into ~/.sky/wheels;
    # keep that one artifact in pytest's cache so later runs reuse it.
    cache = getattr(pytestconfig, "cache", None)
    if cache is not None:
        (root / ".sky" / "wheels").symlink_to(cache.mkdir("sky-wheels"))
    saved = {k: os.environ.get(k) for k in ("SKY_RUNTIME_DIR", "HOME")}
    os.environ["SKY_RUNTIME_DIR"] = str(root)
    os.environ["HOME"] = str(root)
    before = repoint_catalogs(str(root / ".sky" / "catalogs" / "v8"))
    yield root
    if before is not None:
        repoint_catalogs(before)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="package")
def sky(sky_home: Path):  # type: ignore[no-untyped-def]
    import sky as sky_module
    from sky.catalog import common

    assert str(sky_home / ".sky" / "catalogs" / "v8") == common._ABSOLUTE_VERSIONED_CATALOG_DIR
    return sky_module


@pytest.fixture
def enabled_clouds(sky, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from sky import clouds

    enabled = [clouds.AWS(), clouds.GCP()]
    monkeypatch.setattr("sky.check.get_cached_enabled_clouds_or_refresh", lambda *_a, **_k: enabled)
    monkeypatch.setattr("sky.check.check", lambda *_a, **_k: None)
    return enabled


def cli_env(runtime_dir: Path | None) -> dict[str, str]:
    """Environment for a ``skyresume`` subprocess: the network guard, and the given
    SkyPilot runtime directory (or an empty one: no catalog)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKY")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(NETGUARD), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    if runtime_dir is not None:
        env["SKY_RUNTIME_DIR"] = str(runtime_dir)
        env["HOME"] = str(runtime_dir)
    return env
