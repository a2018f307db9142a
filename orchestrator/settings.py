"""Service settings, one class, read once per process by the app factory or the CLI.

Precedence, highest first:
1. keyword arguments to ``Settings(...)`` (tests, ``skyresume serve --db-url``);
2. environment variables with the ``SKYRESUME_`` prefix (``SKYRESUME_DATABASE_URL``);
3. a ``.env`` file in the working directory;
4. the defaults below (an embedded SQLite file under ``~/.skyresume/``).

Nothing here is evaluated at import time: building the engine or the app reads a
``Settings`` instance passed to it, so tests never inherit a stale global.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path(os.environ.get("SKYRESUME_HOME", Path.home() / ".skyresume"))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKYRESUME_", env_file=".env", extra="ignore")

    home: Path = Field(default_factory=default_home)
    """State directory: the embedded database, the local token, local launcher dirs."""
    database_url: str = ""
    """SQLAlchemy URL. Empty means ``sqlite:///<home>/skyresume.db``."""
    host: str = "127.0.0.1"
    port: int = 8470
    service_url: str = ""
    """Where clients reach the service; empty means ``http://<host>:<port>``."""
    token: str = ""
    """Operator bearer token. Empty in local mode: ``serve`` creates one in
    ``<home>/token`` (mode 0600) and the CLI reads it from there."""
    auto_migrate: bool | None = None
    """Upgrade the schema on ``serve``. Default: on for SQLite, off otherwise
    (production PostgreSQL is upgraded deliberately with ``skyresume db upgrade``)."""

    reconcile: bool = True
    """Run the reconciler (the restart protocol) inside ``serve``. One replica holds
    the lease at a time, so every replica may leave it on."""
    reconcile_interval_s: float = Field(default=0.5, gt=0)
    launcher: str = "local"
    """``local`` (nodes as process sessions on this machine) or ``skypilot``."""
    local_provider: str = "aws"
    """Which cloud's metadata format the local nodes' agents poll (aws, gcp, azure)."""
    local_gpu_memory_gib: float | None = Field(default=None, gt=0)
    """GPU memory the local nodes declare (none: CPU only, no memory planning)."""
    local_replacement_gpu_memory_gib: float | None = Field(default=None, gt=0)
    """GPU memory replacement nodes declare: less than the first launch's makes the
    memory planner replan activation checkpointing / micro-batch on this machine."""
    local_regions: str = "local"
    """Comma-separated regions of the local launcher; ``skyresume chaos stockout R``
    makes one refuse launches, as a cloud region out of capacity does."""
    local_hosts_per_region: int = Field(default=8, ge=1, le=1024)
    """Hosts each local region has; a host blamed for a hardware fault is never reused."""

    @field_validator("local_regions")
    @classmethod
    def _regions(cls, v: str) -> str:
        names = [r.strip() for r in v.split(",")]
        if not names or any(not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", r) for r in names):
            raise ValueError(
                f"local_regions must be comma-separated names of lower-case letters, "
                f"digits and '-', got {v!r}"
            )
        return ",".join(names)

    @field_validator("launcher")
    @classmethod
    def _launcher(cls, v: str) -> str:
        if v not in ("local", "skypilot"):
            raise ValueError(f"launcher must be local or skypilot, got {v!r}")
        return v

    @field_validator("local_provider")
    @classmethod
    def _provider(cls, v: str) -> str:
        if v not in ("aws", "gcp", "azure"):
            raise ValueError(f"local_provider must be aws, gcp or azure, got {v!r}")
        return v

    @field_validator("port")
    @classmethod
    def _port_range(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError(f"port must be 0-65535, got {v}")
        return v

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'skyresume.db'}"

    @property
    def effective_service_url(self) -> str:
        return (self.service_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def token_path(self) -> Path:
        return self.home / "token"

    @property
    def should_auto_migrate(self) -> bool:
        if self.auto_migrate is not None:
            return self.auto_migrate
        return self.effective_database_url.startswith("sqlite")
