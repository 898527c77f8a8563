"""Train the byte-level GPT on the Python standard library's source with Composer and DASH.

The model, optimizer and schedule are ordinary Composer objects (``DecoupledAdamW``
with warmup + cosine); ``algorithms=[Dash(...)]`` swaps the optimizer for DASH, and
``DashComposerMonitor`` logs its step time and health counters. Validation uses held-out
stdlib files. About two minutes on a 2-core CPU with the defaults:

    .venv-composer/bin/python examples/composer_train.py
    .venv-composer/bin/python examples/composer_train.py --optimizer adamw   # the baseline
    .venv-composer/bin/composer -n 2 examples/composer_train.py              # two processes (gloo)
"""

from __future__ import annotations

import argparse
import time

import torch
from composer import Trainer
from composer.loggers import InMemoryLogger
from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW
from composer.utils import dist
from torch.utils.data import DataLoader

from lightning_dash.composer import Dash, DashComposerMonitor
from lightning_dash.showcase import load_stdlib_corpus
from lightning_dash.showcase.composer_models import ComposerTinyGPT
from lightning_dash.showcase.stdlib_text import RandomWindows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizer", choices=("dash", "adamw"), default="dash")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (split over processes)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--precondition-frequency", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=50, help="batches between validations")
    parser.add_argument("--device", default="cpu", help="cpu or gpu")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    corpus = load_stdlib_corpus(max_bytes=2_000_000)
    train = RandomWindows(corpus.train, args.context, args.steps * args.batch_size, seed=0)
    validation = RandomWindows(corpus.validation, args.context, 512, seed=12345)
    per_rank = args.batch_size // dist.get_world_size()
    torch.manual_seed(0)
    model = ComposerTinyGPT(context=args.context, width=args.width, depth=args.depth)
    memory = InMemoryLogger()
    algorithms = []
    callbacks = []
    if args.optimizer == "dash":
        algorithms.append(Dash(block_size=args.block_size, precondition_frequency=args.precondition_frequency))
        callbacks.append(DashComposerMonitor(logging_interval=args.eval_every))
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(train, batch_size=per_rank, sampler=dist.get_sampler(train, shuffle=False)),
        eval_dataloader=DataLoader(validation, batch_size=64, sampler=dist.get_sampler(validation, shuffle=False)),
        eval_interval=f"{args.eval_every}ba",
        optimizers=DecoupledAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=1e-5),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="0.05dur", alpha_f=0.1),
        algorithms=algorithms,
        callbacks=callbacks,
        loggers=[memory],
        max_duration=f"{args.steps}ba",
        device=args.device,
        seed=0,
    )
    started = time.perf_counter()
    trainer.fit()
    elapsed = time.perf_counter() - started
    if dist.get_global_rank() == 0:
        print(f"\noptimizer in use: {type(trainer.state.optimizers[0]).__name__}, {elapsed:.1f} s")
        print(f"{'batch':>6} | {'validation cross-entropy':>24}")
        for timestamp, value in memory.data["metrics/eval/LanguageCrossEntropy"]:
            print(f"{timestamp.batch.value:>6} | {value:>24.4f}")
        if "dash/optimizer_step_ms" in memory.data:
            step_ms = [value for _, value in memory.data["dash/optimizer_step_ms"]]
            print(
                f"DASH optimizer step: median {sorted(step_ms)[len(step_ms) // 2]:.1f} ms, "
                f"root failures {trainer.state.optimizers[0].root_failure_count}"
            )
    trainer.close()


if __name__ == "__main__":
    main()
