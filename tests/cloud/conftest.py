"""Real servers on loopback for the cloud adapters: the metadata simulator, moto's
S3 server and gcp-storage-emulator. Each is started by a fixture and stopped after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.cloud.simulator import MetadataSimulator


@pytest.fixture
def sim() -> Iterator[MetadataSimulator]:
    with MetadataSimulator() as s:
        yield s
