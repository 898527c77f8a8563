"""``strategy="dash"`` where plain Lightning would work: a module without an optimizer.

Every fit runs a real Lightning Trainer on CPU (two gloo processes where it says so).
"""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from test_strategy import release_process_group, trainer
from torch import nn

from lightning_dash import DASH


@pytest.fixture(autouse=True)
def clean_process_group():
    yield
    release_process_group()


def parameters(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def unchanged(module: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))


# configure_optimizers returning None


class NoOptimizerModule(BoringModel):
    """Lightning's BoringModel without an optimizer; checks, on every rank, that nothing moved."""

    def __init__(self) -> None:
        super().__init__()
        self.start = parameters(self)

    def configure_optimizers(self):
        return None

    def on_train_end(self):
        assert self.trainer.global_step == 3
        assert unchanged(self, self.start)


def test_no_optimizer_fits_with_lightnings_warning_and_moves_nothing(tmp_path):
    model = NoOptimizerModule()
    run = trainer(1, 3, tmp_path, "dash")
    warning = "`LightningModule.configure_optimizers` returned `None`, this fit will run with no optimizer"
    with pytest.warns(UserWarning, match=re.escape(warning)):
        run.fit(model)
    assert run.global_step == 3
    assert not isinstance(run.optimizers[0], DASH)
    assert unchanged(model, model.start)


def test_no_optimizer_fits_in_two_processes(tmp_path):
    trainer(2, 3, tmp_path, "dash_spawn").fit(NoOptimizerModule())  # the checks run in each rank
