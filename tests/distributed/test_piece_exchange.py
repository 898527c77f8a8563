"""Which block pieces each rank sends (``lightning_dash.distributed.piece_exchange``): FSDP2's
rows against a brute-force reference that asks every rank for its rows with ``torch.chunk``
(how FSDP2 cuts dim 0), on matrices, expert stacks and dimensions smaller than the world size;
tensor parallelism's rectangles and replicas."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dash.distributed.assignment import lpt_assign
from lightning_dash.distributed.block_exchange import split_by_owner
from lightning_dash.distributed.holdings import Holdings, ParameterHoldings
from lightning_dash.distributed.piece_exchange import Piece, Runs, exchange_for, plan_pieces
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
    return rank_plans, shapes, leading, Holdings.by_rows(shapes, leading, world_size)


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
    rank_plans, shapes, leading, holdings = plans_and_views(world_size, block_size)
    every, updates = plan_pieces(rank_plans, holdings)
    assert every == brute_force_pieces(rank_plans, shapes, leading, world_size)
    assert updates == every  # no replicas: each update piece goes back the way its gradient came
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
        own, own_updates = plan_pieces(rank_plans, holdings, rank=rank)
        assert own == own_updates == [p for p in every if rank in (p.owner, p.holder)]
        assert exchange_for(own, own_updates, rank, holdings) == exchange_for(every, updates, rank, holdings)


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
                holdings = Holdings.by_rows({0: (view_rows, 1)}, {0: leading}, world_size)
                assert holdings.main_holder(0, (top, top + height), (0, 1)) == expected


def simulated_exchange(rank_plans, holdings: Holdings, seed: int):
    """Every rank's side of both exchanges run in one process, the ``all_to_all`` done by
    hand: gradients of known full matrices (each rank holding its rectangles of them, end
    to end in parameter order) to the owners' stacks, then random updates back to every
    holder. Returns the full matrices, what each owner received, the updates it sent, and
    what each holder's flat tensor ended with (NaN where nothing arrived)."""
    world_size = holdings.world_size
    generator = torch.Generator().manual_seed(seed)
    full = {
        index: torch.randn(cells.shape, generator=generator, dtype=torch.float64)
        for index, cells in holdings.parameters.items()
    }
    sides = []
    for rank in range(world_size):
        gradients, updates = plan_pieces(rank_plans, holdings, rank=rank)
        sides.append(exchange_for(gradients, updates, rank, holdings))
    held = []
    for rank in range(world_size):
        parts = []
        for index in sorted(full):
            (top, bottom), (left, right) = holdings.held(index, rank)
            parts.append(full[index][top:bottom, left:right].reshape(-1))
        held.append(torch.cat(parts))
    sent = [held[rank][sides[rank].gradient_send_runs().positions()] for rank in range(world_size)]
    parts = [list(sent[rank].split(sides[rank].split_sizes["gradients_out"])) for rank in range(world_size)]
    stacks = []
    for owner in range(world_size):
        assert [len(part) for part in (parts[holder][owner] for holder in range(world_size))] == sides[
            owner
        ].split_sizes["gradients_in"]
        received = torch.cat([parts[holder][owner] for holder in range(world_size)])
        runs = sides[owner].gradient_receive_runs(rank_plans[owner])
        flat = torch.full((runs.total,), math.nan, dtype=torch.float64)
        flat[runs.positions()] = received
        stacks.append(flat)
    updates = [torch.randn(flat.shape, generator=generator, dtype=torch.float64) for flat in stacks]
    back = [updates[owner][sides[owner].update_send_runs(rank_plans[owner]).positions()] for owner in range(world_size)]
    back_parts = [list(back[owner].split(sides[owner].split_sizes["updates_out"])) for owner in range(world_size)]
    applied = []
    for holder in range(world_size):
        received = torch.cat([back_parts[owner][holder] for owner in range(world_size)])
        flat = torch.full_like(held[holder], math.nan)
        flat[sides[holder].update_receive_runs().positions()] = received
        applied.append(flat)
    return full, stacks, updates, applied


def assert_exchange_is_exact(rank_plans, holdings: Holdings, seed: int) -> None:
    """Owners receive exactly their blocks' gradients; every holder (replicas included)
    receives exactly the updates of the elements it holds, each once."""
    full, stacks, updates, applied = simulated_exchange(rank_plans, holdings, seed)
    expected_back = {index: torch.full_like(matrix, math.nan) for index, matrix in full.items()}
    for owner, plans in enumerate(rank_plans):
        offset = 0
        for plan in plans:
            rows, cols = plan.block_shape
            stack = stacks[owner][offset : offset + plan.num_blocks * rows * cols].view(plan.num_blocks, rows, cols)
            update = updates[owner][offset : offset + plan.num_blocks * rows * cols].view(plan.num_blocks, rows, cols)
            for region in plan.regions:
                matrix = full[region.param_index]
                for position, tile in enumerate(region.single_tiles(), start=region.stack_offset):
                    window = (
                        slice(tile.row_start, tile.row_start + rows),
                        slice(tile.col_start, tile.col_start + cols),
                    )
                    assert torch.equal(stack[position], matrix[window])
                    expected_back[region.param_index][window] = update[position]
            offset += plan.num_blocks * rows * cols
        assert offset == stacks[owner].numel()  # the blocks fill the stacks (a NaN left unwritten fails above)
    for holder in range(holdings.world_size):
        position = 0
        for index in sorted(full):
            (top, bottom), (left, right) = holdings.held(index, holder)
            expected = expected_back[index][top:bottom, left:right].reshape(-1)
            got = applied[holder][position : position + expected.numel()]
            assert torch.equal(got, expected), (holder, index)
            position += expected.numel()


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("block_size", [4, 8, 1024])
def test_the_runs_carry_every_block_to_its_owner_and_every_update_back(world_size, block_size):
    rank_plans, _, _, holdings = plans_and_views(world_size, block_size)
    assert_exchange_is_exact(rank_plans, holdings, seed=world_size * 100 + block_size)


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    step = -(-size // parts) if size else 0
    return min(index * step, size), min((index + 1) * step, size)


def tensor_parallel_holdings(dp: int, tp: int) -> tuple[list, Holdings]:
    """A dp x tp mesh (rank = d * tp + t) as tensor parallelism and FSDP2 lay out a
    column-parallel weight (rows cut by tp, then each part by dp), a row-parallel weight
    (rows by dp, columns by tp) and a weight replicated over tp (rows by dp), and the
    blocks of one process owned by LPT over all dp * tp ranks."""
    world_size = dp * tp
    shapes = {0: (23, 10), 1: (10, 23), 2: (7, 9)}
    rectangles: dict[int, list] = {index: [] for index in shapes}
    for rank in range(world_size):
        d, t = divmod(rank, tp)
        top, bottom = _chunk(23, tp, t)
        sub = _chunk(bottom - top, dp, d)
        rectangles[0].append(((top + sub[0], top + sub[1]), (0, 10)))
        rectangles[1].append((_chunk(10, dp, d), _chunk(23, tp, t)))
        rectangles[2].append((_chunk(7, dp, d), (0, 9)))
    holdings = Holdings(world_size, {index: ParameterHoldings(shapes[index], rectangles[index]) for index in shapes})
    params = [torch.empty(shape, device="meta") for shape in shapes.values()]
    regions = matrix_regions([MatrixView.of(p.shape) for p in params], 4)
    tiles = [tile for region in regions for tile in region.single_tiles()]
    owners = lpt_assign([float(t.block_shape[0] * t.block_shape[1]) for t in tiles], world_size)
    rank_plans = [stacks_by_placement(owned, params) for owned in split_by_owner(regions, owners, world_size)]
    return rank_plans, holdings


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (2, 2), (1, 4), (4, 1), (3, 2)])
def test_rectangles_and_replicas_exchange_exactly(dp, tp):
    rank_plans, holdings = tensor_parallel_holdings(dp, tp)
    assert_exchange_is_exact(rank_plans, holdings, seed=dp * 10 + tp)
    gradients, updates = plan_pieces(rank_plans, holdings)
    # each element of a block comes from one holder, and goes back to every holder of it
    assert sum(p.numel for p in gradients) == sum(
        plan.num_blocks * plan.block_shape[0] * plan.block_shape[1] for plans in rank_plans for plan in plans
    )
    replicas = {index: len(cells.cells[0].holders) for index, cells in holdings.parameters.items()}
    assert replicas == {0: 1, 1: 1, 2: tp}
    assert sum(p.numel for p in updates) == sum(p.numel * replicas[p.param_index] for p in gradients)
    # a gradient is read on its owner whenever the owner holds it (nothing travels)
    for piece in gradients:
        cell = next(
            c
            for c in holdings.parameters[piece.param_index].cells
            if c.rows[0] <= piece.rows[0] < c.rows[1] and c.cols[0] <= piece.cols[0] < c.cols[1]
        )
        assert piece.holder == (piece.owner if piece.owner in cell.holders else cell.holders[0])


@pytest.mark.parametrize("runs", [0, 1, 2, 50])
def test_runs_expand_to_the_positions_they_list(runs):
    generator = torch.Generator().manual_seed(runs)
    starts = torch.randint(0, 10_000, (runs,), generator=generator)
    lengths = torch.randint(0, 40, (runs,), generator=generator)  # empty runs included
    expected = [start + i for start, length in zip(starts.tolist(), lengths.tolist()) for i in range(length)]
    expanded = Runs.of(starts, lengths)
    assert expanded.total == len(expected)
    assert expanded.positions().tolist() == expected
