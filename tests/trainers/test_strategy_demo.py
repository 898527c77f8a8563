"""DashStrategy's gradient synchronisation: counted all-reduce and DeMo, in two gloo processes."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from helpers.lightning_parity import assert_identical_across_ranks, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dash  # noqa: F401
from lightning_dash import DASH, DashStrategy
from lightning_dash.distributed.dct_topk import chunk_size_for


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=generator)
    return TensorDataset(x, x[:, :8].sin())


class SyncModule(pl.LightningModule):
    """Checks identical parameters across ranks and the counted bytes after each step."""

    def __init__(self, expected_bytes_per_step: float, output_path: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        self.expected_bytes_per_step = expected_bytes_per_step
        self.output_path = output_path

    def training_step(self, batch, batch_idx):
        # Data chosen by the optimizer step (not the loader position), so a resumed run
        # sees exactly the batches an uninterrupted one does; each rank takes its half.
        x, y = dataset().tensors
        start = (self.trainer.global_step % 4) * 16 + self.trainer.global_rank * 8
        return nn.functional.mse_loss(self.net(x[start : start + 8]), y[start : start + 8])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=8)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        strategy = self.trainer.strategy
        assert isinstance(self.trainer.optimizers[0], DASH)
        stats = strategy.comm_stats.as_dict()
        assert stats["steps"] == self.trainer.global_step - strategy.resumed_steps
        assert stats["bytes_sent_per_step"] == pytest.approx(self.expected_bytes_per_step)
        assert stats["bytes_received_per_step"] == pytest.approx(self.expected_bytes_per_step)
        assert_identical_across_ranks(self, 2)

    def on_train_end(self):
        if self.output_path:
            self.trainer.save_checkpoint(self.output_path)


def demo_payload_bytes(shapes: list[tuple[int, ...]], topk: int, chunk: int) -> int:
    """Indices (int16 when a chunk has <= 32767 entries) plus bf16 values, per parameter."""
    total = 0
    for shape in shapes:
        dims = [shape[0], int(torch.tensor(shape[1:]).prod())] if len(shape) > 1 else [shape[0]]
        sides = [chunk_size_for(d, chunk) for d in dims]
        chunks = int(torch.tensor([d // s for d, s in zip(dims, sides)]).prod())
        numel = int(torch.tensor(sides).prod())
        k = min(topk, numel)
        total += chunks * k * ((2 if numel <= 32767 else 4) + 2)
    return total


SHAPES = [(64, 32), (64,), (8, 64), (8,)]


def run(tmp_path, steps: int, expected: float, ckpt_path=None, output="", **strategy_kwargs) -> None:
    strategy = DashStrategy(start_method="spawn", block_size=32, **strategy_kwargs)
    trainer(2, steps, tmp_path, strategy).fit(SyncModule(expected, output), ckpt_path=ckpt_path)


@pytest.fixture(autouse=True)
def fresh_port():
    yield
    for variable in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(variable, None)


@pytest.mark.multiprocess
def test_allreduce_bytes_are_counted(tmp_path):
    # Ring all-reduce of every float32 gradient: 2 (W - 1) / W * 4 bytes per element.
    numel = sum(int(torch.tensor(s).prod()) for s in SHAPES)
    run(tmp_path, 3, 2 * (2 - 1) / 2 * 4 * numel)


@pytest.mark.multiprocess
def test_demo_sends_compressed_components_and_resumes_exactly(tmp_path):
    demo = dict(gradient_sync="demo", demo_topk=4, demo_chunk_size=16)
    expected = demo_payload_bytes(SHAPES, topk=4, chunk=16)  # received: one other rank sends as much
    straight, first, resumed = (tmp_path / name for name in ("straight.ckpt", "first.ckpt", "resumed.ckpt"))
    run(tmp_path, 6, expected, output=str(straight), **demo)
    run(tmp_path, 3, expected, output=str(first), **demo)
    run(tmp_path, 6, expected, ckpt_path=first, output=str(resumed), **demo)
    a = torch.load(straight, weights_only=False)
    b = torch.load(resumed, weights_only=False)
    assert len(b["demo_synchronizer_states"]) == 2
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key


def test_bad_gradient_sync_option_is_named():
    with pytest.raises(ValueError, match="gradient_sync"):
        DashStrategy(gradient_sync="powersgd")
    with pytest.raises(ValueError, match="demo_momentum"):
        DashStrategy(gradient_sync="demo", demo_momentum=1.0)
