"""Which block rows each rank sends under FSDP2 (``lightning_dash.distributed.row_exchange``),
against a brute-force reference that asks every rank for its rows with ``torch.chunk`` (how
FSDP2 cuts dim 0), on matrices, expert stacks and dimensions smaller than the world size."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dash.distributed.assignment import lpt_assign
from lightning_dash.distributed.block_exchange import split_by_owner
from lightning_dash.distributed.row_exchange import Piece, Runs, exchange_for, main_holder, plan_pieces
from lightning_dash.optim.stacks.blocks import MatrixView, matrix_shape
from lightning_dash.optim.stacks.layout import matrix_regions, stacks_by_placement

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


def simulated_exchange(world_size: int, block_size: int):
    """Every rank's side of both exchanges run in one process, the ``all_to_all`` done by
    hand: gradients of known full matrices to the owners' stacks, then random updates
    back to the holders' row shards. Returns what each side ended with and the inputs."""
    rank_plans, shapes, leading = plans_and_views(world_size, block_size)
    generator = torch.Generator().manual_seed(world_size * 100 + block_size)
    full = {index: torch.randn(shape, generator=generator, dtype=torch.float64) for index, shape in enumerate(SHAPES)}
    sides = [
        exchange_for(plan_pieces(rank_plans, shapes, world_size, leading, rank=rank), rank, world_size, shapes, leading)
        for rank in range(world_size)
    ]
    # what each rank holds, laid end to end in parameter order (torch.chunk: how FSDP2 cuts dim 0)
    held = []
    for rank in range(world_size):
        shards = [t.chunk(world_size)[rank] if rank < len(t.chunk(world_size)) else t[:0] for t in full.values()]
        held.append(torch.cat([shard.reshape(-1) for shard in shards]))
    sent = [held[rank][sides[rank].holder_runs().positions()] for rank in range(world_size)]
    parts = [list(sent[rank].split(sides[rank].outgoing_sizes)) for rank in range(world_size)]
    stacks = []
    for owner in range(world_size):
        received = torch.cat([parts[holder][owner] for holder in range(world_size)])
        runs = sides[owner].owner_runs(rank_plans[owner])
        flat = torch.full((runs.total,), math.nan, dtype=torch.float64)
        flat[runs.positions()] = received
        stacks.append(flat)
    updates = [torch.randn(flat.shape, generator=generator, dtype=torch.float64) for flat in stacks]
    back = [updates[owner][sides[owner].owner_runs(rank_plans[owner]).positions()] for owner in range(world_size)]
    back_parts = [list(back[owner].split(sides[owner].incoming_sizes)) for owner in range(world_size)]
    applied = []
    for holder in range(world_size):
        received = torch.cat([back_parts[owner][holder] for owner in range(world_size)])
        flat = torch.full_like(held[holder], math.nan)
        flat[sides[holder].holder_runs().positions()] = received
        applied.append(flat)
    return rank_plans, full, stacks, updates, applied


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("block_size", [4, 8, 1024])
def test_the_runs_carry_every_block_to_its_owner_and_every_update_back(world_size, block_size):
    rank_plans, full, stacks, updates, applied = simulated_exchange(world_size, block_size)
    expected_back = {index: torch.full_like(t.reshape(matrix_shape(t.shape)), math.nan) for index, t in full.items()}
    for owner, plans in enumerate(rank_plans):
        offset = 0
        for plan in plans:
            rows, cols = plan.block_shape
            stack = stacks[owner][offset : offset + plan.num_blocks * rows * cols].view(plan.num_blocks, rows, cols)
            update = updates[owner][offset : offset + plan.num_blocks * rows * cols].view(plan.num_blocks, rows, cols)
            for region in plan.regions:
                matrix = full[region.param_index].reshape(matrix_shape(full[region.param_index].shape))
                for position, tile in enumerate(region.single_tiles(), start=region.stack_offset):
                    window = (
                        slice(tile.row_start, tile.row_start + rows),
                        slice(tile.col_start, tile.col_start + cols),
                    )
                    assert torch.equal(stack[position], matrix[window])
                    expected_back[region.param_index][window] = update[position]
            offset += plan.num_blocks * rows * cols
        assert offset == stacks[owner].numel()  # the blocks fill the stacks (a NaN left unwritten fails above)
    # each holder's shards, end to end, got exactly the update rows of the blocks they belong to
    for index, expected in expected_back.items():
        shards = []
        for holder in range(world_size):
            position = sum(
                t.chunk(world_size)[holder].numel() if holder < len(t.chunk(world_size)) else 0
                for i, t in full.items()
                if i < index
            )
            chunks = full[index].chunk(world_size)
            numel = chunks[holder].numel() if holder < len(chunks) else 0
            shards.append(applied[holder][position : position + numel])
        assert torch.equal(torch.cat(shards).view(expected.shape), expected)


@pytest.mark.parametrize("runs", [0, 1, 2, 50])
def test_runs_expand_to_the_positions_they_list(runs):
    generator = torch.Generator().manual_seed(runs)
    starts = torch.randint(0, 10_000, (runs,), generator=generator)
    lengths = torch.randint(0, 40, (runs,), generator=generator)  # empty runs included
    expected = [start + i for start, length in zip(starts.tolist(), lengths.tolist()) for i in range(length)]
    expanded = Runs.of(starts, lengths)
    assert expanded.total == len(expected)
    assert expanded.positions().tolist() == expected
