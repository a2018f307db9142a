"""Packaging facts the README and deployment rely on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_cli_imports_no_heavy_sdk_at_startup():
    code = (
        "import sys, orchestrator.cli as c; "
        "heavy = {'torch', 'sky', 'boto3', 'google.cloud.storage', 'sqlalchemy', 'fastapi', "
        "'uvicorn'} & set(sys.modules); print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_compose_file_wires_postgres_storage_and_service():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert {"postgres", "s3", "gcs", "skyresume"} <= set(doc["services"])
    env = doc["services"]["skyresume"]["environment"]
    assert env["SKYRESUME_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert doc["services"]["skyresume"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_dockerfile_copies_paths_that_exist():
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
