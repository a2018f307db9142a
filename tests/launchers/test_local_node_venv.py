"""Nothing of a user's ``setup`` runs in the service's environment (issue 26): a local
node's ``python3`` and ``pip`` are its own venv's, on its disk, layered over the
image's packages, so a setup's ``pip install`` lands on the node and the service's
venv is never written. Runs the setup step as the local provisioner does
(``localboot``: the node's venv, then ``bash -c setup`` with the node's environment);
no node, agent or network namespace is started."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import zipfile
from pathlib import Path

from orchestrator.domain.plan import Placement
from orchestrator.launchers.base import LaunchRequest
from orchestrator.launchers.local import LocalLauncher
from orchestrator.launchers.localboot import _popen, prepare_python

PROBE = "skyresume_setup_probe"


def _wheel(tmp_path: Path) -> Path:
    """A wheel pip installs offline: one empty module."""
    path = tmp_path / f"{PROBE}-1.0-py3-none-any.whl"
    info = f"{PROBE}-1.0.dist-info"
    files = {
        f"{PROBE}/__init__.py": "",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: skyresume-setup-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def test_a_setups_pip_install_lands_on_the_node_never_in_the_services_venv(tmp_path):
    launcher = LocalLauncher(tmp_path / "nodes", "http://10.255.255.1:9", lambda *_: "t")
    placement = Placement("local", "local", "cpu-process", None, 0, 1, True)
    request = LaunchRequest(job_id="j", attempt=1, placement=placement, command="")
    node_id = "j-a1-n0"
    try:
        env = launcher._node_env({}, {}, request, 0, node_id, ["127.0.0.1"], None, 29500, "j-a1")
    finally:
        launcher.close()
    venv = launcher.node_python("j", node_id)
    prepare_python(venv)  # as the boot does before setup
    service = Path(sys.prefix).resolve()
    # Checked before anything is installed: with the service's pip first on the
    # node's PATH, the install below would write into this very venv.
    pip = shutil.which("pip", path=env["PATH"])
    assert pip is not None and not Path(pip).resolve().is_relative_to(service), pip
    assert env["VIRTUAL_ENV"] == str(venv)
    wheel = _wheel(tmp_path)
    logs = tmp_path / "logs"
    node = {"node_id": node_id, "env": env, "exec_prefix": [], "log_dir": str(logs)}
    setup = (
        "set -e\n"
        "python3 -c 'import sys, pydantic; print(\"prefix\", sys.prefix)'\n"  # the image's
        f"pip install --quiet --no-index --no-deps {wheel}\n"
        f"python3 -m pip install --quiet --no-index --no-deps --force-reinstall {wheel}\n"
        f"python3 -c 'import {PROBE}; print(\"probe\", {PROBE}.__file__)'\n"
    )
    code = _popen(node, setup, "setup.log").wait(timeout=120)
    out = (logs / "setup.log").read_text()
    assert code == 0, out
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert Path(lines["prefix"]).resolve() == venv.resolve()
    assert Path(lines["probe"]).resolve().is_relative_to(venv.resolve())
    assert importlib.util.find_spec(PROBE) is None  # the service's environment: untouched
    assert not list(service.glob(f"lib/python*/site-packages/{PROBE}*"))
