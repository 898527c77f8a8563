"""Pretrain a small GPT with Lightning Fabric and ``strategy="dash_fsdp"`` (FSDP2 + DASH) on 2 CPU processes.

A plain Fabric loop, as LitGPT's pretraining script writes it: AdamW and a warmup/cosine LambdaLR are
created before ``fabric.setup(model, optimizer)``, which shards the model (each transformer block, then
the root), turns the AdamW into DASH over the same parameter groups (the scheduler keeps driving it) and
spreads DASH's blocks over the ranks. The model is LitGPT's ``GPT`` (``pip install litgpt``; without it
the script says so and stops) or, with ``--model tiny``, the project's ``TinyGPT``. The data are bytes of
the Python standard library's source: nothing to download. ``--save DIR`` writes a distributed
checkpoint; ``--resume DIR`` continues it, on any number of processes.

    python examples/fabric_gpt.py                                  # LitGPT's GPT, 20 steps, ~1 minute
    python examples/fabric_gpt.py --model tiny --steps 200 --save runs/fabric_gpt
    python examples/fabric_gpt.py --model tiny --steps 300 --devices 1 --resume runs/fabric_gpt
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_dash  # noqa: F401  (registers strategy="dash_fsdp")
from lightning_dash.showcase.lightning_gpt import warmup_cosine
from lightning_dash.showcase.stdlib_text import load_stdlib_corpus
from lightning_dash.showcase.tiny_gpt import TinyGPT


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("litgpt", "tiny"), default="litgpt")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all (a resumed run included)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per process and step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-bytes", type=int, default=1_000_000, help="stdlib source read")
    parser.add_argument("--save", type=Path, help="write a checkpoint folder here at the end")
    parser.add_argument("--resume", type=Path, help="continue from this checkpoint folder")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> nn.Module:
    if args.model == "tiny":
        return TinyGPT(context=args.context, width=args.width, depth=args.depth, heads=args.heads)
    from litgpt import GPT, Config

    return GPT(
        Config(
            block_size=args.context,
            vocab_size=256,
            padded_vocab_size=256,
            n_layer=args.depth,
            n_head=args.heads,
            n_embd=args.width,
        )
    )


def main(argv: Sequence[str] | None = None) -> dict[str, float] | None:
    args = parse_args(argv)
    if args.model == "litgpt" and find_spec("litgpt") is None:
        print("fabric_gpt.py: LitGPT is not installed (pip install litgpt); --model tiny trains the project's GPT")
        return None
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="dash_fsdp")
    fabric.launch()  # re-runs this script once per other rank
    torch.manual_seed(0)  # the same initial weights on every rank
    corpus = load_stdlib_corpus(max_bytes=args.max_bytes)
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, args.steps // 20), args.steps))
    model, optimizer = fabric.setup(model, optimizer)  # FSDP2-sharded model, DASH optimizer
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.resume is not None:
        fabric.load(args.resume, state)
    processes = f"{fabric.world_size} process" + ("es" if fabric.world_size > 1 else "")
    parameters = type(next(model.parameters())).__name__
    fabric.print(f"{type(optimizer.optimizer).__name__} on {processes}, {parameters} parameters")

    def loss_of(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())

    for step in range(state["step"], args.steps):
        generator = torch.Generator().manual_seed(1000 * step + fabric.global_rank)  # each rank its own windows
        loss = loss_of(*corpus.batch("train", args.batch_size, args.context, generator))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if (step + 1) % max(1, args.steps // 10) == 0 or step + 1 == args.steps:
            lr = optimizer.param_groups[0]["lr"]
            fabric.print(f"step {step + 1:5d}  loss {fabric.all_reduce(loss.detach()).item():.3f}  lr {lr:.2e}")
    state["step"] = args.steps
    with torch.no_grad():
        validation = loss_of(*corpus.batch("validation", 64, args.context, torch.Generator().manual_seed(12345)))
    fabric.print(f"validation loss {validation.item():.3f}")
    if args.save is not None:
        fabric.save(args.save, state)
    return {"loss": loss.item(), "validation_loss": validation.item()}


if __name__ == "__main__":
    main()
