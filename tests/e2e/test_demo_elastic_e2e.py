"""``skyresume demo --elastic`` end to end: the service, 3 netns nodes x 1 gloo rank,
a node killed, the survivors shrunk to 2 at once, the standby replacement, the grow
back to 3. The demo checks the service's records itself (orchestrator/demo_elastic.py
``elastic_problems``); its exit status is the claim."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.demo_elastic import MIN_STEPS, run_demo

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.long  # CI runs it in .ci/run's long step
def test_demo_elastic_shrinks_onto_the_survivors_and_grows_back_losing_no_step(
    tmp_path: Path,
) -> None:
    import torch

    home = tmp_path / "demo"
    assert run_demo(home=home, steps=MIN_STEPS, timeout_s=800) == 0
    # The run went to its last step: the final weights were saved at it.
    assert torch.load(home / "final_weights.pt", weights_only=True)["step"] == MIN_STEPS
