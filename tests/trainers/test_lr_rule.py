"""One meaning of ``lr`` at DASH's defaults: the same AdamW recipe gives the same steps whichever
way DASH is reached (built directly, ``DASH.from_optimizer``, ``Trainer(strategy="dash")``,
``Fabric(strategy="dash")``), in one process. The expectation is plain ``DASH(params, lr=...)``
with AdamW's hyperparameters written out by hand (``betas[1]`` -> ``grafting_beta2``, ``eps`` ->
``grafting_epsilon``), told the model as the strategies tell it (``attach_model``), so that the
routing of the output layer is the same. The Composer lane checks ``Dash`` the same way."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dash  # noqa: F401  (registers the strategies)
from lightning_dash import DASH

LR, BETAS, EPS, DECAY = 3e-3, (0.9, 0.999), 1e-8, 0.05
STEPS = 6


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 10, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(STEPS)]


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    for x, y in batches():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def by_hand() -> list[torch.Tensor]:
    model = network()
    dash = DASH(model.parameters(), lr=LR, grafting_beta2=BETAS[1], grafting_epsilon=EPS, weight_decay=DECAY)
    dash.attach_model(model)
    return train(model, dash)


def converted() -> list[torch.Tensor]:
    model = network()
    dash = DASH.from_optimizer(adamw(model.parameters()))
    dash.attach_model(model)
    return train(model, dash)


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return adamw(self.parameters())


def trainer_strategy() -> list[torch.Tensor]:
    module = Regression()
    trainer = pl.Trainer(
        strategy="dash",
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # DDP's sampler would reorder the batches even on one device
    )
    x, y = (torch.cat(parts) for parts in zip(*batches()))
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=8))
    return [p.detach().clone() for p in module.net.parameters()]


def fabric_strategy() -> list[torch.Tensor]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dash")
    fabric.launch()
    model = network()
    model, optimizer = fabric.setup(model, adamw(model.parameters()))
    for x, y in batches():
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("entry", [converted, trainer_strategy, fabric_strategy], ids=lambda f: f.__name__)
def test_the_same_adamw_recipe_takes_the_same_steps_at_every_entry_point(entry):
    expected, initial = by_hand(), [p.detach() for p in network().parameters()]
    result = entry()
    for got, want, start in zip(result, expected, initial):
        assert not torch.equal(want, start)  # the steps moved the parameters
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
