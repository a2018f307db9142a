"""The emulated AWS's offline node runtime (orchestrator/awsemu/runtime.py).

The fast tests check the cache and the node's ``.bashrc``. The ``long`` ones take the
prepared template (``scripts/awsemu-prepare``; skipped when it is absent, since
building it needs PyPI) and run SkyPilot's own runtime-setup commands, from the
installed ``sky/skylet/constants.py``, against a copy of it inside a network namespace
with no interfaces: any download would fail, so each check must find its thing there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.awsemu import runtime

ROOT = os.geteuid() == 0


def _bash_env(home: Path, script: str) -> dict[str, str]:
    out = subprocess.run(
        ["env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", "bash", "-c",
         f"source ~/.bashrc && {script} && env -0"],
        capture_output=True, check=True,
    ).stdout.decode()
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def test_a_nodes_bashrc_sends_uv_and_pip_only_to_its_own_wheel_cache(tmp_path: Path) -> None:
    (tmp_path / ".bashrc").write_text(runtime.bashrc_text())
    env = _bash_env(tmp_path, "true")
    wheels = str(tmp_path / runtime.WHEELS_DIR)
    assert env["UV_OFFLINE"] == "1" and env["UV_FIND_LINKS"] == wheels
    assert env["PIP_NO_INDEX"] == "1" and env["PIP_FIND_LINKS"] == wheels
    # The host's /etc/pip.conf names index mirrors: a node must never read it.
    assert env["PIP_CONFIG_FILE"] == "/dev/null"
    assert env["PATH"].split(":")[0] == str(tmp_path / "sky-user-env" / "bin")


def test_sourcing_the_bashrc_twice_does_not_grow_path(tmp_path: Path) -> None:
    (tmp_path / ".bashrc").write_text(runtime.bashrc_text())
    once = _bash_env(tmp_path, "true")["PATH"]
    assert _bash_env(tmp_path, "source ~/.bashrc")["PATH"] == once


def test_the_template_pins_the_versions_skypilots_runtime_checks_look_for() -> None:
    import sky
    from sky.skylet import constants

    reqs = runtime.RUNTIME_REQUIREMENTS
    assert f"ray[default]=={constants.SKY_REMOTE_RAY_VERSION}" in reqs
    assert f"skypilot[remote,aws]=={sky.__version__}" in reqs
    assert "torch==2.13.0" in runtime.USER_REQUIREMENTS  # never a looser pin (a CUDA build)


def test_every_version_is_part_of_the_cache_key() -> None:
    base = runtime.RuntimeSpec()
    assert runtime.RuntimeSpec(uv_version="0.0.1").key() != base.key()
    assert runtime.RuntimeSpec(user_requirements=("torch==2.12.0",)).key() != base.key()
    assert runtime.RuntimeSpec(layout_version=base.layout_version + 1).key() != base.key()
    assert runtime.RuntimeSpec().key() == base.key()


def _refuse_to_build(*_a: object, **_k: object) -> dict[str, object]:
    raise runtime.PrepareError("built")


def test_a_complete_cache_entry_is_reused_without_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = runtime.RuntimeSpec()
    template = tmp_path / f"runtime-{spec.key()}" / runtime.TEMPLATE_DIR
    (template / runtime.STATE_DIR).mkdir(parents=True)
    (template / runtime.MANIFEST).write_text(json.dumps({"key": spec.key()}))
    monkeypatch.setattr(runtime, "build_template", _refuse_to_build)
    link = runtime.prepare_node_template(tmp_path / "emu", tmp_path)
    assert link.resolve() == template.resolve()
    # Linking again (a second `up` on the same home) is a no-op, not an error.
    assert runtime.prepare_node_template(tmp_path / "emu", tmp_path) == link


def test_an_entry_without_its_manifest_is_rebuilt_and_a_failed_build_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = runtime.RuntimeSpec()
    (tmp_path / f"runtime-{spec.key()}" / runtime.TEMPLATE_DIR).mkdir(parents=True)
    monkeypatch.setattr(runtime, "build_template", _refuse_to_build)
    with pytest.raises(runtime.PrepareError, match="built"):
        runtime.prepare_runtime(tmp_path, spec)
    assert not list(tmp_path.glob(".partial-*"))


def test_a_missing_node_python_is_named(tmp_path: Path) -> None:
    spec = runtime.RuntimeSpec(node_python="/nonexistent/python3.11")
    with pytest.raises(runtime.PrepareError, match=re.escape("/nonexistent/python3.11")):
        runtime.build_template(spec, tmp_path / "t", tmp_path)


# --- against the prepared template ------------------------------------------------------


@pytest.fixture(scope="module")
def prepared_template() -> Path:
    template = (runtime.default_cache_root() / f"runtime-{runtime.RuntimeSpec().key()}"
                / runtime.TEMPLATE_DIR)
    if not (template / runtime.MANIFEST).exists():
        pytest.skip("the node template is not prepared (scripts/awsemu-prepare needs PyPI)")
    return template


@pytest.fixture
def node_home(prepared_template: Path, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    runtime.materialize_home(prepared_template, home, os.getuid(), os.getgid())
    return home


def _offline_login_shell(home: Path, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` as SkyPilot runs setup (bash --login -i, ~/.bashrc sourced), traced,
    in a network namespace with no interfaces: nothing it runs can reach anything."""
    wrapped = f"true && ([ -f ~/.bashrc ] && source ~/.bashrc || true) && set -x && ({script})"
    return subprocess.run(
        ["unshare", "--net", "env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin",
         "bash", "--login", "-i", "-c", wrapped],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )


def _executed(trace: str) -> list[str]:
    """The commands bash ran at the top level of ``set -x`` (one ``+``)."""
    return [line for line in trace.splitlines() if line.startswith("+ ")]


@pytest.mark.long
@pytest.mark.skipif(not ROOT, reason="unshare --net needs root")
def test_skypilots_runtime_setup_finds_everything_in_the_template_offline(
    node_home: Path,
) -> None:
    from sky.skylet import constants

    # The API server rsyncs its own skypilot wheel to ~/.sky/wheels/<hash>/; PyPI's
    # wheel of the same version stands in for it (same metadata, same dependencies).
    wheel_hash = "awsemutest"
    wheel_dir = node_home / ".sky" / "wheels" / wheel_hash
    wheel_dir.mkdir(parents=True)
    for whl in (node_home / runtime.WHEELS_DIR).glob("skypilot-*.whl"):
        shutil.copy(whl, wheel_dir)
    script = (
        constants.UV_INSTALLATION_COMMANDS
        + constants.SKY_USER_ENV_CREATION_COMMANDS
        + constants.RAY_SKYPILOT_INSTALLATION_COMMANDS.replace(
            "{sky_wheel_hash}", wheel_hash).replace("{cloud}", "aws")
        + constants.COPY_SKYPILOT_TEMPLATES_COMMANDS
    )
    proc = _offline_login_shell(node_home, script)
    trace = proc.stdout + proc.stderr
    assert proc.returncode == 0, trace[-4000:]
    ran = "\n".join(_executed(trace))
    assert "astral.sh" not in ran  # `uv -V` worked
    assert "--python 3.10" not in ran  # the runtime venv existed
    assert "ray[default]" not in ran  # uv pip list showed ray 2.9.3
    assert "_sky_env_tmp" not in ran  # sky-user-env was usable
    assert (node_home / ".sky" / "python_path").read_text().strip() == str(
        node_home / "skypilot-runtime" / "bin" / "python")
    assert (node_home / ".sky" / "ray_path").read_text().strip() == str(
        node_home / "skypilot-runtime" / "bin" / "ray")
    assert (node_home / ".sky" / "wheels" / "current_sky_wheel_hash").read_text().strip() \
        == wheel_hash


@pytest.mark.long
@pytest.mark.skipif(not ROOT, reason="unshare --net needs root")
def test_a_nodes_python3_is_torch_cpu_and_pip_finds_the_pinned_torch_offline(
    node_home: Path,
) -> None:
    proc = _offline_login_shell(
        node_home,
        "python3 -c 'import torch, sys; print(torch.__version__, sys.prefix)' && "
        "python3 -m pip install torch==2.13.0 py-spy",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"2.13.0+cpu {node_home / 'sky-user-env'}" in out
    assert "Requirement already satisfied: torch==2.13.0" in out


@pytest.mark.long
def test_an_instance_home_is_a_copy_the_template_never_sees_edits_of(
    prepared_template: Path, node_home: Path
) -> None:
    probe = node_home / "skypilot-runtime" / "pyvenv.cfg"
    before = (prepared_template / "skypilot-runtime" / "pyvenv.cfg").read_text()
    probe.write_text(before + "# edited on a node\n")
    assert (prepared_template / "skypilot-runtime" / "pyvenv.cfg").read_text() == before
    with pytest.raises(FileExistsError):
        runtime.materialize_home(prepared_template, node_home, os.getuid(), os.getgid())
