"""A bad start of ``skyresume serve`` is one ``error:`` line naming the fix, and
starts nothing: the database is checked (reachable, at this code's revision, not
newer) before anything binds, the port is bound before the reconciler starts, and
TLS, token and second-service problems name the file or the pid.

The command runs in-process (Typer's runner): each case stops before uvicorn would
run, and a subprocess per case would cost an interpreter start on a loaded machine.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from orchestrator.cli import app as cli

NEWER = "9999_from_a_newer_skyresume"


def serve(home: Path, **env: str) -> tuple[int, str]:
    """``skyresume serve`` with only these settings; (exit code, what it printed)."""
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SKYRESUME_")}
    settings = {"SKYRESUME_HOME": str(home), "SKYRESUME_RECONCILE": "false", **env}
    result = CliRunner().invoke(cli, ["serve"], env={**clean, **settings})
    out = result.output  # stdout and stderr, as a terminal shows them
    assert result.exception is None or isinstance(result.exception, SystemExit), out
    return result.exit_code, out


def one_line(out: str) -> str:
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert "Traceback" not in out
    return lines[0]


def _set_revision(url: str, revision: str) -> None:
    from orchestrator.store.db import _normalize

    engine = create_engine(_normalize(url))
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    engine.dispose()


def test_a_database_at_a_newer_revision_is_refused_naming_both(tmp_path, db_url):
    _set_revision(db_url, NEWER)
    code, out = serve(tmp_path, SKYRESUME_DATABASE_URL=db_url)
    line = one_line(out)
    assert code == 1 and NEWER in line and "newer than this code knows" in line


def test_a_database_never_upgraded_names_skyresume_db_upgrade(tmp_path, empty_db_url):
    code, out = serve(tmp_path, SKYRESUME_DATABASE_URL=empty_db_url, SKYRESUME_AUTO_MIGRATE="false")
    line = one_line(out)
    assert code == 1 and "schema is empty" in line and "skyresume db upgrade" in line


@pytest.mark.postgres
def test_postgres_with_the_wrong_user_is_one_line_without_its_password(
    tmp_path, postgres_server_url
):
    rest = postgres_server_url.split("@", 1)[1]
    code, out = serve(tmp_path, SKYRESUME_DATABASE_URL=f"postgresql://nobody_x:hunter2@{rest}")
    line = one_line(out)
    assert code == 1 and "cannot open the database" in line and "hunter2" not in line


def test_a_port_in_use_is_one_line_and_no_reconciler_ran(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        code, out = serve(
            tmp_path, SKYRESUME_PORT=str(port), SKYRESUME_RECONCILE="true",
            SKYRESUME_LOCAL_NETWORK="loopback", SKYRESUME_AGENT_PACKAGE="skyresume-agent",
        )  # fmt: skip
    finally:
        taken.close()
    line = one_line(out)
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line
    engine = create_engine(f"sqlite:///{tmp_path / 'skyresume.db'}")
    with engine.connect() as conn:  # the reconciler takes its lease on its first pass
        assert conn.execute(text("SELECT count(*) FROM leases")).scalar() == 0
    engine.dispose()


def test_a_second_serve_on_one_sqlite_file_names_the_first_ones_pid(tmp_path):
    from orchestrator import server
    from orchestrator.settings import Settings

    with contextlib.ExitStack() as held:
        server.hold_sqlite(Settings(home=tmp_path), held)  # the first service
        code, out = serve(tmp_path)
    line = one_line(out)
    assert code == 1 and f"(pid {os.getpid()})" in line and "skyresume.db" in line


def _key(path: Path, password: bytes | None) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    enc: Any = (serialization.BestAvailableEncryption(password) if password
                else serialization.NoEncryption())  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8, enc))  # fmt: skip
    return path


@pytest.mark.parametrize(
    ("case", "wanted"),
    [
        ("missing-cert", "tls_cert (SKYRESUME_TLS_CERT) {tmp}/nope.pem: no such file"),
        ("cert-without-key", "tls_cert is set but tls_key is not"),
        ("encrypted-key", "is encrypted: serve reads an unencrypted key"),
        ("token-path-is-a-directory", "cannot keep the operator token in {tmp}/token"),
    ],
    ids=["missing-cert", "cert-without-key", "encrypted-key", "token-path-is-a-directory"],
)
def test_a_bad_file_at_start_is_named(tmp_path, case, wanted):
    env: dict[str, str] = {}
    if case == "missing-cert":
        env = {"SKYRESUME_TLS_CERT": str(tmp_path / "nope.pem"),
               "SKYRESUME_TLS_KEY": str(_key(tmp_path / "k.pem", None))}  # fmt: skip
    elif case == "cert-without-key":
        env = {"SKYRESUME_TLS_CERT": str(tmp_path / "c.pem")}
    elif case == "encrypted-key":
        (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\n")
        env = {"SKYRESUME_TLS_CERT": str(tmp_path / "c.pem"),
               "SKYRESUME_TLS_KEY": str(_key(tmp_path / "k.pem", b"secret"))}  # fmt: skip
    else:
        (tmp_path / "token").mkdir()
    code, out = serve(tmp_path, **env)
    line = one_line(out)
    assert code in (1, 2) and wanted.format(tmp=tmp_path) in line, line
    assert "None" not in line and "SKYRESUME_?" not in line
