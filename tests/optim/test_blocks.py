"""Tiling: every element in exactly one block, blocks grouped by exact shape."""

from __future__ import annotations

import pytest
import torch

from lightning_dash.optim.stacks.blocks import MatrixView, matrix_shape, param_regions, stack_regions


@pytest.mark.parametrize("shape", [(1030, 17), (7, 5), (16, 27), (768, 256), (2048, 2048), (1, 9), (13, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 7, 1024])
def test_regions_cover_every_element_once(shape, block_size):
    coverage = torch.zeros(shape, dtype=torch.int64)
    for region in param_regions(0, MatrixView(*shape), block_size):
        rows, cols = region.block_shape
        assert rows <= block_size and cols <= block_size
        region.window(coverage).add_(1)
    assert (coverage == 1).all()


def test_tile_shapes_follow_the_blocking_rule():
    regions = param_regions(0, MatrixView(1030, 17), 1024)
    assert [(r.block_shape, r.num_blocks) for r in regions] == [((1024, 17), 1), ((6, 17), 1)]
    regions = param_regions(0, MatrixView(2500, 2100), 1024)
    assert [(r.block_shape, r.num_blocks) for r in regions] == [
        ((1024, 1024), 4),
        ((1024, 52), 2),
        ((452, 1024), 2),
        ((452, 52), 1),
    ]


def test_conv_kernels_are_viewed_as_out_by_in_times_kernel():
    assert matrix_shape(torch.Size([16, 3, 3, 3])) == (16, 27)


def plan_stacks(shapes, block_size):
    """Stacks of the tiles of every matrix (index -> shape), by block shape."""
    regions = [
        region for index in sorted(shapes) for region in param_regions(index, MatrixView(*shapes[index]), block_size)
    ]
    return {plan.block_shape: plan for plan in stack_regions(regions)}


def test_stacks_gather_tiles_of_all_parameters_in_order():
    generator = torch.Generator().manual_seed(0)
    matrices = {
        0: torch.randn(8, 12, generator=generator),
        1: torch.randn(4, 4, generator=generator),
        2: torch.randn(9, 4, generator=generator),
    }
    stacks = plan_stacks({k: tuple(v.shape) for k, v in matrices.items()}, block_size=4)
    assert {shape: plan.num_blocks for shape, plan in stacks.items()} == {(4, 4): 6 + 1 + 2, (1, 4): 1}
    gathered = stacks[(4, 4)].gather(matrices)
    expected = [matrices[0][r : r + 4, c : c + 4] for r in (0, 4) for c in (0, 4, 8)]
    expected += [matrices[1]] + [matrices[2][r : r + 4] for r in (0, 4)]
    torch.testing.assert_close(gathered, torch.stack(expected))
    torch.testing.assert_close(stacks[(1, 4)].gather(matrices), matrices[2][8:].unsqueeze(0))


def test_subset_keeps_positions_of_the_chosen_parameters():
    stacks = plan_stacks({0: (8, 8), 1: (4, 4), 2: (8, 4)}, block_size=4)
    subset, positions = stacks[(4, 4)].subset({1, 2})
    assert positions == [4, 5, 6]
    assert [r.param_index for r in subset.regions] == [1, 2] and subset.num_blocks == 3


def test_add_to_adds_each_tile_to_its_parameter_also_when_not_contiguous():
    generator = torch.Generator().manual_seed(1)
    params = [torch.randn(8, 12, generator=generator), torch.randn(12, 8, generator=generator).t()]
    assert not params[1].is_contiguous()
    plan = plan_stacks({0: (8, 12), 1: (8, 12)}, block_size=4)[(4, 4)]
    update = torch.randn(plan.num_blocks, 4, 4, generator=generator)
    expected = [p.clone() for p in params]
    for region in plan.regions:
        region.window(expected[region.param_index]).add_(region.tiles(update))
    plan.add_to(params, update)
    for param, wanted in zip(params, expected):
        torch.testing.assert_close(param, wanted)
