"""Sharded DASH in micro-groups on a GPU, over NCCL (one process: the collectives and their
asynchronous waits run as on several GPUs, each rank sending to itself). The expectation
is single-process DASH on the same GPU in float64; the whole blocks a micro-group gathers
are also seen in the allocator's peak."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_dash import DASH
from lightning_dash.distributed import ShardedDistributor

OPTIONS = dict(lr=0.05, block_size=32, precondition_frequency=2, start_preconditioning_step=2)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 96), nn.Tanh(), nn.Linear(96, 64), nn.Tanh(), nn.Linear(64, 8)).cuda().double()


def train(network: nn.Module, optimizer: DASH, steps: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 40, generator=generator, device="cuda", dtype=torch.float64)
        optimizer.zero_grad()
        (network(x) ** 2).mean().backward()
        optimizer.step()


def peak_step_bytes(optimizer: DASH) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    optimizer.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def check(rank: int, init_file: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1, timeout=timedelta(60))
    try:
        init_device_mesh("cuda", (1,))
        reference = model()
        single = DASH(reference.parameters(), **OPTIONS)
        train(reference, single, 5)
        peaks = {}
        for budget in (None, 0.05):
            sharded = model()
            for layer in sharded:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            distributor = ShardedDistributor(micro_group_mib=budget)
            optimizer = DASH(sharded.parameters(), distributor=distributor, **OPTIONS)
            train(sharded, optimizer, 5)
            for param, expected in zip(sharded.parameters(), reference.parameters()):
                torch.testing.assert_close(param.full_tensor(), expected.detach(), rtol=1e-10, atol=1e-12)
            peaks[budget] = (peak_step_bytes(optimizer), distributor.peak_gathered_bytes, distributor.micro_groups)
        (whole, planned_whole, one), (grouped, planned_grouped, many) = peaks[None], peaks[0.05]
        assert one == 1 and many > 4
        # A float64 32 x 32 block's gradient and update take 16 KiB: two per micro-group fit 0.05 MiB.
        assert planned_grouped <= 0.05 * 2**20 < planned_whole
        # The allocator sees at least the gathered blocks the budget saved.
        assert whole - grouped >= 0.5 * (planned_whole - planned_grouped)
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.cuda
@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_micro_groups_on_a_gpu_equal_one_process_and_lower_the_peak(tmp_path):
    mp.spawn(check, args=(str(tmp_path / "init"),), nprocs=1)
