"""Lightning's ``DashMonitor`` and Composer's ``DashComposerMonitor`` log the same metrics.

Both environments' monitors run a comparable two-step training (DASH with Newton roots
every step and asynchronous preconditioning, which is synchronous on CPU); the metric
names each logs must be those of the shared ``dash_metrics``. Runs in the Composer
environment, which has Lightning too.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import torch
from composer.loggers import InMemoryLogger
from composer_runs import make_trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dash import DASH
from lightning_dash.callbacks import DashMonitor
from lightning_dash.composer import DashComposerMonitor
from lightning_dash.integration import dash_metrics

OPTIONS = {
    "block_size": 16,
    "precondition_frequency": 1,
    "inverse_root_method": "newton_db",
    "async_preconditioning": True,
}


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return DASH(self.parameters(), lr=0.01, **OPTIONS)

    def train_dataloader(self):
        x = torch.randn(32, 12, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :3].sin()), batch_size=16)


def lightning_metric_names(root: Path) -> tuple[set[str], set[str]]:
    """Names DashMonitor logged, and those dash_metrics gives for the run's optimizer."""
    logger = CSVLogger(root, name="lightning")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[DashMonitor()],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(Regression())
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        logged = {name for row in csv.DictReader(file) for name, value in row.items() if value}
    return {name for name in logged if name.startswith("dash/")}, set(dash_metrics(trainer.optimizers[0], 0.0))


def composer_metric_names() -> tuple[set[str], set[str]]:
    """Names DashComposerMonitor logged, and those dash_metrics gives for the run's optimizer."""
    memory = InMemoryLogger()
    trainer = make_trainer(
        "classifier", "2ba", algorithm_options=OPTIONS, callbacks=[DashComposerMonitor()], loggers=[memory]
    )
    trainer.fit()
    logged = {name for name in memory.data if name.startswith("dash/")}
    expected = set(dash_metrics(trainer.state.optimizers[0], 0.0))
    trainer.close()
    return logged, expected


def test_both_monitors_log_the_shared_metrics_under_the_same_names(tmp_path: Path) -> None:
    lightning_logged, lightning_expected = lightning_metric_names(tmp_path)
    composer_logged, composer_expected = composer_metric_names()
    assert lightning_logged == lightning_expected
    assert composer_logged == composer_expected
    assert (
        lightning_logged
        == composer_logged
        == {
            "dash/optimizer_step_ms",
            "dash/root_failures",
            "dash/nonfinite_grad_skips",
            "dash/nonfinite_update_skips",
            "dash/ownership_balance",
            "dash/state_bytes",
            "dash/root_residual",
            "dash/async_roots_hidden",
            "dash/async_roots_waited",
            "dash/async_wait_ms",
        }
    )
