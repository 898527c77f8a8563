"""The plan of DASH's exchange on a data-parallel x tensor-parallel mesh, from shapes alone.

Each parameter gets the tensor-parallel style a Megatron/torchtitan plan gives it:
``"rows"`` (column-parallel projections, the vocabulary-parallel embedding and head: rows cut
over the tensor-parallel ranks, then each part over the data-parallel ranks, as
``(_StridedShard(0), Shard(0))``), ``"cols"`` (row-parallel projections: rows over the
data-parallel ranks, columns over the tensor-parallel ones) or ``"replicated"`` (norm
weights: rows over the data-parallel ranks, the same on every tensor-parallel rank).
Rank ``d * T + t`` holds the rectangle of data-parallel index ``d`` and tensor-parallel
index ``t``. The owners, stacks and pieces are those
:class:`~lightning_dash.distributed.ShardedDistributor` plans from such rectangles.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from _state_bytes import FLOAT32, block_state_bytes

from lightning_dash.distributed.assignment import block_cost, imbalance, lpt_assign
from lightning_dash.distributed.holdings import Holdings, ParameterHoldings, Span, row_range
from lightning_dash.distributed.micro_groups import assign_micro_groups, capacity_bytes, peak_gathered_bytes
from lightning_dash.distributed.piece_exchange import Piece, holder_preferences, plan_pieces, plan_rank
from lightning_dash.optim.stacks import StackPlan
from lightning_dash.optim.stacks.blocks import MatrixView
from lightning_dash.optim.stacks.layout import matrix_regions

#: Parameter-name endings of the row-parallel (``"cols"``) projections; other matrices are
#: column-parallel (``"rows"``), vectors are replicated.
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def tensor_parallel_style(name: str, shape: Sequence[int]) -> str:
    if len(shape) == 1:
        return "replicated"
    return "cols" if name.endswith(ROW_PARALLEL) else "rows"


def rectangle(shape: Sequence[int], style: str, data: int, tensor: int, dp: int, tp: int) -> tuple[Span, Span]:
    """The rows and columns the rank of indices (``data``, ``tensor``) holds."""
    rows, cols = shape[0], math.prod(shape[1:])
    if style == "rows":
        top, bottom = row_range(rows, tp, tensor)
        start, end = row_range(bottom - top, dp, data)
        return (top + start, top + end), (0, cols)
    if style == "cols":
        return row_range(rows, dp, data), row_range(cols, tp, tensor)
    return row_range(rows, dp, data), (0, cols)


def local_elements(shape: Sequence[int], style: str, data: int, tensor: int, dp: int, tp: int) -> int:
    (top, bottom), (left, right) = rectangle(shape, style, data, tensor, dp, tp)
    return (bottom - top) * (right - left)


def fsdp_shard(shape: Sequence[int], style: str, dp: int, tp: int) -> int:
    """Elements of one rank's padded FSDP2 shard (over the data-parallel ranks) of its
    tensor-parallel part."""
    rows, cols = shape[0], math.prod(shape[1:])
    if style == "rows":
        return _ceil(_ceil(rows, tp), dp) * cols
    if style == "cols":
        return _ceil(rows, dp) * _ceil(cols, tp)
    return _ceil(rows, dp) * cols


def _ceil(size: int, parts: int) -> int:
    return -(-size // parts)


@dataclass
class MeshPlan:
    """What every rank's :class:`~lightning_dash.distributed.ShardedDistributor` plans."""

    holdings: Holdings
    costs: list[float]
    owners: list[int]
    #: Elements of each block (tile order, as ``costs`` and ``owners``).
    elements: list[int]
    rank_plans: list[list[StackPlan]]
    gradients: list[Piece]
    updates: list[Piece]


def mesh_plan(
    named: list[tuple[str, tuple[int, ...]]],
    dp: int,
    tp: int,
    block_size: int,
    precondition_frequency: int = 10,
    root_iterations: int = 10,
) -> MeshPlan:
    """The blocks of ``named`` parameters owned over a ``dp`` x ``tp`` mesh, and every piece."""
    world = dp * tp
    shapes = [shape for _, shape in named]
    params = [torch.empty(shape, device="meta") for shape in shapes]
    regions = matrix_regions([MatrixView.of(p.shape) if p.dim() >= 2 else None for p in params], block_size)
    holdings = Holdings(
        world,
        {
            region.param_index: ParameterHoldings(
                region.view.shape,
                [
                    rectangle(
                        shapes[region.param_index],
                        tensor_parallel_style(*named[region.param_index]),
                        *divmod(rank, tp),
                        dp,
                        tp,
                    )
                    for rank in range(world)
                ],
            )
            for region in regions
        },
    )
    tiles = [tile for region in regions for tile in region.single_tiles()]
    costs = [block_cost(*tile.block_shape, precondition_frequency, root_iterations) for tile in tiles]
    owners = lpt_assign(costs, world, preferred=holder_preferences(regions, holdings))
    rank_plans, _ = plan_rank(regions, params, owners, holdings, rank=0)
    gradients, updates = plan_pieces(rank_plans, holdings)
    elements = [math.prod(tile.block_shape) for tile in tiles]
    return MeshPlan(holdings, costs, owners, elements, rank_plans, gradients, updates)


def tensor_parallel_plan(
    named: list[tuple[str, tuple[int, ...]]],
    dp: int,
    tp: int,
    block_size: int,
    micro_group_mib: float | None = None,
    **cost_options: int,
) -> dict:
    """Per-rank state, traffic and balance of DASH on a ``dp`` x ``tp`` mesh, with FSDP2's
    own traffic (bf16 parameters gathered twice, float32 gradients reduce-scattered, ring
    collectives over the ``dp`` ranks of a tensor-parallel index) and AdamW's state, and the
    whole blocks a rank gathers at once in micro-groups of ``micro_group_mib`` (None: one round).
    ``cost_options``: :func:`mesh_plan`'s ``precondition_frequency`` and ``root_iterations``."""
    start = time.perf_counter()
    world = dp * tp
    shapes = [shape for _, shape in named]
    styles = [tensor_parallel_style(name, shape) for name, shape in named]
    plan = mesh_plan(named, dp, tp, block_size, **cost_options)
    rank_plans, gradients, updates = plan.rank_plans, plan.gradients, plan.updates
    # What PieceExchange.elements_sent counts for every rank, from the pieces at once: the
    # gradient pieces it holds of other ranks' blocks and the update pieces of its blocks
    # that other ranks hold.
    elements = [0] * world
    for piece in gradients:
        if piece.holder != piece.owner:
            elements[piece.holder] += piece.numel
    for piece in updates:
        if piece.holder != piece.owner:
            elements[piece.owner] += piece.numel
    loads = [0.0] * world
    for owner, cost in zip(plan.owners, plan.costs):
        loads[owner] += cost
    state, gathered, adamw = [], [], []
    for rank, plans in enumerate(rank_plans):
        data, tensor = divmod(rank, tp)
        blocks = sum(block_state_bytes(*plan.block_shape) * plan.num_blocks for plan in plans)
        vectors = sum(
            2 * FLOAT32 * local_elements(shape, style, data, tensor, dp, tp)
            for shape, style in zip(shapes, styles)
            if len(shape) == 1
        )
        state.append(blocks + vectors)
        gathered.append(FLOAT32 * sum(plan.num_blocks * math.prod(plan.block_shape) for plan in plans))
        held = sum(local_elements(shape, style, data, tensor, dp, tp) for shape, style in zip(shapes, styles))
        adamw.append(2 * FLOAT32 * held)
    sent = [FLOAT32 * count for count in elements]
    footprints = [2 * FLOAT32 * count for count in plan.elements]
    capacity = None if micro_group_mib is None else capacity_bytes(micro_group_mib)
    groups = assign_micro_groups(plan.costs, plan.owners, footprints, capacity)
    shard = sum(fsdp_shard(shape, style, dp, tp) for shape, style in zip(shapes, styles))
    largest = max(block_state_bytes(*plan.block_shape) for plans in rank_plans for plan in plans)
    return {
        "data_parallel": dp,
        "tensor_parallel": tp,
        "world_size": world,
        "blocks": len(plan.owners),
        "gradient_pieces": len(gradients),
        "update_pieces": len(updates),
        "ownership_balance": imbalance(loads),
        "dash_state_bytes_max": max(state),
        "dash_state_bytes_mean": sum(state) / world,
        "largest_block_state_bytes": largest,
        "state_bound_holds": max(state) <= 1.1 * sum(state) / world + largest,
        "gathered_bytes_max": max(gathered),
        "micro_group_mib": micro_group_mib,
        "micro_groups": max(groups) + 1,
        "peak_gathered_bytes_max": max(peak_gathered_bytes(groups, plan.owners, footprints, world)),
        "adamw_state_bytes_max": max(adamw),
        "dash_bytes_sent_per_step_max": max(sent),
        "dash_bytes_sent_per_step_mean": sum(sent) / world,
        "fsdp_bytes_per_step": (dp - 1) * shard * (2 + 2 + 4),
        "plan_s": time.perf_counter() - start,
    }
