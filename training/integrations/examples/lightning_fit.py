"""A Lightning script under skyresume: three lines marked ``# skyresume`` (torchrun or python)."""

import argparse
import os

import lightning.pytorch as pl
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from training.integrations.lightning import ResumableDataLoader, fit  # skyresume


class TinyGPT(pl.LightningModule):
    def __init__(self, max_steps: int) -> None:
        super().__init__()
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=128,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
        self.model = GPT2LMHeadModel(config)
        self.max_steps = max_steps

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, self.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    a = p.parse_args()
    pl.seed_everything(0)
    model = TinyGPT(a.max_steps)
    ids = torch.randint(0, 128, (256, 16), generator=torch.Generator().manual_seed(1234))
    data_rng = torch.Generator().manual_seed(0)  # the shuffle draws nothing from the global RNG
    loader = ResumableDataLoader(ids, a.batch_size, shuffle=True, generator=data_rng)  # skyresume
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # under torchrun: its processes
    trainer = pl.Trainer(
        max_steps=a.max_steps, default_root_dir=a.output_dir, gradient_clip_val=1.0,
        enable_checkpointing=False, logger=False, enable_progress_bar=False,
        devices=per_node, num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // per_node,
    )  # fmt: skip
    fit(trainer, model, loader)  # skyresume: was trainer.fit(model, loader)
    trainer.save_checkpoint(f"{a.output_dir}/final.ckpt")


if __name__ == "__main__":
    main()
