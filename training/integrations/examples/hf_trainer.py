"""A Trainer script under skyresume: two lines marked ``# skyresume`` (torchrun or python)."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from training.integrations.hf import train  # skyresume


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    a = p.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=128,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=1e-3,
        logging_steps=10,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(256, 16, 128))
    train(trainer)  # skyresume: was trainer.train()
    trainer.save_model(f"{a.output_dir}/final")


if __name__ == "__main__":
    main()
