"""Spectral grafting: the Shampoo step takes the largest singular value of the grafting step.

The estimate is checked against float64 singular value decompositions; the optimizer's step
against the closed form of its first step and against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dash import DASH
from lightning_dash.optim.step.grafting import graft_spectral, spectral_norm


def largest_singular_values(blocks: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(blocks.double(), ord=2)


def with_spectrum(rows: int, cols: int, values: torch.Tensor, seed: int) -> torch.Tensor:
    """A ``rows x cols`` float64 matrix with singular values ``values`` and random singular vectors."""
    generator = torch.Generator().manual_seed(seed)
    left, _ = torch.linalg.qr(torch.randn(rows, len(values), generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(cols, len(values), generator=generator, dtype=torch.float64))
    return left @ torch.diag(values.double()) @ right.T


def test_estimate_is_exact_for_rank_one_and_flat_spectra_and_never_above_the_truth():
    generator = torch.Generator().manual_seed(0)
    exact = torch.stack(
        [
            with_spectrum(24, 40, torch.tensor([3.0]), seed=1),  # rank one
            with_spectrum(24, 40, torch.full((24,), 0.5), seed=2),  # flat: a scaled orthogonal map
            with_spectrum(24, 40, torch.tensor([2.0, 2.0, 1.0, 0.1]), seed=3),  # a repeated top value
        ]
    ).float()
    estimate = spectral_norm(exact).flatten()
    torch.testing.assert_close(estimate, largest_singular_values(exact), rtol=1e-5, atol=0)

    noisy = torch.randn(8, 24, 40, generator=generator)  # the hardest case: no gap at the top
    decaying = torch.stack([with_spectrum(24, 40, torch.logspace(0, -3, 24), seed=s) for s in range(8)]).float()
    for blocks, floor in ((noisy, 0.85), (decaying, 0.99)):
        ratio = spectral_norm(blocks).flatten() / largest_singular_values(blocks)
        assert (ratio <= 1 + 1e-6).all() and (ratio >= floor).all(), ratio


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e20, 1e30])
def test_estimate_scales_with_the_block_at_extreme_magnitudes(scale):
    blocks = torch.stack([with_spectrum(16, 12, torch.tensor([4.0, 1.0, 0.5]), seed=s) for s in range(3)])
    reference = spectral_norm(blocks.float()).flatten()
    scaled = spectral_norm((blocks * scale).float()).flatten()
    assert torch.isfinite(scaled).all()
    torch.testing.assert_close(scaled / scale, reference, rtol=1e-5, atol=0)


def test_grafted_blocks_take_the_reference_largest_singular_value():
    direction = torch.stack([with_spectrum(20, 12, torch.tensor([3.0, 1.0, 0.5]), seed=s) for s in range(3)]).float()
    reference = torch.stack([with_spectrum(20, 12, torch.tensor([5.0, 0.3]), seed=10 + s) for s in range(3)]).float()
    reference[1] *= 1e-25
    grafted = graft_spectral(direction, reference)
    torch.testing.assert_close(largest_singular_values(grafted), largest_singular_values(reference), rtol=1e-4, atol=0)

    # The direction is kept: only each block's scale changes.
    def unit(blocks: torch.Tensor) -> torch.Tensor:
        flat = blocks.flatten(1).double()
        return flat / flat.norm(dim=1, keepdim=True)

    torch.testing.assert_close(unit(grafted), unit(direction))


def test_a_zero_direction_stays_zero_and_a_zero_reference_gives_a_zero_step():
    direction = torch.randn(2, 6, 5)
    direction[0] = 0
    reference = torch.randn(2, 6, 5)
    reference[1] = 0
    grafted = graft_spectral(direction, reference)
    assert torch.equal(grafted, torch.zeros_like(grafted))


def test_first_step_has_the_spectral_norm_of_adams_first_step():
    """One gradient ``G = U S V^T``: with no momentum Adam's first step is ``lr * sign(G)`` (to its
    epsilon), and DASH's Shampoo direction (square roots, negligible damping) is ``U S^-1 V^T``, here
    with a clear top singular value (``G``'s smallest is 4x below the next), scaled to the largest
    singular value of Adam's step."""
    # square and of full rank: no null space, where float32 roundoff would meet the undamped root
    grad = with_spectrum(24, 24, torch.cat([torch.linspace(4.0, 1.0, 23), torch.tensor([0.25])]), seed=6)
    weight = torch.nn.Parameter(torch.zeros(24, 24))
    weight.grad = grad.float()
    options = dict(betas=(0.0, 0.95), epsilon=1e-10, inverse_root_method="eigh", grafting_norm="spectral", lr_scale=1.0)
    DASH([weight], lr=0.1, weight_decay=0.0, **options).step()
    step = -weight.detach().double()
    u, s, vh = torch.linalg.svd(grad, full_matrices=False)
    whitened = u @ torch.diag(1 / s) @ vh
    torch.testing.assert_close(step / step.norm(), whitened / whitened.norm(), rtol=0, atol=1e-4)
    # Adam's step has no gap at the top: its estimate is a little below the truth, never above.
    sign_norm = float(torch.linalg.matrix_norm(grad.sign(), ord=2))
    assert 0.9 * 0.1 * sign_norm <= float(torch.linalg.matrix_norm(step, ord=2)) <= 0.1 * sign_norm * (1 + 1e-5)


def test_spectral_grafting_takes_larger_steps_than_frobenius_on_a_low_rank_adam_step():
    """A gradient with a decaying spectrum: Adam's step concentrates in few directions, the whitened
    Shampoo step (damped at 1e-3, which flattens the 1/s of an undamped single gradient) spreads evenly,
    so matching the largest singular value gives the larger step."""
    grad = with_spectrum(32, 32, torch.logspace(0, -2, 32), seed=4).float()
    steps = {}
    for norm in ("frobenius", "spectral"):
        weight = torch.nn.Parameter(torch.zeros(32, 32))
        weight.grad = grad.clone()
        DASH([weight], lr=0.1, betas=(0.0, 0.95), epsilon=1e-3, grafting_norm=norm, lr_scale=1.0).step()
        steps[norm] = weight.detach().norm()
    assert steps["spectral"] > 1.5 * steps["frobenius"]


@pytest.mark.parametrize("value", ["operator", "Spectral", "", 0, -1, 2.5, True, None])
def test_a_wrong_grafting_norm_is_refused_by_name(value):
    weight = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"grafting_norm must be one of \('frobenius', 'spectral'\)"):
        DASH([weight], grafting_norm=value)
