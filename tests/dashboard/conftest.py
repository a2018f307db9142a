"""Dashboard fixtures: one seeded SQLite app per module (the pages only read), and
clients with their own cookie jars. The store's SQL is tested on both backends in
tests/goodput; the one query of the dashboard's own runs on PostgreSQL in
test_pages_render_on_postgres."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
from dashboard_seed import client, login, make_app, seed


@pytest.fixture(scope="module")
def seeded_app(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("dash")
    application = make_app(f"sqlite:///{tmp / 'test.db'}", tmp / "home")
    application.state.seeded = seed(application)
    yield application
    application.state.engine.dispose()


@pytest.fixture
def seeded(seeded_app) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return seeded_app.state.seeded


@pytest.fixture
def anonymous(seeded_app):  # type: ignore[no-untyped-def]
    with client(seeded_app) as c:
        yield c


@pytest.fixture
def browser_client(seeded_app):  # type: ignore[no-untyped-def]
    """No bearer token; logged in through the form, as a browser is."""
    with client(seeded_app) as c:
        login(c, seeded_app.state.token)
        yield c


@pytest.fixture
def postgres_app(postgres_server_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    from testkit import reset_postgres

    reset_postgres(postgres_server_url)
    application = make_app(postgres_server_url, tmp_path / "home")
    application.state.seeded = seed(application)
    yield application
    application.state.engine.dispose()


CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def chromium():  # type: ignore[no-untyped-def]
    if not CHROMIUM.exists():
        if os.environ.get("SKYRESUME_REQUIRE_BROWSER") == "1":  # CI: scripts/test installs it
            pytest.fail(f"{CHROMIUM} is required (SKYRESUME_REQUIRE_BROWSER=1) but missing")
        pytest.skip(
            f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium); "
            "Playwright's own browser download is not used"
        )
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox"]
        )
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def live_url(seeded_app):  # type: ignore[no-untyped-def]
    """The seeded app served by uvicorn on loopback, as ``skyresume serve`` serves it."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(seeded_app, host="127.0.0.1", port=port, log_level="warning", ws="none")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where browser tests save screenshots: ``$SKYRESUME_TEST_ARTIFACTS`` or
    ``build/test-artifacts`` (ignored by git) under the repository."""
    root = Path(__file__).resolve().parents[2]
    path = Path(os.environ.get("SKYRESUME_TEST_ARTIFACTS") or root / "build" / "test-artifacts")
    path = path / "dashboard"
    path.mkdir(parents=True, exist_ok=True)
    return path
