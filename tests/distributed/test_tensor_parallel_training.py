"""DASH over two-dimensional meshes in real gloo processes, without a trainer: tensor
parallelism under FSDP2, and HSDP (FSDP2 replicated over groups).

The expectation is float64 single-process DASH on the same global batches; each rank
asserts inside itself.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers.spawning import spawn
from test_sharded_training import OPTIONS, block_state_bytes
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from lightning_dash import DASH
from lightning_dash.distributed import ShardedDistributor
from lightning_dash.integration.fsdp_sharding import check_data_parallel_sharding

BATCH = 8


class MLP(nn.Module):
    """A tensor-parallel MLP block: a norm, a column-parallel and a row-parallel layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(12)
        self.up = nn.Linear(12, 20)
        self.down = nn.Linear(20, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


SEQUENCE = 6


def batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(BATCH, SEQUENCE, 12, generator=generator, dtype=torch.float64) for _ in range(steps)]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).mean()


def all_state_bytes(optimizer: DASH, world_size: int) -> list[int]:
    held = torch.tensor([optimizer.state_bytes()], dtype=torch.float64)
    every = [torch.zeros_like(held) for _ in range(world_size)]
    dist.all_gather(every, held)
    return [int(t.item()) for t in every]


def check_against_one_process(
    model: nn.Module, local_batch, world_size: int, micro_group_mib: float | None = None
) -> None:
    """Six steps of ``model`` (already parallelised; ``local_batch`` gives this rank's part
    of a global batch and the factor its loss is divided by) against one float64 process,
    the blocks' state split across the ranks. Without ``micro_group_mib``, DASH is built as a
    user builds it on sharded parameters, without a distributor."""
    reference = MLP().double()
    single = DASH(reference.parameters(), **OPTIONS)
    if micro_group_mib is None:
        optimizer = DASH(model.parameters(), **OPTIONS)
        distributor = optimizer.distributor
        assert isinstance(distributor, ShardedDistributor)
    else:
        distributor = ShardedDistributor(micro_group_mib=micro_group_mib)
        optimizer = DASH(model.parameters(), distributor=distributor, **OPTIONS)
    for x in batches(6):
        single.zero_grad()
        loss(reference, x).backward()
        single.step()
        optimizer.zero_grad()
        part, divisor = local_batch(x)
        (loss(model, part) / divisor).backward()
        optimizer.step()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(param, DTensor) and param.device_mesh.ndim == 2, name
        torch.testing.assert_close(param.full_tensor(), expected.detach(), rtol=1e-9, atol=1e-9, msg=name)
    # Blocks are owned over the whole mesh, each by one rank; the one-dimensional buffers
    # are held like their parameters (replicas included).
    every = all_state_bytes(optimizer, world_size)
    vectors = sum(2 * 8 * p.numel() for p in reference.parameters() if p.dim() == 1)
    assert max(every) <= 1.1 * single.state_bytes() / world_size + block_state_bytes(8, 8, 8) + vectors
    if micro_group_mib is not None:
        assert distributor.micro_groups > 1
        assert distributor.peak_gathered_bytes <= micro_group_mib * 2**20


def check_tensor_parallel(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    # What the strategies refuse: a module left unsharded, and tensor parallelism without
    # FSDP2 over the data-parallel groups (the norm's gradient would not be averaged).
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: apply tensor parallelism in configure_model"):
        check_data_parallel_sharding(MLP(), mesh)
    unsynchronised = MLP()
    parallelize_module(unsynchronised, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    with pytest.raises(ValueError, match=r"norm.weight is not sharded over device_mesh\['data_parallel'\]"):
        check_data_parallel_sharding(unsynchronised, mesh)
    model = MLP().double()
    # Sequence parallelism: the norm and the residual see this rank's part of the sequence;
    # the column-parallel layer gathers it, the row-parallel one scatters its output.
    parallelize_module(
        model,
        mesh["tensor_parallel"],
        {"norm": SequenceParallel(), "up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Shard(1))},
    )
    fully_shard(model, mesh=mesh["data_parallel"])
    data, tensor = mesh["data_parallel"].get_local_rank(), mesh["tensor_parallel"].get_local_rank()

    def local_batch(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        # The tensor-parallel ranks' sequence parts sum their losses' gradients: divide by 2.
        return x.chunk(2)[data].chunk(2, dim=1)[tensor], 2

    # Micro-groups of at most one float64 8x8 block (gradient and update: 1,024 bytes) per rank.
    check_against_one_process(model, local_batch, world_size, micro_group_mib=0.002)
    names = ("data_parallel", "tensor_parallel")
    check_language_model(init_device_mesh("cpu", (2, 2), mesh_dim_names=names), frozen=("proj.weight", "qkv.bias"))
    check_language_model(init_device_mesh("cpu", (1, 4), mesh_dim_names=names), scale=1e20, fault_at=2)
    check_language_model(init_device_mesh("cpu", (2, 2), mesh_dim_names=names), scale=1e-30)
    check_hsdp(rank, world_size)
    check_partial_is_refused(rank, world_size)


VOCAB, WIDTH = 16, 12


class LanguageModel(nn.Module):
    """A vocabulary-parallel embedding tied to the output layer, a fused QKV projection and an
    output projection, as a tensor-parallel transformer layer has them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return self.head(x + self.proj(torch.tanh(q) * k + v))


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def check_language_model(mesh, scale: float = 1.0, frozen: tuple[str, ...] = (), fault_at: int | None = None) -> None:
    """On ``mesh``: the embedding and the head vocabulary-parallel and tied, the QKV projection
    column-parallel and split into its three projections by ``split_rows``, the output
    projection row-parallel; five steps equal one float64 process with the same split.
    ``scale`` multiplies the loss; ``frozen`` parameters do not train; at step ``fault_at``
    one rank's piece of a gradient is infinite (and the single process's gradient too): the
    step is skipped on every rank, where AdamW would write NaN into the parameters."""
    split = {"qkv": 3}
    reference = LanguageModel().double()
    model = LanguageModel().double()
    for name in frozen:
        reference.get_parameter(name).requires_grad_(False)
        model.get_parameter(name).requires_grad_(False)
    single = DASH(reference.named_parameters(), split_rows=split, **OPTIONS)
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "qkv": ColwiseParallel(output_layouts=Replicate()),
        "proj": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tensor_parallel"], plan)
    model.head.weight = model.embed.weight  # parallelize_module gave each its own DTensor
    fully_shard(model, mesh=mesh["data_parallel"])
    optimizer = DASH(model.named_parameters(), split_rows=split, **OPTIONS)  # the sharded distributor, found
    assert isinstance(optimizer.distributor, ShardedDistributor)
    data = mesh["data_parallel"]
    generator = torch.Generator().manual_seed(5)
    for step in range(5):
        tokens = torch.randint(0, VOCAB, (8, 7), generator=generator)
        single.zero_grad()
        (scale * next_token_loss(reference, tokens)).backward()
        optimizer.zero_grad()
        (scale * next_token_loss(model, tokens.chunk(data.size())[data.get_local_rank()])).backward()
        if step == fault_at:
            reference.qkv.weight.grad[0, 0] = math.inf
            if dist.get_rank() == dist.get_world_size() - 1:
                model.qkv.weight.grad.to_local()[-1, -1] = math.inf
            before = [param.full_tensor() for param in model.parameters()]
        single.step()
        optimizer.step()
        if step == fault_at:
            assert all(torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before))
    assert model.head.weight is model.embed.weight
    assert (optimizer.nonfinite_grad_skips, single.nonfinite_grad_skips) == ((1, 1) if fault_at is not None else (0, 0))
    assert optimizer.root_failure_count == single.root_failure_count == 0
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), expected.detach(), rtol=1e-9, atol=1e-9, msg=name)
    for name in frozen:
        assert torch.equal(model.get_parameter(name).full_tensor(), LanguageModel().double().get_parameter(name))


@pytest.mark.multiprocess
def test_tensor_parallel_and_hsdp_equal_one_process_and_partial_is_refused(tmp_path):
    """One set of 4 processes: tensor parallelism with sequence parallelism under FSDP2, a
    language model's layouts (tied vocabulary-parallel embedding, fused QKV) at 2x2 and 1x4
    (with frozen parameters, losses scaled by 1e20 and 1e-30, an infinite gradient piece),
    then HSDP, then a Partial parameter, named with its placements."""
    spawn(check_tensor_parallel, 4, tmp_path)


def check_hsdp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = MLP().double()
    fully_shard(model, mesh=mesh)
    assert model.up.weight.placements[0].is_replicate()
    check_against_one_process(model, lambda x: (x.chunk(world_size)[rank], 1), world_size)


def check_partial_is_refused(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    layer = nn.Linear(4, 4, bias=False)
    layer.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh, [Partial()]))
    with pytest.raises(ValueError, match=r"is placed as \(Partial\(sum\),\) on a mesh of shape \(4,\)"):
        DASH(layer.parameters(), **OPTIONS)  # built without a distributor: refused at once
    optimizer = DASH(layer.parameters(), distributor=ShardedDistributor(), **OPTIONS)
    layer.weight.grad = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"is placed as \(Partial\(sum\),\) on a mesh of shape \(4,\)"):
        optimizer.step()
