"""A tiny language model trained by the FSDP2 strategies, and its single-process DASH reference trajectory."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from helpers.lightning_parity import PARITY_NUMERICS
from helpers.spawning import START_METHOD
from lightning_dash import DASH
from lightning_dash.strategies.dash_fsdp import DashFSDPStrategy

#: Parity numerics pinned as for the DDP strategy (:data:`helpers.lightning_parity.PARITY_NUMERICS`).
DASH_OPTIONS = {"block_size": 8, "precondition_frequency": 2, "epsilon": 1e-4, **PARITY_NUMERICS}

VOCAB, WIDTH, STEPS_PER_EPOCH, GLOBAL_BATCH, LENGTH = 11, 18, 4, 8, 6


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


#: The blocks' hidden widths: odd ones, and ones tensor parallelism splits evenly over 2 and 4
#: ranks (DTensor's column- and row-parallel layers need even splits).
ODD_HIDDEN, EVEN_HIDDEN = (29, 13), (28, 12)


class TinyLM(nn.Module):
    """Embedding tied to the output layer, two blocks in a ModuleList, odd widths by default."""

    def __init__(self, hidden: tuple[int, int] = ODD_HIDDEN) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH, width) for width in hidden])
        self.out = nn.Linear(WIDTH, VOCAB)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def global_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step % STEPS_PER_EPOCH)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH + 1), generator=generator)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def adamw_with_schedule(parameters):
    optimizer = torch.optim.AdamW(parameters, lr=0.02, betas=(0.9, 0.99), weight_decay=0.01)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def reference_trajectory(steps: int, hidden: tuple[int, int] = ODD_HIDDEN) -> list[dict[str, torch.Tensor]]:
    """Single-process DASH (converted from the same AdamW + StepLR) on the global batches."""
    model = TinyLM(hidden)
    optimizer, scheduler = adamw_with_schedule(model.parameters())
    dash = DASH.from_optimizer(optimizer, **DASH_OPTIONS)
    scheduler.optimizer = dash
    trajectory = []
    for step in range(steps):
        dash.zero_grad()
        lm_loss(model, global_batch(step)).backward()
        dash.step()
        scheduler.step()
        trajectory.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return trajectory


def full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (collective for a DTensor)."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


class LMModule(pl.LightningModule):
    """AdamW + StepLR as a user writes it; checks itself against the reference each step."""

    hidden = ODD_HIDDEN

    def __init__(self, reference_path: str, checkpoint_path: str | None = None, shard_itself: bool = False) -> None:
        super().__init__()
        self.model = TinyLM(self.hidden)
        self.reference_path = reference_path
        self.checkpoint_path = checkpoint_path
        self.shard_itself = shard_itself
        self.reference: list[dict[str, torch.Tensor]] | None = None

    def configure_model(self) -> None:
        if self.shard_itself:
            for block in self.model.blocks:
                fully_shard(block)
            fully_shard(self.model)

    def training_step(self, batch, batch_idx):
        tokens = global_batch(self.trainer.global_step)
        rank, size = self.data_parallel_rank()
        return lm_loss(self.model, tokens[rank::size])

    def data_parallel_rank(self) -> tuple[int, int]:
        """This rank's data-parallel index and the number of data-parallel groups."""
        return self.trainer.global_rank, self.trainer.world_size

    def configure_optimizers(self):
        optimizer, scheduler = adamw_with_schedule(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(range(STEPS_PER_EPOCH))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        optimizer = self.trainer.optimizers[0]
        assert isinstance(optimizer, DASH) and optimizer.distributor.shards_parameters
        assert all(isinstance(p, DTensor) for p in self.parameters())
        if self.reference is None:
            self.reference = torch.load(self.reference_path)
        step = self.trainer.global_step
        start = dict(TinyLM(self.hidden).named_parameters())
        for name, param in self.model.named_parameters():
            expected = self.reference[step - 1][name]
            assert (full(param) - expected).norm() <= 1e-4 * (expected - start[name].detach()).norm() + 1e-6, name
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5 ** (step // 2))

    def on_train_end(self):
        if self.checkpoint_path:
            self.trainer.save_checkpoint(self.checkpoint_path)


def apply_tensor_parallel(model: TinyLM, mesh) -> TinyLM:
    """The blocks' MLPs tensor-parallel (``up`` column-parallel, ``down`` row-parallel) on
    ``mesh["tensor_parallel"]``, then everything sharded by FSDP2 on ``mesh["data_parallel"]``,
    as a user writes ``configure_model`` (or Fabric's ``parallelize_fn``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tensor, data = mesh["tensor_parallel"], mesh["data_parallel"]
    for block in model.blocks:
        parallelize_module(block, tensor, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=data)
    fully_shard(model, mesh=data)
    return model


class TensorParallelLMModule(LMModule):
    """The same model with its blocks' MLPs tensor-parallel (``up`` column-parallel, ``down``
    row-parallel) on the ``"tensor_parallel"`` mesh and everything sharded by FSDP2 on the
    ``"data_parallel"`` mesh, as a user writes ``configure_model``; the norms, the embedding
    and the tied output layer are sharded by FSDP2 alone (replicated over the tensor-parallel ranks)."""

    hidden = EVEN_HIDDEN

    def configure_model(self) -> None:
        apply_tensor_parallel(self.model, self.device_mesh)

    def data_parallel_rank(self) -> tuple[int, int]:
        data = self.device_mesh["data_parallel"]
        return data.get_local_rank(), data.size()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        up = self.model.blocks[0].up.weight
        assert up.device_mesh.shape == tuple(self.device_mesh.shape) and len(up.placements) == 2
        super().on_train_batch_end(outputs, batch, batch_idx)


class HybridShardedLMModule(LMModule):
    """HSDP as a user writes ``configure_model``: FSDP2 over a (replicate, shard) mesh of the
    data-parallel ranks, two replicas of the shards."""

    def configure_model(self) -> None:
        ranks = self.device_mesh["data_parallel"].size()
        mesh = init_device_mesh("cpu", (2, ranks // 2), mesh_dim_names=("replicate", "shard"))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        assert all(p.placements[0].is_replicate() and p.device_mesh.ndim == 2 for p in self.parameters())
        super().on_train_batch_end(outputs, batch, batch_idx)


def trainer(
    devices: int,
    steps: int,
    root: Path,
    strategy: pl.strategies.Strategy | None = None,
    start_method: str = START_METHOD,
    **kwargs,
):
    if strategy is None:
        strategy = DashFSDPStrategy(start_method=start_method, **DASH_OPTIONS, **kwargs.pop("strategy_options", {}))
    settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, default_root_dir=root, **settings
    )
