"""The README's example script, run as written: it trains, checkpoints, and a second
run resumes where the first one's newest checkpoint left off."""

from __future__ import annotations

import socket

from orchestrator.contract import Env
from training.checkpoint import find_latest_complete


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readme_example_trains_checkpoints_and_resumes(tmp_path, monkeypatch, capfd):
    from training.examples import minimal

    # A one-rank torchrun environment, in this process.
    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        Env.CHECKPOINT_URI: f"file://{tmp_path}",
        Env.CHECKPOINT_EVERY: "300",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    minimal.main()
    found = find_latest_complete(tmp_path)
    assert found is not None and found.manifest.step == 900
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_300", "step_600", "step_900"]

    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    minimal.main()
    assert "resumed from step 900" in capfd.readouterr().err
