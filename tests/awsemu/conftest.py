"""With ``SKYRESUME_REQUIRE_AWSEMU=1`` (CI's emulator step sets it) a long emulator
test that would skip (not root, the node template not prepared) fails instead: the
step must never pass by running nothing."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and os.environ.get("SKYRESUME_REQUIRE_AWSEMU") == "1"
        and item.get_closest_marker("long") is not None
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped, but SKYRESUME_REQUIRE_AWSEMU=1: {report.longrepr}"
