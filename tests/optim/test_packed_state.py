"""A side's factor and root packed into one tensor: exact round trips, and half the memory of two."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dash import DASH
from lightning_dash.optim.stacks import packed


def symmetric(num_blocks: int, size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(num_blocks, size, size, generator=generator, dtype=torch.float64)
    return (a + a.mT).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_a_pair_gives_back_its_factor_and_root_bit_for_bit(size, dtype):
    factor, root = symmetric(3, size, dtype, 0), symmetric(3, size, dtype, 1)
    pairs = packed.pack(factor, root)
    assert pairs.shape == (3, size + 1, size) and pairs.dtype == dtype
    assert torch.equal(packed.factors(pairs), factor)
    assert torch.equal(packed.roots(pairs), root)


def test_replacing_one_matrix_of_a_pair_leaves_the_other_and_the_unselected_blocks():
    factor, root = symmetric(4, 5, torch.float32, 0), symmetric(4, 5, torch.float32, 1)
    new_factor, new_root = symmetric(4, 5, torch.float32, 2), symmetric(4, 5, torch.float32, 3)
    pairs = packed.pack(factor, root)
    refactored = packed.with_factors(pairs, new_factor)
    assert torch.equal(packed.factors(refactored), new_factor)
    assert torch.equal(packed.roots(refactored), root)
    select = torch.tensor([True, False, True, False])
    rerooted = packed.with_roots(pairs, new_root, select)
    assert torch.equal(packed.factors(rerooted), factor)
    assert torch.equal(packed.roots(rerooted), torch.where(select[:, None, None], new_root, root))
    assert torch.equal(packed.factors(pairs), factor) and torch.equal(packed.roots(pairs), root)  # inputs unchanged


def test_an_asymmetric_input_keeps_its_stored_triangle():
    """A product that rounds ``(i, j)`` and ``(j, i)`` differently is kept as its factor's upper and
    its root's lower triangle, mirrored."""
    a = torch.randn(1, 6, 6, dtype=torch.float64)
    pairs = packed.pack(a, a)
    assert torch.equal(packed.factors(pairs), a.triu() + a.triu(1).mT)
    assert torch.equal(packed.roots(pairs), a.tril() + a.tril(-1).mT)


def test_dash_holds_each_side_in_the_room_of_one_matrix_and_a_row():
    """The state of one ``40 x 48`` block: two packed sides (``40 * 41 + 48 * 49`` elements), its
    momentum and grafting second moment (``40 * 48`` each), and per block a validity flag, a failure
    count and a float64 factor scale; the bias gets a momentum and second moment per element."""
    model = nn.Linear(48, 40)
    optimizer = DASH(model.parameters(), lr=1e-3, block_size=64)
    model(torch.randn(8, 48)).square().mean().backward()
    optimizer.step()
    matrix = 4 * (40 * 41 + 48 * 49 + 2 * 40 * 48) + 1 + 4 + 8
    assert optimizer.state_bytes() == matrix + 2 * 4 * 40


def test_saved_factors_and_roots_are_the_symmetric_matrices_the_step_used():
    """The state dict keeps full square matrices (the format before packing), each exactly symmetric."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = DASH(model.parameters(), lr=1e-2, block_size=16, precondition_frequency=1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(32, 12)).square().mean().backward()
        optimizer.step()
    entry = optimizer.state_dict()["state"][0]
    for key in ("left_factor_0_0", "right_factor_0_0", "left_root_0_0", "right_root_0_0"):
        matrix = entry[key]
        side = 16 if key.startswith("left") else 12
        assert matrix.shape == (side, side) and torch.equal(matrix, matrix.mT) and matrix.abs().max() > 0
