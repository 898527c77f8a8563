"""Routing, expert stacks and fused projections under the trainers and across ranks.

FSDP2 shards a stack of experts along the experts: two gloo ranks must move it exactly as
a float64 single-process DASH does. The Lightning strategy and Fabric tell DASH the model,
so ``precondition="hidden"`` finds its embedding and output layer there.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers.lightning_parity import clean_process_group, trainer  # noqa: F401 (clean_process_group: an autouse fixture)
from helpers.spawning import spawn
from helpers.toy_models import ToyMoE, toy_loss
from lightning.fabric import Fabric
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_dash import DASH, DashFabricStrategy, DashStrategy
from lightning_dash.distributed import ShardedDistributor

OPTIONS = dict(lr=0.02, block_size=4, precondition_frequency=2, epsilon=1e-4, weight_decay=0.1)
ROUTING = dict(precondition="hidden", split_rows={"qkv": 3})


def moe(seed: int = 0) -> ToyMoE:
    torch.manual_seed(seed)
    return ToyMoE(experts=3).double()


def check_sharded_experts(rank: int, world_size: int) -> None:
    reference = moe()
    single = DASH(reference.named_parameters(), model=reference, **OPTIONS, **ROUTING)
    model = moe()
    for module in (model.qkv, model.router, model.head):
        fully_shard(module)
    fully_shard(model)  # w_in, w_out (3 experts) are cut 2 + 1 along the experts
    optimizer = DASH(model.parameters(), model=model, distributor=ShardedDistributor(), **OPTIONS, **ROUTING)
    assert optimizer.preconditioning()["embed.weight"] is None
    for seed in range(5):
        single.zero_grad()
        toy_loss(reference, seed).backward()
        single.step()
        optimizer.zero_grad()
        toy_loss(model, seed).backward()  # every rank the whole batch: the mean of equal means
        optimizer.step()
    assert optimizer.nonfinite_grad_skips == 0 and optimizer.root_failure_count == 0
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert isinstance(param, DTensor)
        torch.testing.assert_close(param.full_tensor(), expected.detach(), rtol=1e-9, atol=1e-9)


@pytest.mark.multiprocess
def test_fsdp2_shards_of_an_expert_stack_move_as_one_process(tmp_path):
    spawn(check_sharded_experts, 2, tmp_path)


class MoEModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = moe()

    def training_step(self, batch, batch_idx):
        return toy_loss(self.net, batch_idx)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(4)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def test_lightning_strategy_tells_dash_the_model(tmp_path):
    module = MoEModule()
    embedding = module.net.embed.weight.detach().clone()
    run = trainer(1, 3, tmp_path, DashStrategy(block_size=4, **ROUTING))
    run.fit(module)
    optimizer = run.optimizers[0]
    views = optimizer.preconditioning()
    assert views["net.embed.weight"] is None and views["net.head.weight"] is None
    assert views["net.qkv.weight"].parts == 3 and views["net.w_in"].parts == 3
    assert not torch.equal(module.net.embed.weight, embedding)


def test_fabric_strategy_tells_dash_the_model():
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DashFabricStrategy(block_size=4, **ROUTING))
    fabric.launch()
    model = moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, optimizer = fabric.setup(model, optimizer)
    for seed in range(2):
        optimizer.zero_grad()
        fabric.backward(toy_loss(model, seed))
        optimizer.step()
    dash = optimizer.optimizer
    assert isinstance(dash, DASH)
    assert dash.preconditioning()["head.weight"] is None and dash.owned_blocks > 0
