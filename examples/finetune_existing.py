"""Fine-tune an existing LightningModule's checkpoint with DASH, without touching its code.

1. "What you already have": ``GPTModule`` (AdamW + warmup/cosine LambdaLR in its
   ``configure_optimizers``) trained with a plain ``Trainer`` on stdlib source; a
   ``ModelCheckpoint`` keeps the best weights.
2. ``GPTModule.load_from_checkpoint(...)`` and a fresh ``Trainer(strategy="dash").fit``
   on new windows: the module's AdamW is converted into DASH and its scheduler re-pointed.

Why not ``fit(..., ckpt_path=...)``: that resumes the *optimizer state* too, and the
checkpoint holds AdamW's moments while the strategy now builds DASH (another class with
other state: Kronecker factors, roots, grafting moments). So only the weights are taken
from the checkpoint and the fine-tuning is a fresh fit: DASH collects its factors from
the new gradients and the schedule restarts (warmup + cosine over the fine-tuning steps).
To resume a DASH run later, ``ckpt_path=`` works as usual (DASH's state is checkpointed).

    .venv/bin/python examples/finetune_existing.py        # about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import lightning_dash  # noqa: F401  (registers strategy="dash")
from lightning_dash.showcase.lightning_gpt import GPTModule, StdlibBytes
from lightning_dash.showcase.quiet import progress_bar_wanted, quiet_third_party_output


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrain-steps", type=int, default=500, help="AdamW steps of the existing model")
    parser.add_argument("--finetune-steps", type=int, default=200, help="DASH steps from its checkpoint")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate of the existing training")
    parser.add_argument("--finetune-lr", type=float, default=1e-3, help="learning rate of the fine-tuning")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--val-windows", type=int, default=512)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs"))
    parser.add_argument(
        "--progress-bar",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show Lightning's progress bar (default: only when stdout is a terminal)",
    )
    return parser.parse_args(argv)


def trainer(args: argparse.Namespace, name: str, steps: int, strategy: str, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=steps,
        max_epochs=1,
        val_check_interval=steps,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        logger=CSVLogger(args.out / "finetune_existing", name=name),
        enable_progress_bar=progress_bar_wanted(args.progress_bar),
        enable_model_summary=False,
        **kwargs,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train with AdamW, fine-tune the checkpoint with DASH; return the losses and the DASH trainer."""
    args = parse_args(argv)
    quiet_third_party_output()
    data = dict(
        context=args.context, batch_size=args.batch_size, val_windows=args.val_windows, max_bytes=args.max_bytes
    )

    # 1. The existing model and its usual training (AdamW, plain Trainer), checkpointed.
    existing = GPTModule(context=args.context, width=args.width, depth=args.depth, heads=args.heads, lr=args.lr)
    checkpoint = ModelCheckpoint(dirpath=args.out / "finetune_existing" / "checkpoints", monitor="val_loss")
    pretrain = trainer(
        args, "adamw", args.pretrain_steps, "ddp" if args.devices > 1 else "auto", callbacks=[checkpoint]
    )
    pretrain.fit(existing, datamodule=StdlibBytes(steps=args.pretrain_steps, seed=0, **data))

    # 2. The same module class, weights from the checkpoint, fine-tuned under strategy="dash".
    #    New windows (seed 1); the learning rate is a saved hyperparameter, overridden here.
    model = GPTModule.load_from_checkpoint(checkpoint.best_model_path, lr=args.finetune_lr)
    finetune = trainer(args, "dash", args.finetune_steps, "dash", enable_checkpointing=False)
    finetune_data = StdlibBytes(steps=args.finetune_steps, seed=1, **data)
    before = finetune.validate(model, datamodule=finetune_data, verbose=False)[0]["val_loss"]
    finetune.fit(model, datamodule=finetune_data)
    after = finetune.validate(model, datamodule=finetune_data, verbose=False)[0]["val_loss"]
    optimizer = type(finetune.optimizers[0]).__name__
    if finetune.is_global_zero:
        print(f"\ncheckpoint: {checkpoint.best_model_path}")
        print(f"validation loss before fine-tuning: {before:.4f}")
        print(f"validation loss after {args.finetune_steps} {optimizer} steps: {after:.4f}")
    return {
        "before": before,
        "after": after,
        "optimizer": optimizer,
        "checkpoint": checkpoint.best_model_path,
        "trainer": finetune,
    }


if __name__ == "__main__":
    main()
