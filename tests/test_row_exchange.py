"""Which block rows each rank sends under FSDP2 (``lightning_dash.distributed.row_exchange``),
against a brute-force reference that asks every rank for its rows with ``torch.chunk`` (how
FSDP2 cuts dim 0), on matrices, expert stacks and dimensions smaller than the world size."""

from __future__ import annotations

import pytest
import torch

from lightning_dash.distributed.assignment import lpt_assign
from lightning_dash.distributed.block_exchange import split_by_owner
from lightning_dash.distributed.row_exchange import Piece, exchange_for, main_holder, plan_pieces
from lightning_dash.optim.blocks import MatrixView, matrix_shape
from lightning_dash.optim.layout import matrix_regions, stacks_by_placement

SHAPES = [(37, 20), (5, 9), (64, 64), (3, 11, 7), (100, 3), (1, 13), (8, 4, 4)]


def plans_and_views(world_size: int, block_size: int):
    params = [torch.empty(shape, device="meta") for shape in SHAPES]
    regions = matrix_regions([MatrixView.of(p.shape) for p in params], block_size)
    tiles = [tile for region in regions for tile in region.single_tiles()]
    owners = lpt_assign([float(t.block_shape[0] * t.block_shape[1]) for t in tiles], world_size)
    rank_plans = [stacks_by_placement(owned, params) for owned in split_by_owner(regions, owners, world_size)]
    shapes = {index: matrix_shape(p.shape) for index, p in enumerate(params)}
    leading = {index: p.shape[0] for index, p in enumerate(params)}
    return rank_plans, shapes, leading


def held_view_rows(view_rows: int, leading: int, world_size: int, holder: int) -> tuple[int, int]:
    """The view rows ``holder`` keeps, from ``torch.chunk`` of the first dimension."""
    chunks = torch.arange(leading).chunk(world_size)
    if holder >= len(chunks) or len(chunks[holder]) == 0:
        return 0, 0
    per_entry = view_rows // leading
    return int(chunks[holder][0]) * per_entry, (int(chunks[holder][-1]) + 1) * per_entry


def brute_force_pieces(rank_plans, shapes, leading, world_size) -> list[Piece]:
    """Every (block, rank) overlap, visiting every rank for every block."""
    pieces = []
    for owner, plans in enumerate(rank_plans):
        for stack, plan in enumerate(plans):
            block_rows, block_cols = plan.block_shape
            for region in plan.regions:
                rows = shapes[region.param_index][0]
                for offset, tile in enumerate(region.single_tiles()):
                    for holder in range(world_size):
                        start, end = held_view_rows(rows, leading[region.param_index], world_size, holder)
                        low, high = max(tile.row_start, start), min(tile.row_start + block_rows, end)
                        if low < high:
                            cols = (tile.col_start, tile.col_start + block_cols)
                            block = region.stack_offset + offset
                            pieces.append(
                                Piece(
                                    owner,
                                    holder,
                                    stack,
                                    block,
                                    region.param_index,
                                    (low, high),
                                    cols,
                                    low - tile.row_start,
                                )
                            )
    return pieces


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 16, 40])
@pytest.mark.parametrize("block_size", [4, 8, 1024])
def test_pieces_equal_visiting_every_rank_and_each_rank_plans_only_its_own(world_size, block_size):
    rank_plans, shapes, leading = plans_and_views(world_size, block_size)
    every = plan_pieces(rank_plans, shapes, world_size, leading)
    assert every == brute_force_pieces(rank_plans, shapes, leading, world_size)
    # every block's rows are split among its holders exactly once
    heights: dict[tuple[int, int, int], int] = {}
    for piece in every:
        key = (piece.owner, piece.stack, piece.block)
        heights[key] = heights.get(key, 0) + piece.height
    for owner, plans in enumerate(rank_plans):
        for stack, plan in enumerate(plans):
            for block in range(plan.num_blocks):
                assert heights[(owner, stack, block)] == plan.block_shape[0]
    for rank in range(world_size):
        own = plan_pieces(rank_plans, shapes, world_size, leading, rank=rank)
        assert own == [p for p in every if rank in (p.owner, p.holder)]
        mine, full = (
            exchange_for(own, rank, world_size, shapes, leading),
            exchange_for(every, rank, world_size, shapes, leading),
        )
        assert mine == full


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 16, 64])
def test_the_main_holder_holds_the_most_rows_of_a_block(world_size):
    for view_rows, leading in [(37, 37), (1, 1), (4096, 4096), (33, 3), (1000, 1000), (12, 4)]:
        for top in range(0, view_rows, 7):
            for height in (1, 5, 16, 300):
                height = min(height, view_rows - top)
                held = [
                    max(0, min(top + height, end) - max(top, start))
                    for start, end in (held_view_rows(view_rows, leading, world_size, r) for r in range(world_size))
                ]
                expected = held.index(max(held)) if max(held) > 0 else None
                assert main_holder(top, height, view_rows, leading, world_size) == expected
