"""The byte-level GPT of the examples as a LightningModule, with its stdlib data module.

The module asks for AdamW and a warmup+cosine schedule in ``configure_optimizers``,
the way existing user code does; ``Trainer(strategy="dash")`` turns that AdamW into
DASH without any change here. The data are seeded random windows, so every run
(whatever its optimizer or strategy) sees the same batches in the same order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dash.showcase.stdlib_text import ByteCorpus, RandomWindows, load_stdlib_corpus
from lightning_dash.showcase.tiny_gpt import TinyGPT


def warmup_cosine(warmup_steps: int, total_steps: int, floor: float = 0.1) -> Callable[[int], float]:
    """Learning-rate factor: linear warmup to 1, then cosine decay to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class StdlibBytes(pl.LightningDataModule):
    """Training windows from the stdlib's training files, a fixed validation set from
    its held-out files (see :func:`load_stdlib_corpus`).

    One epoch holds exactly ``steps`` batches of ``batch_size`` windows per device, so
    ``max_steps=steps`` ends with the epoch and every optimizer sees the same batches.
    """

    def __init__(
        self,
        context: int,
        batch_size: int,
        steps: int,
        val_windows: int = 512,
        max_bytes: int = 2_000_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.context = context
        self.batch_size = batch_size
        self.steps = steps
        self.val_windows = val_windows
        self.max_bytes = max_bytes
        self.seed = seed
        self.corpus: ByteCorpus | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.corpus is None:
            self.corpus = load_stdlib_corpus(max_bytes=self.max_bytes)

    @override
    def train_dataloader(self) -> DataLoader:
        assert self.corpus is not None
        world_size = self.trainer.world_size if self.trainer is not None else 1
        windows = RandomWindows(self.corpus.train, self.context, self.steps * self.batch_size * world_size, self.seed)
        return DataLoader(windows, batch_size=self.batch_size, shuffle=False)

    @override
    def val_dataloader(self) -> DataLoader:
        assert self.corpus is not None
        # The validation windows do not depend on the training seed: one fixed set for all runs.
        windows = RandomWindows(self.corpus.validation, self.context, self.val_windows, seed=12345)
        return DataLoader(windows, batch_size=64, shuffle=False)


class GPTModule(pl.LightningModule):
    """:class:`TinyGPT` trained on next-byte prediction with AdamW and warmup+cosine.

    The weights are initialised from ``seed`` (without touching the global RNG), so
    two runs with the same arguments start from the same model.
    """

    def __init__(
        self,
        context: int = 64,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = TinyGPT(context=context, width=width, depth=depth, heads=heads)

    @override
    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.model.loss(*batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log(
            "val_loss", self.model.loss(tokens, targets), prog_bar=True, sync_dist=True, batch_size=tokens.shape[0]
        )

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = max(1, round(hp.warmup_fraction * total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WallClock(pl.Callback):
    """Logs ``elapsed_s``, the seconds since training started, with every validation,
    so validation loss can be plotted against wall time."""

    def __init__(self) -> None:
        self.start: float | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.start is not None and not trainer.sanity_checking:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)  # count the queued kernels too
            pl_module.log("elapsed_s", time.perf_counter() - self.start, sync_dist=True)
