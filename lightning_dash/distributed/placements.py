"""Where each rank's part of a sharded parameter lies: FSDP2's rows, tensor parallelism's rows
or columns, replicas, as rectangles of the parameter's matrix view.

DASH exchanges block pieces between the ranks that hold them and the blocks' owners
(:mod:`.piece_exchange`). That needs every shard to be a rectangle of the matrix; this module
checks the placements and gathers every rank's rectangle once.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.nn import Module

from lightning_dash.distributed.holdings import Holdings, ParameterHoldings, Span
from lightning_dash.optim.stacks import Region

#: The rule :func:`check_sharded_placements` applies, as its messages state it.
PLACEMENT_RULE = (
    "every shard must be a rectangle of the parameter's matrix view (its first dimension by the rest): "
    "Shard(0) on any parameter (FSDP2's rows, column-parallel layers), Shard(1) on a 2-D weight only "
    "(row-parallel layers), or Replicate; Partial (an unreduced sum) and a Shard of dimension 1 or above "
    "of a 1-D, 3-D or 4-D parameter are refused"
)


def _placement_ok(placement: Placement, matrix: bool) -> bool:
    """Whether a mesh dimension cuts a parameter into rectangles of its matrix: by rows
    (FSDP2, a column-parallel weight, its strided form under FSDP2), by the columns of a
    matrix (a row-parallel weight), or not at all (replicated)."""
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim == 0 or (matrix and placement.dim == 1)
    return isinstance(placement, Replicate)


def check_sharded_placements(params: list[Tensor], names: list[str] | None) -> None:
    """Refuse parameters that are not DTensors cut into rectangles (:data:`PLACEMENT_RULE`),
    naming the first one (by ``names`` when given, else by position and shape)."""
    for index, param in enumerate(params):
        name = names[index] if names else f"parameter {index}"
        if not isinstance(param, DTensor):
            raise ValueError(
                f"{name} of shape {tuple(param.shape)} is not sharded (a plain tensor): with strategy 'dash_fsdp' "
                "every parameter must belong to a module passed to fully_shard (shard the root module last)"
            )
        if not all(_placement_ok(placement, param.dim() == 2) for placement in param.placements):
            raise ValueError(
                f"{name} of shape {tuple(param.shape)} is placed as {param.placements} on a mesh of shape "
                f"{tuple(param.device_mesh.shape)}, which DASH cannot exchange: " + PLACEMENT_RULE
            )


def refuse_dtensor_parameters(module: Module, strategy: str) -> None:
    """Refuse a module with DTensor parameters (tensor parallel, or sharded by the user) under a
    data-parallel strategy, before DDP wraps it, naming the first such parameter and the fix."""
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"parameter {name} is a DTensor placed as {param.placements} (the model is tensor parallel or "
                f"sharded): strategy {strategy!r} replicates plain tensors with DDP; use strategy 'dash_fsdp' "
                "(the Trainer's DashFSDPStrategy(tensor_parallel_size=...) with the tensor parallelism applied in "
                "configure_model, or Fabric's DashFabricFSDPStrategy(parallelize_fn=...))"
            )


def _rectangle(param: Tensor, view: tuple[int, int]) -> tuple[Span, Span]:
    """The rows and columns of ``param``'s matrix view ``view`` that this rank holds."""
    chunks = param.__create_chunk_list__() if isinstance(param, DTensor) else []
    if not chunks or 0 in chunks[0].sizes:
        return (0, 0), (0, 0)
    offsets, sizes = list(chunks[0].offsets), list(chunks[0].sizes)
    if param.dim() == 2 and tuple(param.shape) == view:
        return (offsets[0], offsets[0] + sizes[0]), (offsets[1], offsets[1] + sizes[1])
    per_entry = view[0] // param.shape[0]
    return (offsets[0] * per_entry, (offsets[0] + sizes[0]) * per_entry), (0, view[1])


def sharded_holdings(
    regions: list[Region], params: list[Tensor], names: list[str] | None, group: dist.ProcessGroup | None
) -> Holdings:
    """Every rank's rectangle of each blocked parameter, gathered once (collective over
    ``group``); a layout that does not cut a parameter into rectangles is refused."""
    views = {region.param_index: region.view.shape for region in regions}
    mine = {index: _rectangle(params[index], view) for index, view in views.items()}
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    holdings = Holdings(
        len(every), {index: ParameterHoldings(view, [held[index] for held in every]) for index, view in views.items()}
    )
    for index, cells in holdings.parameters.items():
        if not cells.tiles_exactly():
            name = names[index] if names else f"parameter {index}"
            raise ValueError(
                f"{name} is placed as {params[index].placements}: its shards do not cut the "
                f"{views[index]} matrix into rectangles DASH can exchange"
            )
    return holdings
