"""An Accelerate loop under skyresume: the lines marked ``# skyresume`` (torchrun or python)."""

import argparse

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from transformers import GPT2Config, GPT2LMHeadModel

from training.integrations.accelerate import AccelerateRun, batch_plan  # skyresume


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    a = p.parse_args()
    # The shuffle is drawn from (seed, epoch), so a resumed process sees the same order.
    seedable = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), dataloader_config=seedable)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=128,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (256, 16), generator=torch.Generator().manual_seed(1234))
    # A generator of its own: iter() draws no seed from the global RNG, which a resume restores.
    data_rng = torch.Generator().manual_seed(0)
    plan = batch_plan(a.batch_size)  # skyresume: after an OOM a smaller micro-batch, same global
    loader = torch.utils.data.DataLoader(ids, plan.micro_batch, shuffle=True, generator=data_rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, a.max_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    run = AccelerateRun(accelerator)  # skyresume
    start = run.restore()  # skyresume: accelerator.load_state of the agreed checkpoint
    epoch, skip = divmod(start * plan.grad_accum, len(loader))
    loader.set_epoch(epoch)
    batches = iter(accelerator.skip_first_batches(loader, skip))
    for _step in run.steps(a.max_steps):  # skyresume: SIGTERM saves and exits 75
        for _micro in range(plan.grad_accum):
            batch = next(batches, None)
            if batch is None:
                epoch += 1
                loader.set_epoch(epoch)
                batches = iter(loader)
                batch = next(batches)
            loss = model(input_ids=batch, labels=batch).loss / plan.grad_accum
            accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        run.report(loss=loss * plan.grad_accum, grad_norm=norm)  # skyresume: NaN: 76, no update
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    run.finish()  # skyresume
    accelerator.wait_for_everyone()
    accelerator.save_model(model, f"{a.output_dir}/final")


if __name__ == "__main__":
    main()
