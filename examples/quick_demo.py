"""Train the same tiny byte-level GPT with AdamW and with DASH and print their losses.

The data is the Python standard library's own source (held-out files for
validation); the run takes a minute or two on a 2-core CPU.

    .venv/bin/python examples/quick_demo.py [--steps 300]
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_dash import DASH
from lightning_dash.demos import TinyGPT, load_stdlib_corpus


def evaluate(model: TinyGPT, corpus, context: int, batches: int = 8) -> float:
    generator = torch.Generator().manual_seed(1)
    model.eval()
    with torch.no_grad():
        losses = [model.loss(*corpus.batch("validation", 32, context, generator)).item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def train(name: str, make_optimizer, corpus, steps: int, context: int, report_every: int) -> dict[int, float]:
    torch.manual_seed(0)
    model = TinyGPT(context=context)
    optimizer = make_optimizer(model)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    generator = torch.Generator().manual_seed(0)
    history, start = {}, time.perf_counter()
    for step in range(1, steps + 1):
        tokens, targets = corpus.batch("train", 32, context, generator)
        optimizer.zero_grad()
        model.loss(tokens, targets).backward()
        optimizer.step()
        schedule.step()
        if step % report_every == 0 or step == steps:
            history[step] = evaluate(model, corpus, context)
    print(f"{name}: {time.perf_counter() - start:.1f} s")
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    corpus = load_stdlib_corpus(max_bytes=2_000_000)
    print(f"stdlib corpus: {corpus.train.numel():,} training bytes, {corpus.validation.numel():,} validation bytes")
    every = max(1, args.steps // 6)
    runs = {
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01),
        "DASH": lambda m: DASH(m.parameters(), lr=3e-3, weight_decay=0.01, block_size=256, precondition_frequency=10),
    }
    histories = {name: train(name, make, corpus, args.steps, args.context, every) for name, make in runs.items()}
    print(f"\n{'step':>6} | {'AdamW val loss':>14} | {'DASH val loss':>13}")
    print("-" * 40)
    for step in histories["AdamW"]:
        print(f"{step:>6} | {histories['AdamW'][step]:>14.4f} | {histories['DASH'][step]:>13.4f}")


if __name__ == "__main__":
    main()
