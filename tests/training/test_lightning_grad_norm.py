"""The Lightning integration's grad norm is the one Lightning's clip by norm computes
(kept from it, not computed twice), and a NaN is still caught before the update."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.contract import ExitCode
from tests.training.datagrams import Listener
from training.run import RunExit

pl = pytest.importorskip("lightning.pytorch")


class Tiny(pl.LightningModule):  # type: ignore[misc]
    """A linear model whose loss turns NaN from batch ``nan_at`` on."""

    def __init__(self, nan_at: int | None = None) -> None:
        import torch

        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.nan_at = nan_at

    def training_step(self, batch: Any, idx: int) -> Any:
        loss = (self.layer(batch) ** 2).mean()
        return loss * float("nan") if self.nan_at is not None and idx >= self.nan_at else loss

    def configure_optimizers(self) -> Any:
        import torch

        return torch.optim.SGD(self.parameters(), lr=0.1)


class PreClipNorms(pl.Callback):  # type: ignore[misc]
    """Each step's total grad norm before the clip, and the weights after each update."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.weights: list[Any] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        import torch

        grads = [p.grad for p in pl_module.parameters()]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.weights.append(trainer.lightning_module.layer.weight.detach().clone())


def _fit(module: Tiny, seen: PreClipNorms, monkeypatch: pytest.MonkeyPatch) -> Listener:
    import torch

    from training.integrations import lightning as integration

    def no_second_norm(params: list[Any]) -> Any:
        raise AssertionError("the callback computed a grad norm of its own")

    monkeypatch.setattr(integration, "_grad_norm", no_second_norm)
    listener = Listener()
    monkeypatch.setenv("SKYRESUME_RUN_PROGRESS_ADDR", listener.addr)
    monkeypatch.setenv("SKYRESUME_RUN_CHECKPOINT_URI", "")
    trainer = pl.Trainer(
        max_steps=4, gradient_clip_val=0.5, callbacks=[seen], accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    loader = integration.ResumableDataLoader(torch.randn(16, 4) * 10, batch_size=4)
    try:
        integration.fit(trainer, module, loader)
    finally:
        listener.close()
        # The precision plugin's own clip is back once fit returns.
        assert "clip_grad_by_norm" not in vars(trainer.precision_plugin)
    return listener


def test_the_reported_grad_norm_is_the_one_lightning_clipped_by(monkeypatch):
    seen = PreClipNorms()
    listener = _fit(Tiny(), seen, monkeypatch)
    reported = [d["grad_norm"] for d in listener.of("progress")]
    assert len(reported) == 4 and reported == pytest.approx(seen.norms, rel=1e-6)
    assert max(reported) > 0.5  # so the clip did clip


def test_a_nan_through_the_clip_exits_76_before_the_update(monkeypatch):
    import torch

    module, seen = Tiny(nan_at=2), PreClipNorms()
    with pytest.raises(RunExit) as exc:
        _fit(module, seen, monkeypatch)
    assert exc.value.exit_code is ExitCode.NAN_DETECTED
    # Two updates ran; the third step's NaN reached neither the weights nor a grad.
    assert len(seen.weights) == 2
    assert torch.equal(module.layer.weight.detach(), seen.weights[-1])
    assert all(p.grad is None for p in module.parameters())  # zero_grad(set_to_none)
