"""The reference script under torchrun, as the agent sees it: the datagrams of the
contract, the control file, straggler reports, and a corrupted replica caught by
the reference pass before it is checkpointed (exit 79)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datagrams import Listener
from testkit import torchrun

from orchestrator.contract import Env, ExitCode
from training.checkpoint import find_latest_complete

WORKER = Path(__file__).with_name("run_worker.py")


@pytest.mark.slow
@pytest.mark.e2e
def test_datagrams_control_file_straggler_and_silent_corruption(tmp_path, monkeypatch):
    agent = Listener()
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"checkpoint_every": 3}))  # overrides --checkpoint-every 50
    monkeypatch.setenv(Env.PROGRESS_ADDR, agent.addr)
    monkeypatch.setenv(Env.CONTROL_FILE, str(control))
    root = tmp_path / "ckpt"
    proc = torchrun(
        "-m",
        "training.examples.train_gpt",
        "--max-steps", "30",
        "--checkpoint-uri", f"file://{root}",
        "--checkpoint-every", "50",
        "--straggler-every", "1",  # 9 shares: the slow rank is reported from its 3rd
        "--slow-rank", "1",
        "--slow-seconds", "0.05",
        "--inject-corruption-at", "7",
    )  # fmt: skip
    out = proc.communicate(timeout=300)[0].decode()
    agent.close()
    assert f"exitcode  : {int(ExitCode.SILENT_CORRUPTION)}" in out, out[-3000:]

    for rank in (0, 1):
        mine = [d for d in agent.got if d["rank"] == rank]
        resumed = [i for i, d in enumerate(mine) if d["type"] == "resumed"]
        progress = [i for i, d in enumerate(mine) if d["type"] == "progress"]
        assert len(resumed) == 1 and resumed[0] < progress[0]
        assert (mine[resumed[0]]["step"], mine[resumed[0]]["manifest_digest"]) == (0, None)
        steps = [mine[i]["step"] for i in progress]
        assert steps == list(range(1, 10))
        assert all(mine[i]["loss"] > 0 and mine[i]["grad_norm"] > 0 for i in progress)

    # The control file's interval, not the flag's; committed saves reported by rank 0.
    ckpts = agent.of("checkpoint")
    assert [(c["step"], c["rank"], c["world_size"]) for c in ckpts] == [(3, 0, 2), (6, 0, 2)]
    assert ckpts[0]["uploaded_uri"] == f"file://{root}/step_3"

    stragglers = agent.of("anomaly")
    assert any(a["kind"] == "straggler" and "rank 1 took" in a["detail"] for a in stragglers)

    # Corrupted after step 7's update; caught by the pass before the save at 9, on
    # every rank, and that save never happened.
    sdc = [a for a in agent.of("anomaly") if a["kind"] == "silent_corruption"]
    assert sorted(a["rank"] for a in sdc) == [0, 1] and {a["step"] for a in sdc} == {9}
    assert {e["code"] for e in agent.of("exit")} == {int(ExitCode.SILENT_CORRUPTION)}
    found = find_latest_complete(root)
    assert found is not None and found.manifest.step == 6
    assert not (root / "step_9").exists()


@pytest.mark.slow
@pytest.mark.e2e
def test_ranks_told_to_resume_from_different_steps_refuse_to_train(tmp_path):
    import sys

    sys.path.insert(0, str(WORKER.parent))
    from run_worker import build

    from training import Run

    # Two checkpoints written by a one-rank run (DCP reshards them onto two ranks).
    model, opt = build()
    run = Run.from_env(model=model, optimizer=opt, env={}, checkpoint_uri=f"file://{tmp_path}")
    run.checkpointer.save(run.state_dict(), 4)  # type: ignore[union-attr]
    run.step = 8
    run.checkpointer.save(run.state_dict(), 8)  # type: ignore[union-attr]
    run.finish()
    tampered = torchrun(str(WORKER), str(tmp_path / "step_8"), str(tmp_path / "step_4"),
                        pythonpath=str(WORKER.parent))  # fmt: skip
    out = tampered.communicate(timeout=180)[0].decode()
    assert f"exitcode  : {int(ExitCode.RESUME_MISMATCH)}" in out, out[-3000:]
    assert "restored step" not in out  # neither rank got past restore()
    assert "ranks 0 at step 8" in out and "ranks 1 at step 4" in out, out[-3000:]
