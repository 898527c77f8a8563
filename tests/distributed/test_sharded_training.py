"""DASH on FSDP2 row shards (``ShardedDistributor``) in real gloo processes, without a trainer.

Each rank asserts inside itself; the expectations are a float64 single-process DASH on
the same global batches, the bytes of a single-process optimizer, and the bound the
sharding promises.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.spawning import spawn
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_dash import DASH
from lightning_dash.distributed import ShardedDistributor
from lightning_dash.testing.op_counts import count_ops

OPTIONS = dict(lr=0.05, block_size=8, precondition_frequency=2, start_preconditioning_step=2, weight_decay=0.01)
BATCH = 12  # divisible by 1..4 ranks: the mean of the ranks' means is the global mean


def network() -> nn.Sequential:
    """Widths that do not divide by 3 or 4, blocks cut across the row shards, 1-D biases."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 19), nn.Tanh(), nn.Linear(19, 30), nn.Tanh(), nn.Linear(30, 5), nn.Tanh())


def sharded(model: nn.Sequential) -> nn.Sequential:
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 7, generator=generator), torch.randn(BATCH, 5, generator=generator)) for _ in range(steps)
    ]


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def block_state_bytes(rows: int, cols: int, dtype_bytes: int) -> int:
    """One block: each side's factor and root packed as one matrix and a row, momentum and grafting
    second moment, and its scalars (validity flag, failure count, float64 factor scale)."""
    return dtype_bytes * (rows * (rows + 1) + cols * (cols + 1) + 2 * rows * cols) + 1 + 4 + 8


def check_extreme_scales(rank: int, world_size: int) -> None:
    """Losses scaled by 1e-30 and 1e20: the sharded run still equals the single-process one."""
    for scale in (1e-30, 1e20):
        reference = network().double()
        single = DASH(reference.parameters(), **OPTIONS)
        model = sharded(network().double())
        optimizer = DASH(model.parameters(), distributor=ShardedDistributor(), **OPTIONS)
        for x, y in batches(4):
            x, y = x.double(), y.double()
            single.zero_grad()
            (scale * loss(reference, x, y)).backward()
            single.step()
            optimizer.zero_grad()
            (scale * loss(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank])).backward()
            optimizer.step()
        assert optimizer.nonfinite_grad_skips == 0 and optimizer.root_failure_count == 0
        for param, expected in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.full_tensor(), expected.detach(), rtol=1e-9, atol=1e-9)


def check_a_budget_below_one_block_is_named(rank: int, world_size: int) -> None:
    """0.0005 MiB (524 bytes) cannot hold a float64 8x8 block's gradient and update (1,024 bytes):
    one warning, on rank 0, names the largest block and the budget that would hold it."""
    model = sharded(network().double())
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    named = [{"params": list(model.parameters()), "param_names": [n for n, _ in model.named_parameters()]}]
    optimizer = DASH(named, distributor=ShardedDistributor(micro_group_mib=0.0005), **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    said = [str(w.message) for w in caught if "micro_group_mib" in str(w.message)]
    if rank != 0:
        assert said == []
        return
    assert len(said) == 1, said
    assert said[0].startswith("micro_group_mib=0.0005 is smaller than one block: the 8x8 block of 2.weight at rows 0:8")
    assert "needs 0.000977 MiB" in said[0] and "at least 0.002 or lower block_size" in said[0]
    assert optimizer.distributor.peak_gathered_bytes >= 1024


def check_extreme_scales_and_a_small_budget(rank: int, world_size: int) -> None:
    check_extreme_scales(rank, world_size)
    check_a_budget_below_one_block_is_named(rank, world_size)


@pytest.mark.multiprocess
def test_sharded_dash_at_extreme_gradient_scales_and_a_budget_below_one_block(tmp_path):
    spawn(check_extreme_scales_and_a_small_budget, 2, tmp_path)


def check_parity_and_memory(rank: int, world_size: int, micro_group_mib: float | None) -> None:
    reference = network().double()
    single = DASH(reference.parameters(), **OPTIONS)
    model = sharded(network().double())
    if micro_group_mib is None:  # as a user writes it after fully_shard: DASH finds the sharded distributor
        optimizer = DASH(model.parameters(), **OPTIONS)
        assert isinstance(optimizer.distributor, ShardedDistributor) and optimizer.distributor.micro_group_mib is None
    else:
        optimizer = DASH(model.parameters(), distributor=ShardedDistributor(micro_group_mib=micro_group_mib), **OPTIONS)
    for x, y in batches(6):
        x, y = x.double(), y.double()
        single.zero_grad()
        loss(reference, x, y).backward()
        single.step()
        optimizer.zero_grad()
        loss(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank]).backward()
        optimizer.step()
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert isinstance(param, DTensor)
        torch.testing.assert_close(param.full_tensor(), expected.detach(), rtol=1e-9, atol=1e-9)

    held = torch.tensor([optimizer.state_bytes()], dtype=torch.float64)
    every = [torch.zeros_like(held) for _ in range(world_size)]
    dist.all_gather(every, held)
    every = [int(t.item()) for t in every]
    # Each block and each element of a 1-D buffer is held by exactly one rank.
    assert sum(every) == single.state_bytes()
    largest = block_state_bytes(8, 8, 8)
    assert max(every) <= 1.1 * sum(every) / world_size + largest
    # Each step sent the planned rows in both directions (float64 here), nothing else.
    distributor = optimizer.distributor
    assert distributor.bytes_sent == 6 * distributor.elements_per_step * 8, (
        distributor.bytes_sent,
        distributor.elements_per_step,
    )
    assert (distributor.bytes_sent > 0) == (world_size > 1)
    # Whole blocks in flight: a float64 8x8 block's gradient and update are 1,024 bytes.
    if micro_group_mib is None:
        assert distributor.micro_groups == 1
    else:
        assert distributor.micro_groups > 3
        assert 1024 <= distributor.peak_gathered_bytes <= micro_group_mib * 2**20


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, micro_group_mib", [(2, None), (3, 0.002), (4, None)])
def test_sharded_dash_equals_single_process_and_splits_its_state(tmp_path, world_size, micro_group_mib):
    """At 2 and 4 ranks plain ``DASH(model.parameters())`` after the user's own ``fully_shard``; at 3 ranks an
    explicit distributor whose blocks travel in micro-groups of at most one 8x8 block per rank."""
    spawn(functools.partial(check_parity_and_memory, micro_group_mib=micro_group_mib), world_size, tmp_path)


def check_bad_shard_skips_everywhere(rank: int, world_size: int) -> None:
    model = sharded(network())
    optimizer = DASH(model.parameters(), distributor=ShardedDistributor(), **OPTIONS)
    steps = batches(3)
    for index, (x, y) in enumerate(steps):
        optimizer.zero_grad()
        loss(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank]).backward()
        if index == 1:
            before = [p.full_tensor().clone() for p in model.parameters()]
            if rank == world_size - 1:  # one rank's rows of one gradient go bad
                model[2].weight.grad.to_local().view(-1)[0] = math.inf
        optimizer.step()
        if index == 1:
            for param, previous in zip(model.parameters(), before):
                assert torch.equal(param.full_tensor(), previous)
    assert optimizer.nonfinite_grad_skips == 1
    assert all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())


@pytest.mark.multiprocess
def test_a_bad_gradient_shard_skips_the_step_on_every_rank(tmp_path):
    spawn(check_bad_shard_skips_everywhere, 2, tmp_path)


def check_plain_parameters_are_refused(rank: int, world_size: int) -> None:
    model = network()
    fully_shard(model[0])  # the other layers stay plain tensors
    # Built without a distributor, DASH refuses the mixed layout at once, naming a plain parameter.
    with pytest.raises(ValueError, match=r"^2\.weight of shape \(30, 19\) is a plain tensor beside sharded"):
        DASH(model.named_parameters(), **OPTIONS)
    optimizer = DASH(model.parameters(), distributor=ShardedDistributor(), **OPTIONS)
    loss(model, *batches(1)[0]).backward()
    with pytest.raises(ValueError, match="not sharded"):
        optimizer.step()


@pytest.mark.multiprocess
def test_parameters_fsdp2_does_not_shard_are_named_in_an_error(tmp_path):
    spawn(check_plain_parameters_are_refused, 2, tmp_path)


def check_launches_and_host_reads(rank: int, world_size: int) -> None:
    """The optimizer step on FSDP2 shards, counted with ``op_counts`` on every rank: no host
    synchronisation, and as many launches at 24 layers as at 6 (refresh steps and others)."""
    from helpers.toy_models import gpt_params

    def counts(layers: int) -> list:
        named = gpt_params(layers)
        holder = nn.Module()
        holder.params = nn.ParameterList([param for _, param in named])
        fully_shard(holder)
        params = list(holder.parameters())
        optimizer = DASH(
            params, lr=1e-3, block_size=32, precondition_frequency=2, distributor=ShardedDistributor(), epsilon=1e-4
        )
        measured = []
        for step in range(1, 4):  # step 1 plans; step 2 refreshes the roots, step 3 does not
            generator = torch.Generator().manual_seed(step)
            for param in params:
                full = 1e-3 * torch.randn(param.shape, generator=generator, dtype=param.dtype)
                param.grad = distribute_tensor(full, param.device_mesh, param.placements)
            _, step_counts = count_ops(optimizer.step)
            measured.append(step_counts)
        return measured[1:]

    shallow, deep = counts(6), counts(24)
    for few, many in zip(shallow, deep):
        assert few.sync_count == 0 and many.sync_count == 0, (dict(few.syncs), dict(many.syncs))
        assert many.launch_count <= 1.1 * few.launch_count, (few.launch_count, many.launch_count)


@pytest.mark.multiprocess
def test_sharded_step_launches_do_not_grow_with_depth_nor_wait_for_the_device(tmp_path):
    spawn(check_launches_and_host_reads, 2, tmp_path)
