"""``skyresume serve`` with the local launcher in netns mode on a private bridge.

Run as ``python tests/e2e/netns_service.py HOME PORT BRIDGE SUBNET``. It wires the
service exactly as ``orchestrator.server`` does (build_service, run_service), but
hands the launcher a fabric on a bridge and subnet of the test's own, so a test
never touches the demo's ``srbr0``; the service listens on every interface and
tells its nodes the bridge's gateway address, which is where a node reaches it.
(When settings grow a network/bridge/subnet of their own, plain ``serve`` with
those settings replaces this file.)
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(home: str, port: str, bridge: str, subnet: str) -> None:
    from orchestrator.api.auth import job_token
    from orchestrator.launchers.local import LocalLauncher, LocalLauncherConfig
    from orchestrator.launchers.netns import Fabric
    from orchestrator.package import agent_package_spec
    from orchestrator.reconciler.loop import Reconciler
    from orchestrator.server import _wheel_cache, build_service, run_service
    from orchestrator.settings import Settings

    settings = Settings(home=Path(home), port=int(port), host="0.0.0.0", reconcile=False)
    service = build_service(settings)
    app = service.app
    root = settings.home / "local-nodes"
    fabric = Fabric(root / "fabric", bridge=bridge, subnet=subnet)
    fabric.up()
    url = f"http://{fabric.gateway}:{port}"
    # What serve's local launcher hands its nodes: the agent package of this service's
    # own wheel (the templates' setup refuses to run without one).
    package = agent_package_spec(settings.model_copy(update={"public_url": url}), _wheel_cache(app))
    launcher = LocalLauncher(
        root,
        url,
        lambda j, a: job_token(app.state.token, j, a),
        LocalLauncherConfig(
            network="netns",
            package=package,
            pip_args=settings.pip_args or "--no-index --no-deps",
        ),
    )
    launcher._fabric = fabric  # the private bridge, before the launcher makes srbr0
    service.cleanup.callback(fabric.teardown)
    service.cleanup.callback(launcher.close)
    app.state.launcher = launcher
    service.reconciler = Reconciler(
        sessionmaker=app.state.sessionmaker,
        launcher=launcher,
        service_url=url,
        interval_s=settings.reconcile_interval_s,
    )
    app.state.reconciler = service.reconciler
    run_service(service)


if __name__ == "__main__":
    main(*sys.argv[1:5])
