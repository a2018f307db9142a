"""``skyresume serve`` as the operator runs it, and the wiring in orchestrator.server."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator import server
from orchestrator.settings import Settings

SKYRESUME = [sys.executable, "-m", "orchestrator.cli"]


def _env(home: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYRESUME_")}
    return {**env, "SKYRESUME_HOME": str(home), **settings}


def test_serve_with_the_reconciler_picks_a_port_and_stops_cleanly_on_ctrl_c(tmp_path):
    env = _env(tmp_path, SKYRESUME_PORT="0", SKYRESUME_RECONCILE="true")
    env["SKYRESUME_LAUNCHER"] = "local"
    proc = subprocess.Popen([*SKYRESUME, "serve"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()
        # Port 0 with the reconciler on: agents need the real port before uvicorn binds.
        m = re.search(r"serving on http://127\.0\.0\.1:(\d+) ", banner)
        assert m and int(m.group(1)) != 0, banner
        assert "reconciler on, launcher local" in banner
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{m.group(1)}/readyz", timeout=1).is_success:
                    break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        else:
            pytest.fail("serve did not become ready in 30 s")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_on_a_database_it_cannot_open_is_one_line_without_the_password(tmp_path):
    url = "postgresql+psycopg://nobody:secret@127.0.0.1:1/x"
    env = _env(tmp_path, SKYRESUME_RECONCILE="false", SKYRESUME_AUTO_MIGRATE="true")
    out = subprocess.run(
        [*SKYRESUME, "serve", "--db-url", url], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: cannot open the database postgresql+psycopg://nobody:")
    assert out.stderr.count("\n") == 1 and "secret" not in out.stderr


def test_a_bad_serve_option_is_one_line_naming_the_setting(tmp_path):
    out = subprocess.run(
        [*SKYRESUME, "serve", "--port", "70000"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: bad setting SKYRESUME_PORT: ")
    assert "Traceback" not in out.stderr


def test_the_local_launcher_is_released_with_the_service(tmp_path):
    settings = Settings(home=tmp_path, launcher="local")
    with contextlib.ExitStack() as cleanup:
        launcher = server.make_launcher(settings, "operator-token", cleanup)
        simulator_url = launcher.metadata.url  # type: ignore[attr-defined]
        assert httpx.get(f"{simulator_url}/", timeout=2).status_code < 500
    # Left running, the metadata simulator's server thread outlives `skyresume serve`.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{simulator_url}/", timeout=2)


def test_a_database_error_is_one_line_naming_the_cause_not_the_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(server.DatabaseError) as e:
        server.migrate(url, "upgrade", "no-such-revision")
    message = str(e.value)
    assert "no-such-revision" in message and "\n" not in message
    assert str(tmp_path) not in message  # the CLI prints the URL, redacted
