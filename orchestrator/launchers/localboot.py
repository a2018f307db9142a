"""What a cloud does between "launch accepted" and "your task is running", for the
local provisioner: ``python -m orchestrator.launchers.localboot CLUSTER.json``.

One boot process per launch request, started by :class:`LocalLauncher.launch` and
left to run on its own (the service never waits on it), so that a launch here takes
time and can fail after it was accepted, as on a cloud:

1. wait the provisioning delay (a VM takes minutes to boot; here a setting);
2. refuse for capacity when the region is stocked out by then (``chaos stockout``);
3. on every node, run the rendered SkyPilot task's ``setup`` (in the node's network
   namespace, with the task's envs and secrets and the ``SKYPILOT_*`` values), all
   nodes at once; a failed setup fails the request, naming the node and its log.
   The node's ``python3`` and ``pip`` are its own first (:func:`prepare_python`): a
   user's ``pip install`` lands on the node's disk, never in the service's venv;
4. start the task's ``run`` on every node and write the request's state ``up``.

The state file (``<cluster>.state.json``: phase, detail, capacity, hosts) is what
:meth:`LocalLauncher.progress` reads; it is written atomically, last of all, so a
reader never sees ``up`` before every node's run started. Nothing here decides
anything: it carries out the launch the service asked for, like a provider.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Every process of a local node carries this variable (see local.py): the node's
#: setup, its run (the agent), torchrun and every rank inherit it.
NODE_MARKER = "SKYRESUME_LOCAL_NODE"


def write_state(path: Path, **state: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**state, "at": time.time()}))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def stocked_out(path: Path, region: str) -> bool:
    until = read_json(path).get(region)
    return isinstance(until, int | float) and until > time.time()


def _popen(node: dict[str, Any], script: str, log_name: str) -> subprocess.Popen[bytes]:
    """``bash -c script`` on the node: in its namespace, with exactly its environment
    (the task's envs and secrets, SkyPilot's values; nothing of the service's own)."""
    logs = Path(node["log_dir"])
    logs.mkdir(parents=True, exist_ok=True)
    Path(node["env"]["HOME"]).mkdir(parents=True, exist_ok=True)
    with open(logs / log_name, "ab") as log:
        return subprocess.Popen(
            [*node["exec_prefix"], "/bin/bash", "-c", script],
            env=node["env"],
            cwd=node["env"]["HOME"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def prepare_python(venv: Path) -> None:
    """The node's own Python environment at ``venv`` (once per node disk): a venv of
    this interpreter's base whose ``.pth`` adds this interpreter's site directories
    after its own, so the node imports what the image has (torch) while ``pip
    install`` (and ``python3 -m pip``, and ``uv pip`` under ``VIRTUAL_ENV``) writes
    into the venv: sys.prefix is the venv's, and pip leaves a package outside its
    environment where it is. Without it, a user's setup ran the service's own pip
    and installed into the service's environment (#26)."""
    import site
    import venv as venv_module

    if (venv / "bin" / "python3").exists():
        return
    new = venv.with_name(venv.name + f".new-{os.getpid()}")
    venv_module.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(new)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    dirs = [d for d in (*site.getsitepackages(), site.getusersitepackages()) if Path(d).is_dir()]
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs)
    (new / "lib" / ver / "site-packages" / "_skyresume_image.pth").write_text(lines)
    for name in ("pip", "pip3", f"pip{sys.version_info.major}.{sys.version_info.minor}"):
        shim = new / "bin" / name  # a venv made without pip has none: the image's would run
        shim.write_text('#!/bin/sh\nexec "$(dirname "$0")/python3" -m pip "$@"\n')
        shim.chmod(0o755)
    try:
        os.rename(new, venv)
    except OSError:  # made meanwhile by another boot on the same disk: keep that one
        import shutil

        shutil.rmtree(new, ignore_errors=True)


def boot(spec_path: Path) -> int:
    spec = read_json(spec_path)
    state = Path(spec["state_file"])
    nodes: list[dict[str, Any]] = spec["nodes"]
    time.sleep(max(0.0, float(spec.get("delay_s", 0.0))))
    if spec.get("check_capacity") and stocked_out(Path(spec["stockout_file"]), spec["region"]):
        write_state(
            state,
            phase="failed",
            capacity=True,
            detail=(
                f"InsufficientInstanceCapacity: local region {spec['region']} has no capacity "
                f"for {spec['instance_type']} (skyresume chaos stockout)"
            ),
        )
        return 1
    for n in nodes:
        if n.get("venv"):
            prepare_python(Path(n["venv"]))
    if spec.get("setup"):
        procs = [(n, _popen(n, spec["setup"], "setup.log")) for n in nodes]
        for n, p in procs:
            code = p.wait()
            if code != 0:
                write_state(
                    state,
                    phase="failed",
                    capacity=False,
                    detail=(
                        f"setup failed on {n['node_id']} (exit {code}); see "
                        f"{Path(n['log_dir']) / 'setup.log'}"
                    ),
                )
                return 1
    for n in nodes:
        p = _popen(n, spec["run"], "run.log")
        (Path(n["log_dir"]).parent / "agent.pid").write_text(str(p.pid))
    write_state(state, phase="up", capacity=False, detail="", hosts=spec["hosts"])
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m orchestrator.launchers.localboot CLUSTER.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        return boot(path)
    except Exception as e:  # the request fails, saying why; never a silent hang
        state = read_json(path).get("state_file")
        if state:
            write_state(Path(state), phase="failed", capacity=False, detail=f"boot: {e}")
        raise


if __name__ == "__main__":
    sys.exit(main())
