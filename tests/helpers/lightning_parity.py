"""A small regression model trained by Lightning with DASH, its single-process reference trajectory, and the
Trainer and process-group set-up the strategy tests share."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.spawning import START_METHOD
from lightning_dash import DASH, DashStrategy

GLOBAL_BATCH = 16


SAMPLES = 64  # four steps per epoch: checkpoints fall on epoch boundaries


#: The parity checks (here, in test_fsdp_strategy and test_fabric) compare ranks with one process within
#: 1e-4 of each parameter's movement.
#: Their numerics are pinned to fourth roots and plain momentum, as they were written against version 0.3
#: (the code that distributes the blocks does not depend on them; the defaults have a test of their own,
#: test_two_processes_at_dash_defaults_stay_within_roundoff_of_one_process), and to one routing: the
#: strategies know the model, and the default routing would leave its output layer to Adam, while the
#: single-process references are built without a model.
PARITY_NUMERICS = {"root_order": 4, "nesterov": False, "lr_scale": 1.0, "precondition": "all_matrices"}


DASH_OPTIONS = {"block_size": 16, "precondition_frequency": 2, "epsilon": 1e-4, **PARITY_NUMERICS}


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 12, generator=generator)
    return TensorDataset(x, torch.sin(x[:, :3] * 2) + 0.1 * torch.randn(SAMPLES, 3, generator=generator))


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 3))


def adamw_with_schedule(parameters):
    optimizer = torch.optim.AdamW(parameters, lr=0.02, betas=(0.9, 0.99), weight_decay=0.01)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def assert_identical_across_ranks(module: nn.Module, world_size: int) -> None:
    """Every rank holds bit-for-bit the same parameters (collective)."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], other) for other in gathered)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16 samples of optimizer step ``step`` (cycling through the data set)."""
    start = (step % (SAMPLES // GLOBAL_BATCH)) * GLOBAL_BATCH
    x, y = dataset().tensors
    return x[start : start + GLOBAL_BATCH], y[start : start + GLOBAL_BATCH]


def assert_matches_reference(actual: torch.Tensor, expected: torch.Tensor, start: torch.Tensor) -> None:
    """Two ranks sum gradients in another order than one process (a 1e-7 relative
    difference); DASH must keep that at roundoff: within 1e-4 of the parameter's movement."""
    assert (actual - expected).norm() <= 1e-4 * (expected - start).norm() + 1e-7


def reference_trajectory(steps: int, options: dict | None = None) -> list[list[torch.Tensor]]:
    """Single-process DASH on the global batches (``options``: default ``DASH_OPTIONS``); parameters after
    every step."""
    model = network()
    optimizer, scheduler = adamw_with_schedule(model.parameters())
    dash = DASH.from_optimizer(optimizer, **(DASH_OPTIONS if options is None else options))
    dash.attach_model(model)  # as the strategies do (it decides the default routing)
    scheduler.optimizer = dash
    trajectory = []
    for step in range(steps):
        x, y = global_batch(step)
        dash.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        dash.step()
        scheduler.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


class ParityModule(pl.LightningModule):
    """AdamW + StepLR, as a user would write it; checks itself against a reference."""

    def __init__(self, reference_path: str, checkpoint_path: str | None = None) -> None:
        super().__init__()
        self.net = network()
        self.reference_path = reference_path
        self.checkpoint_path = checkpoint_path
        self.reference: list[list[torch.Tensor]] | None = None

    def training_step(self, batch, batch_idx):
        # The global batch is chosen by the optimizer step, not by the loader position,
        # so Lightning's mid-epoch resume bookkeeping cannot shift the data order.
        x, y = global_batch(self.trainer.global_step)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return nn.functional.mse_loss(self.net(x[rank::world]), y[rank::world])

    def configure_optimizers(self):
        optimizer, scheduler = adamw_with_schedule(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(range(SAMPLES // GLOBAL_BATCH))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        optimizer = self.trainer.optimizers[0]
        assert isinstance(optimizer, DASH)
        assert optimizer.distributor.world_size == self.trainer.world_size
        if self.reference is None:
            self.reference = torch.load(self.reference_path)
        step = self.trainer.global_step
        for param, expected, start in zip(self.parameters(), self.reference[step - 1], network().parameters()):
            assert_matches_reference(param.detach(), expected, start.detach())
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5 ** (step // 2))
        if self.trainer.world_size > 1:
            assert_identical_across_ranks(self, self.trainer.world_size)

    def on_train_end(self):
        if self.checkpoint_path:  # inside the worker processes, where the optimizer state lives
            self.trainer.save_checkpoint(self.checkpoint_path)


def release_process_group() -> None:
    """A one-device run initialises gloo in this process; free it and its port for the next run."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for variable in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(variable, None)


@pytest.fixture(autouse=True)
def clean_process_group():
    yield
    release_process_group()


def trainer(devices: int, steps: int, root: Path, strategy: DashStrategy | str | None = None, **kwargs) -> pl.Trainer:
    """A quiet CPU trainer (``steps=-1``: bounded by ``max_epochs`` instead); its strategy defaults
    to the DASH options of the reference, spawning the ranks when there are several. ``kwargs``
    replace or add Trainer arguments."""
    if strategy is None:
        strategy = DashStrategy(start_method=START_METHOD if devices > 1 else "popen", **DASH_OPTIONS)
    settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        default_root_dir=root,
        **{**settings, **kwargs},
    )
