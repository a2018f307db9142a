"""The agent package: the service serves its nodes a wheel of its own source tree.

A node must run the agent that matches the service it talks to, and must never
``pip install`` a name from a public index that someone else could register. So the
service builds a wheel of the skyresume source tree it runs from (hatchling, through
``pip wheel``) and serves it at ``GET /v1/agent/dist/<wheel>``; the task templates
install exactly that file, pinned by its sha256 (``<url>#sha256=<hex>``: pip refuses a
download whose hash differs).

A wheel is built once per (version, digest of the source files) and cached under
``<home>/agent-dist/<version>-<digest>/``; the digest is written into the wheel as
``orchestrator/_build_id``, so an installed agent can say which build it is
(:func:`installed_build_id`; ``source`` when it runs from a checkout). Builds go into a
temporary directory renamed into place, so two threads or two replicas sharing a home
never see half a wheel.

Stdlib only at import, and Python 3.9 at import: the agent imports
:func:`installed_build_id` from here on the node's own Python. Building and serving
(``tomllib``, 3.11) is the service's side and imports what it needs where it is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orchestrator

if TYPE_CHECKING:
    from orchestrator.settings import Settings

#: Where the service serves wheels (the routes are in orchestrator/api/routes_agents.py).
DIST_PATH = "/v1/agent/dist"
#: The file, inside the ``orchestrator`` package of a built wheel, that names its build.
BUILD_ID_FILE = "_build_id"
#: What an agent that runs from a source checkout (no built wheel) reports as its build.
SOURCE_BUILD = "source"
#: A wheel build is a few seconds; past this, something is wrong (a hung index fetch).
BUILD_TIMEOUT_S = 300.0


class PackageUnavailable(RuntimeError):
    """No agent wheel can be built here; the message says why and what to do instead."""


def installed_build_id() -> str:
    """The build this process's skyresume came from: the source digest written into
    the wheel, or ``source`` when it runs from a checkout."""
    path = Path(orchestrator.__file__).resolve().parent / BUILD_ID_FILE
    try:
        text = path.read_text().strip()
    except OSError:
        return SOURCE_BUILD
    return text or SOURCE_BUILD


def source_root(package_dir: Path | None = None) -> Path:
    """The skyresume source tree this process runs from (``pyproject.toml`` beside the
    ``orchestrator`` package, or beside ``package_dir``), or :class:`PackageUnavailable`."""
    pkg = (package_dir or Path(orchestrator.__file__)).resolve()
    pkg = pkg if pkg.is_dir() else pkg.parent
    root = pkg.parent
    pyproject = root / "pyproject.toml"
    hint = (
        "run the service from a skyresume checkout (pip install -e .), or set "
        "SKYRESUME_AGENT_PACKAGE to a pip spec or wheel URL the nodes can install"
    )
    import tomllib  # novermin: the service's side (3.11+); a node never builds a wheel

    try:
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        raise PackageUnavailable(
            f"no source tree to build the agent wheel from: skyresume runs from {pkg}, "
            f"an installed package with no pyproject.toml beside it; {hint}"
        ) from None
    if name != "skyresume":
        raise PackageUnavailable(f"{pyproject} is the project {name!r}, not skyresume; {hint}")
    return root


def _wheel_inputs(root: Path) -> list[str]:
    """Top-level paths the wheel is built from, as pyproject.toml's hatch config says
    (so a package added there is digested and copied without a change here)."""
    import tomllib  # novermin: the service's side (3.11+); a node never builds a wheel

    doc = tomllib.loads((root / "pyproject.toml").read_text())
    wheel = doc.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {})
    wheel = wheel.get("wheel", {})
    readme = doc["project"].get("readme")
    tops = ["pyproject.toml"]
    if isinstance(readme, str):
        tops.append(readme)
    tops += [str(p) for p in wheel.get("packages", [])]
    tops += [str(p) for p in wheel.get("force-include", {})]
    return list(dict.fromkeys(tops))


def _skipped(rel: Path) -> bool:
    # What a checkout has that no wheel should: bytecode, caches, egg-info, dot-files,
    # and a build id left by an earlier build (the build writes its own).
    parts = rel.parts
    return (
        any(p == "__pycache__" or p.startswith(".") or p.endswith(".egg-info") for p in parts)
        or rel.suffix in (".pyc", ".pyo")
        or parts == ("orchestrator", BUILD_ID_FILE)
    )


def source_files(root: Path) -> list[str]:
    """Every file the wheel is built from, relative to ``root``, sorted."""
    out: list[str] = []
    for top in _wheel_inputs(root):
        path = root / top
        if path.is_file():
            out.append(top)
        elif path.is_dir():
            for f in path.rglob("*"):
                rel = f.relative_to(root)
                if f.is_file() and not _skipped(rel):
                    out.append(rel.as_posix())
        else:
            raise PackageUnavailable(f"the source tree {root} lacks {top}, which the wheel needs")
    return sorted(out)


def source_digest(root: Path, files: list[str]) -> str:
    """sha256 over every (path, content): any edit, addition or removal changes it."""
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0")
        h.update(hashlib.sha256((root / rel).read_bytes()).digest())
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class AgentWheel:
    """One built wheel of the agent package."""

    path: Path
    version: str
    build: str
    """The source digest written into the wheel (what its agent registers with)."""
    sha256: str
    """Of the wheel file: what pip checks the download against."""

    @property
    def filename(self) -> str:
        return self.path.name

    def url(self, service_url: str) -> str:
        return f"{service_url.rstrip('/')}{DIST_PATH}/{self.filename}"

    def pip_spec(self, service_url: str) -> str:
        """The wheel's URL pinned by its hash (pip verifies a ``#sha256=`` fragment)."""
        return f"{self.url(service_url)}#sha256={self.sha256}"


class WheelCache:
    """Builds the agent wheel of ``root`` at most once per (version, source digest),
    under ``<home>/agent-dist``; safe to call from many threads at once.

    The digest is taken once, on first use, and kept: the wheel is of the code this
    service runs, and a URL handed to a node (hash and all) stays valid while the
    service lives, even if someone edits the checkout meanwhile."""

    def __init__(self, home: Path, package_dir: Path | None = None) -> None:
        self.dir = Path(home) / "agent-dist"
        self._package_dir = package_dir
        """The ``orchestrator`` package whose tree is built (default: this process's)."""
        self._lock = threading.Lock()
        self._wheel: AgentWheel | None = None
        self._failed: PackageUnavailable | None = None
        self._started = False
        self._background = False
        """Built by :meth:`start`: at a lower CPU priority, so the service's own start
        and first answers do not wait behind ``pip wheel``."""
        self._done = threading.Event()

    def start(self) -> None:
        """Build in a background thread (at most once): the service answers meanwhile,
        and the package routes read the outcome with :meth:`outcome`."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._background = True
        threading.Thread(target=self._build_quietly, name="agent-wheel", daemon=True).start()

    def _build_quietly(self) -> None:
        with contextlib.suppress(PackageUnavailable):  # kept in _failed
            self.wheel()

    def outcome(self) -> AgentWheel | PackageUnavailable | None:
        """The build's outcome without waiting: the wheel, the failure (kept: a failed
        build is not retried per request), or None while it is being built."""
        if not self._done.is_set():
            return None
        return self._failed or self._wheel

    def wheel(self) -> AgentWheel:
        """The wheel of this service's source tree (built on first use). A failure is
        kept and raised again at once: a build is seconds of ``pip wheel``, and an
        anonymous request must never start one again (45 of them, each rebuilding
        under the lock, held worker threads for 6.6 s)."""
        with self._lock:  # one build at a time; the others wait and reuse it
            self._started = True
            if self._failed is not None:
                raise self._failed
            if self._wheel is not None and self._wheel.path.is_file():
                return self._wheel
            try:
                self._wheel = self._find_or_build()
            except PackageUnavailable as e:
                self._failed = e
                raise
            except OSError as e:
                self._failed = PackageUnavailable(f"building the agent wheel failed: {e}")
                raise self._failed from None
            finally:
                self._done.set()
            return self._wheel

    def _find_or_build(self) -> AgentWheel:
        root = source_root(self._package_dir)
        version = orchestrator.__version__
        digest = source_digest(root, files := source_files(root))
        out = self.dir / f"{version}-{digest[:16]}"
        found = sorted(out.glob("*.whl")) if out.is_dir() else []
        path = found[0] if found else self._build(root, files, digest, out)
        return AgentWheel(path=path, version=version, build=digest, sha256=_sha256_file(path))

    def _build(self, root: Path, files: list[str], digest: str, out: Path) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.dir, prefix=".build-") as tmp:
            # A copy of exactly the digested files, plus the build id: the wheel holds
            # what the digest names, whatever else the checkout has lying around.
            src = Path(tmp) / "src"
            for rel in files:
                dest = src / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, dest)
            (src / "orchestrator" / BUILD_ID_FILE).write_text(digest + "\n")
            dist = Path(tmp) / "dist"
            nice = ["nice", "-n", "10"] if self._background and shutil.which("nice") else []
            cmd = [*nice, sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w",
                   str(dist)]  # fmt: skip
            if importlib.util.find_spec("hatchling") is not None:
                cmd.append("--no-build-isolation")  # offline: the backend is already here
            cmd.append(str(src))
            try:
                done = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                raise PackageUnavailable(f"building the agent wheel failed: {e}") from None
            wheels = sorted(dist.glob("*.whl"))
            if done.returncode != 0 or len(wheels) != 1:
                tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
                raise PackageUnavailable(
                    f"building the agent wheel failed (pip wheel exit {done.returncode}): "
                    f"{tail or 'no wheel written'}"
                )
            version = orchestrator.__version__
            if f"-{version}-" not in wheels[0].name:
                raise PackageUnavailable(
                    f"the built wheel {wheels[0].name} is not version {version} "
                    "(orchestrator.__version__ and pyproject.toml disagree)"
                )
            staged = Path(tmp) / "out"
            staged.mkdir()
            os.replace(wheels[0], staged / wheels[0].name)
            try:
                os.replace(staged, out)  # atomic: nobody sees a directory without its wheel
            except OSError:
                if not any(out.glob("*.whl")):  # another replica did not win the race
                    raise
        return next(iter(sorted(out.glob("*.whl"))))


def agent_package_spec(settings: Settings, cache: WheelCache | None = None) -> str:
    """What nodes ``pip install`` as the agent: ``SKYRESUME_AGENT_PACKAGE`` when the
    operator set it, else this service's wheel URL pinned by its sha256 (built now if
    need be; :class:`PackageUnavailable` when it cannot be)."""
    if settings.agent_package.strip():
        return settings.agent_package.strip()
    wheel = (cache or WheelCache(settings.home)).wheel()
    return wheel.pip_spec(settings.effective_service_url)
