"""Wiring the reconciler and a launcher into a running service (``skyresume serve``)."""

from __future__ import annotations

from fastapi import FastAPI

from orchestrator.domain.reconcile import ReconcileConfig
from orchestrator.reconciler.loop import Reconciler
from orchestrator.settings import Settings


def make_launcher(settings: Settings, token: str):  # type: ignore[no-untyped-def]
    from orchestrator.api.auth import job_token

    if settings.launcher == "local":
        from orchestrator.launchers.local import LocalLauncher

        return LocalLauncher(
            settings.home / "local-nodes",
            settings.effective_service_url,
            lambda job_id: job_token(token, job_id),
            provider=settings.local_provider,
            gpu_memory_gib=settings.local_gpu_memory_gib,
            replacement_gpu_memory_gib=settings.local_replacement_gpu_memory_gib,
            regions=tuple(settings.local_regions.split(",")),
            hosts_per_region=settings.local_hosts_per_region,
        )
    from orchestrator.launchers.skypilot import SkyPilotLauncher

    return SkyPilotLauncher(settings=settings, token_for=lambda j: job_token(token, j))


def attach_reconciler(app: FastAPI, config: ReconcileConfig | None = None) -> Reconciler:
    """Give ``app`` a launcher (for chaos and status) and a reconciler, not yet started."""
    settings: Settings = app.state.settings
    launcher = make_launcher(settings, app.state.token)
    app.state.launcher = launcher
    rec = Reconciler(
        sessionmaker=app.state.sessionmaker,
        launcher=launcher,
        service_url=settings.effective_service_url,
        config=config or ReconcileConfig(),
        interval_s=settings.reconcile_interval_s,
    )
    app.state.reconciler = rec
    return rec
