"""The offline node runtime of the emulated AWS: the home every emulated instance boots with.

SkyPilot's runtime setup (``setup_commands`` of ``sky/templates/aws-ray.yml.j2``, built
from ``sky/skylet/constants.py``) installs uv from astral.sh, a CPython 3.10 venv, Ray
and SkyPilot from PyPI. Emulated instances have no internet, so each of those checks
must find its thing already there. This module builds, once per set of versions, a
template home that does exactly that, and a wheel cache for what is installed anyway.

Layout of ``<emu-home>/node-template/`` (a symlink into the build cache). Each
instance's ``/home/ubuntu`` is an overlay with this template as its lower layer
(``hosts.py``), which ``up`` hands to user ``ubuntu`` once: overlayfs checks a write
against the lower file's owner. :func:`materialize_home` makes a plain copy instead
(the tests use it):

``.local/bin/uv``
    uv, taken from the ``uv`` wheel on PyPI. ``SKY_UV_INSTALL_CMD`` runs
    ``$HOME/.local/bin/uv -V`` and only pipes astral.sh's installer to ``sh`` when that
    fails.
``skypilot-runtime/``
    A relocatable Python 3.11 venv (Debian's ``/usr/bin/python3.11``, which every node
    sees: nodes share the host's root filesystem) holding ``skypilot[remote,aws]``,
    ``ray[default]==2.9.3`` (``SKY_REMOTE_RAY_VERSION``), ``click<8.3`` and
    ``setuptools<70``. ``UV_INSTALLATION_COMMANDS`` skip ``uv venv --python 3.10``
    because the directory exists (3.10 would be a download); ``RAY_INSTALLATION_COMMANDS``
    skip Ray because ``uv pip list`` shows 2.9.3, and their unconditional
    ``uv pip install "setuptools<70"`` / ``"click<8.3.0"`` are already satisfied.
    ``SKYPILOT_WHEEL_INSTALLATION_COMMANDS`` always reinstall the API server's own
    skypilot wheel (its hash is unknown here): every dependency is already installed
    and in the wheel cache, so uv does that offline.
``sky-user-env/``
    A relocatable venv with ``torch==2.13.0`` (CPU), numpy, py-spy and pip. SkyPilot
    activates ``~/sky-user-env`` for every task's setup and run
    (``ACTIVATE_SKY_USER_ENV``), so there ``python3`` is this one and skyresume's
    gpt-cpu template finds torch; ``SKY_USER_ENV_CREATION_COMMANDS`` see it usable and
    skip. ``.bashrc`` also puts its ``bin`` first on ``PATH`` for plain ssh sessions.
``.skyresume-awsemu/wheels/``
    Every wheel of both venvs (about 1 GB). ``.bashrc`` names it as
    ``UV_FIND_LINKS``/``PIP_FIND_LINKS`` with ``UV_OFFLINE=1``/``PIP_NO_INDEX=1``, and
    ``PIP_CONFIG_FILE=/dev/null`` so the host's ``/etc/pip.conf`` (its index mirrors and
    constraints) never applies on a node. SkyPilot runs ``setup_commands`` with
    ``source_bashrc=True`` (``bash --login -i``), so uv and pip see these.
``.skyresume-awsemu/manifest.json``
    The versions, the cache key and the build's duration and size.

Why an overlay or a copy per instance, never one shared home: SkyPilot's setup writes
into it (``~/.sky``, the reinstalled skypilot wheel, ``ray_patches`` editing Ray's files
in place), so each instance needs files of its own. A hard-linked copy (``cp -al``)
would let one node's edits, and its ``chown``, reach the template.

The build needs PyPI (``pip wheel`` resolves with the host's pip settings); the venvs
are then installed from the wheel directory with uv ``--offline --no-index``, which
proves the cache complete. It is keyed by the versions below under
``$SKYRESUME_AWSEMU_CACHE`` (default ``~/.cache/skyresume-awsemu``), so a second
prepare is a lookup.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

#: uv for the nodes (and for building their venvs). SkyPilot only needs ``uv -V`` to work.
UV_VERSION = "0.13.9"
#: What ``sky/skylet/constants.py`` checks for or installs into ``~/skypilot-runtime``.
RUNTIME_REQUIREMENTS = (
    "skypilot[remote,aws]==0.14.1",
    "ray[default]==2.9.3",
    "click<8.3",
    "setuptools<70",
    "pip",
    "wheel",
)
#: The node's own Python for user tasks (gpt-cpu): torch pinned exactly, since a looser
#: range resolves to a multi-GB CUDA build; pip because setup runs ``python3 -m pip``.
USER_REQUIREMENTS = ("torch==2.13.0", "numpy", "py-spy>=0.3.14", "pip")
#: Every node's base interpreter. Debian's, not the pyenv one under /root (mode 700,
#: which user ubuntu cannot traverse); SkyPilot's runtime needs Python < 3.12.
NODE_PYTHON = "/usr/bin/python3.11"
#: Bumped when the layout changes, so an old cache entry is never reused.
LAYOUT_VERSION = 1

TEMPLATE_DIR = "node-template"
STATE_DIR = ".skyresume-awsemu"
WHEELS_DIR = f"{STATE_DIR}/wheels"
MANIFEST = f"{STATE_DIR}/manifest.json"


@dataclass(frozen=True)
class RuntimeSpec:
    """What a node template is built from; its hash is the cache key."""

    uv_version: str = UV_VERSION
    runtime_requirements: tuple[str, ...] = RUNTIME_REQUIREMENTS
    user_requirements: tuple[str, ...] = USER_REQUIREMENTS
    node_python: str = NODE_PYTHON
    layout_version: int = LAYOUT_VERSION

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class PrepareError(RuntimeError):
    """The node template could not be built; the message names the step."""


def default_cache_root() -> Path:
    env = os.environ.get("SKYRESUME_AWSEMU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "skyresume-awsemu"


def bashrc_text() -> str:
    """The node's ``~/.bashrc``: nothing a node runs may reach an index."""
    return f"""\
# Written by orchestrator/awsemu/runtime.py: an emulated instance has no internet, so
# uv and pip install only from the wheel cache in this home.
export UV_OFFLINE=1
export UV_FIND_LINKS="$HOME/{WHEELS_DIR}"
export UV_PYTHON_DOWNLOADS=never
export PIP_CONFIG_FILE=/dev/null
export PIP_NO_INDEX=1
export PIP_FIND_LINKS="$HOME/{WHEELS_DIR}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export SKYPILOT_DISABLE_USAGE_COLLECTION=1
case ":$PATH:" in
  *":$HOME/sky-user-env/bin:"*) ;;
  *) export PATH="$HOME/sky-user-env/bin:$HOME/.local/bin:$PATH" ;;
esac
"""


def _run(step: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise PrepareError(f"{step} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _fetch_uv(spec: RuntimeSpec, work: Path, dest: Path) -> None:
    """The uv binary out of its PyPI wheel (the wheel carries it as a data script)."""
    dl = work / "uv-wheel"
    _run(
        "downloading uv",
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--only-binary=:all:", "--dest", str(dl), f"uv=={spec.uv_version}"],
    )
    wheels = sorted(dl.glob("uv-*.whl"))
    if not wheels:
        raise PrepareError(f"no uv {spec.uv_version} wheel was downloaded into {dl}")
    with zipfile.ZipFile(wheels[0]) as zf:
        names = [n for n in zf.namelist() if n.endswith(".data/scripts/uv")]
        if not names:
            raise PrepareError(f"{wheels[0].name} holds no uv binary")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(zf.read(names[0]))
    dest.chmod(0o755)


def _build_wheels(requirements: tuple[str, ...], wheels: Path) -> None:
    # pip wheel, not pip download: a dependency published only as an sdist is built here,
    # once, so no node ever needs a compiler or an index.
    _run(
        f"building wheels for {', '.join(requirements)}",
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels),
         *requirements],
    )


def _make_venv(uv: Path, venv: Path, python: str, requirements: tuple[str, ...],
               wheels: Path, uv_cache: Path) -> None:
    env = {
        **os.environ,
        "UV_CACHE_DIR": str(uv_cache),
        # copy: the template must not share inodes with uv's cache under /root.
        "UV_LINK_MODE": "copy",
        "UV_PYTHON_DOWNLOADS": "never",
    }
    env.pop("VIRTUAL_ENV", None)
    # --relocatable: the venv is built here and runs as /home/ubuntu/<name> on a node;
    # uv then writes entry points and activate scripts that find their venv at run time.
    _run(f"creating {venv.name}",
         [str(uv), "venv", "--relocatable", "--python", python, str(venv)], env)
    _run(
        f"installing into {venv.name} from the wheel cache",
        [str(uv), "pip", "install", "--offline", "--no-index", "--find-links", str(wheels),
         "--python", str(venv / "bin" / "python"), *requirements],
        env,
    )


def build_template(spec: RuntimeSpec, out: Path, cache_root: Path) -> dict[str, object]:
    """Build a node template home at ``out`` (which must not exist). Needs PyPI."""
    if not Path(spec.node_python).exists():
        raise PrepareError(f"the nodes' Python {spec.node_python} is missing on this host")
    started = time.monotonic()
    out.mkdir(parents=True)
    wheels = out / WHEELS_DIR
    wheels.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="awsemu-prepare-", dir=cache_root) as tmp:
        uv = out / ".local" / "bin" / "uv"
        _fetch_uv(spec, Path(tmp), uv)
        _build_wheels(spec.runtime_requirements, wheels)
        _build_wheels(spec.user_requirements, wheels)
        uv_cache = cache_root / "uv-cache"
        _make_venv(uv, out / "skypilot-runtime", spec.node_python,
                   spec.runtime_requirements, wheels, uv_cache)
        _make_venv(uv, out / "sky-user-env", spec.node_python,
                   spec.user_requirements, wheels, uv_cache)
    (out / ".bashrc").write_text(bashrc_text())
    # A login shell (SkyPilot's bash --login) reads .profile, not .bashrc.
    (out / ".profile").write_text('[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n')
    manifest: dict[str, object] = {
        **asdict(spec),
        "key": spec.key(),
        "build_seconds": round(time.monotonic() - started, 1),
        "size_bytes": _du(out),
        "wheels_bytes": _du(wheels),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def prepare_runtime(cache_root: Path | None = None, spec: RuntimeSpec | None = None) -> Path:
    """The cached node template for ``spec``, built first when absent. Returns its path."""
    spec = spec or RuntimeSpec()
    cache_root = (cache_root or default_cache_root()).resolve()
    cache_root.mkdir(parents=True, exist_ok=True)
    entry = cache_root / f"runtime-{spec.key()}"
    template = entry / TEMPLATE_DIR
    if (template / MANIFEST).exists():
        return template
    # Built aside and renamed: a prepare killed half-way never leaves an entry that
    # looks complete (the manifest is written last, the rename is atomic).
    partial = cache_root / f".partial-{spec.key()}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        build_template(spec, partial / TEMPLATE_DIR, cache_root)
        shutil.rmtree(entry, ignore_errors=True)
        partial.rename(entry)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return template


def prepare_node_template(emu_home: Path, cache_root: Path | None = None) -> Path:
    """``<emu_home>/node-template``, pointing at the cached template. Returns that path."""
    template = prepare_runtime(cache_root)
    emu_home.mkdir(parents=True, exist_ok=True)
    link = emu_home / TEMPLATE_DIR
    if link.is_symlink() or link.exists():
        if link.is_symlink() and link.resolve() == template:
            return link
        if link.is_symlink():
            link.unlink()
        else:
            shutil.rmtree(link)
    link.symlink_to(template, target_is_directory=True)
    return link


def read_manifest(template: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((template / MANIFEST).read_text())
    return data


def materialize_home(template: Path, dest: Path, uid: int, gid: int) -> None:
    """A per-instance home at ``dest``: a full copy of ``template``, owned by uid:gid.

    A real copy (reflinked where the filesystem can): SkyPilot's setup edits files in
    the home, and a hard link would carry those edits (and the chown) into the template.
    """
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty: an instance home is made once")
    dest.mkdir(parents=True, exist_ok=True)
    _run("copying the node template",
         ["cp", "-a", "--reflink=auto", f"{template.resolve()}/.", str(dest)])
    _run("handing the home to its user", ["chown", "-R", f"{uid}:{gid}", str(dest)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.awsemu.runtime",
        description="Prepare the emulated AWS's offline node runtime (needs PyPI once).",
    )
    parser.add_argument("--home", type=Path, default=None,
                        help="the emulator's home, to link its node-template (default: "
                             "only fill the build cache)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="build cache (default $SKYRESUME_AWSEMU_CACHE or "
                             "~/.cache/skyresume-awsemu)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if args.home is None:
            link = prepare_runtime(args.cache)
        else:
            link = prepare_node_template(args.home, args.cache)
    except PrepareError as exc:
        print(f"awsemu-prepare: {exc}", file=sys.stderr)
        return 1
    manifest = read_manifest(link)
    print(json.dumps({
        "node_template": str(link),
        "cache_entry": str(link.resolve()),
        "seconds": round(time.monotonic() - started, 1),
        "cold_build_seconds": manifest["build_seconds"],
        "size_bytes": manifest["size_bytes"],
        "wheels_bytes": manifest["wheels_bytes"],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
