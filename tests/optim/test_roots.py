"""Batched inverse roots against float64 eigendecompositions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_dash.optim import DashConfig
from lightning_dash.optim.roots import (
    INVERSE_ROOT_METHODS,
    MAX_ROOT_ERROR,
    RootSettings,
    chebyshev_floor,
    failure_residual,
    inverse_root,
    spectrum_floor,
)
from lightning_dash.optim.roots.newton import planned_scaled_iterations
from lightning_dash.optim.roots.scaling import frobenius_scale, power_iteration_scale
from lightning_dash.testing.op_counts import count_ops


def root_settings(**changes) -> RootSettings:
    """DASH's default root settings (``DashConfig().root_settings``) with ``changes``; unless changed, the
    Newton-DB solver, the fourth root and absolute damping, as these tests' expectations are written for."""
    fixed = {"method": "newton_db", "root_order": 4, "relative_epsilon": False, **changes}
    return dataclasses.replace(DashConfig().root_settings, **fixed)


def spd_stack(n: int, size: int, condition: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random symmetric PSD blocks with eigenvalues log-spaced in [1/condition, 1] * 3."""
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(n, size, size, generator=generator, dtype=torch.float64))
    values = 3.0 * torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), size, dtype=torch.float64)
    values = values.expand(n, size)
    return (basis * values.unsqueeze(1)) @ basis.transpose(1, 2), basis, values


def reference_root(basis, values, eps, p):
    return (basis * (values + eps).pow(-1.0 / p).unsqueeze(1)) @ basis.transpose(1, 2)


def relative_error(result, reference):
    return ((result.double() - reference).norm(dim=(1, 2)) / reference.norm(dim=(1, 2))).max().item()


# Tolerances: float32 Newton iterations converge to a few ulps times the condition
# number's fourth root; bf16/fp16 matmuls carry their roundoff (2^-8, 2^-11) times a
# small growth factor; the Chebyshev interpolant is accurate to ~1e-3 by construction
# (chebyshev_floor) and the eigensolver to float32 roundoff.
TOLERANCE = {
    ("eigh", torch.float32): 1e-5,
    ("coupled_newton", torch.float32): 1e-4,
    ("newton_db", torch.float32): 1e-4,
    ("chebyshev", torch.float32): 2e-3,
    ("coupled_newton", torch.bfloat16): 3e-2,
    ("newton_db", torch.bfloat16): 3e-2,
    ("chebyshev", torch.bfloat16): 3e-2,
    ("coupled_newton", torch.float16): 5e-3,
    ("newton_db", torch.float16): 5e-3,
    ("chebyshev", torch.float16): 5e-3,
}


@pytest.mark.parametrize("method,dtype", sorted(TOLERANCE, key=str))
@pytest.mark.parametrize("scaling", ["frobenius", "power_iteration"])
@pytest.mark.parametrize("p", [2, 4])
def test_root_matches_float64_eigh(method, dtype, scaling, p):
    stats, basis, values = spd_stack(5, 48, condition=20.0)
    # The Newton solvers damp by at least 8 units of matmul roundoff times the scale
    # (||A||_F ~ 9 here): 0.28 in bf16, 0.035 in fp16. Epsilon sits above that floor so
    # the exact (A + eps I)^(-1/p) is what every solver targets.
    eps_value = {torch.float32: 1e-6, torch.float16: 0.05, torch.bfloat16: 0.5}[dtype]
    eps = torch.full((5,), eps_value, dtype=torch.float64)
    settings = root_settings(method=method, scaling=scaling, matmul_dtype=dtype, root_order=p)
    result = inverse_root(stats.float(), eps.float(), settings)
    assert result.root.dtype == torch.float32
    assert relative_error(result.root, reference_root(basis, values, eps_value, p)) < TOLERANCE[(method, dtype)]


@pytest.mark.parametrize("method", INVERSE_ROOT_METHODS)
def test_batched_equals_one_block_at_a_time(method):
    stats, _, _ = spd_stack(6, 24, condition=50.0, seed=3)
    stats = stats.float()
    eps = torch.linspace(1e-6, 1e-3, 6)
    settings = root_settings(method=method)
    batched = inverse_root(stats, eps, settings).root
    single = torch.cat([inverse_root(stats[i : i + 1], eps[i : i + 1], settings).root for i in range(6)])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", INVERSE_ROOT_METHODS)
def test_zero_blocks_give_finite_roots(method):
    stats = torch.zeros(3, 16, 16)
    result = inverse_root(stats, torch.full((3,), 1e-12), root_settings(method=method))
    assert torch.isfinite(result.root).all()
    # The exact answer is eps^(-1/4) I; eigh and the Newton solvers reach it.
    if method != "chebyshev":
        torch.testing.assert_close(result.root, torch.eye(16).expand(3, 16, 16) * 1e3, rtol=1e-3, atol=0)


def test_newton_residual_reports_convergence():
    stats, _, _ = spd_stack(4, 32, condition=10.0)
    converged = inverse_root(stats.float(), torch.full((4,), 1e-6), root_settings(iterations=15))
    truncated = inverse_root(stats.float(), torch.full((4,), 1e-6), root_settings(iterations=2))
    assert converged.residual.max() < 1e-4
    assert truncated.residual.min() > 1e-2


def test_scales_bound_the_largest_eigenvalue():
    stats, _, values = spd_stack(6, 40, condition=1e3, seed=7)
    largest = values[:, 0]
    frobenius = frobenius_scale(stats.float()).double()
    power = power_iteration_scale(stats.float()).double()
    assert (frobenius >= largest * (1 - 1e-6)).all()
    # Power iteration lands within 10% below the largest eigenvalue, then is inflated by 1.1.
    assert (power >= largest * 0.99).all() and (power <= largest * 1.1 * (1 + 1e-5)).all()


def test_power_iteration_ignores_global_random_state():
    stats, _, _ = spd_stack(3, 32, condition=100.0)
    torch.manual_seed(1)
    first = power_iteration_scale(stats.float())
    torch.manual_seed(2)
    torch.rand(100)
    second = power_iteration_scale(stats.float())
    assert torch.equal(first, second)


def test_chebyshev_regularises_below_its_floor():
    # Eigenvalues far below the interpolation floor are damped, never blown up.
    stats, basis, values = spd_stack(2, 32, condition=1e6)
    result = inverse_root(stats.float(), torch.full((2,), 1e-9), root_settings(method="chebyshev"))
    eigenvalues = torch.linalg.eigvalsh(result.root.double())
    floor_value = (chebyshev_floor(40) * values[:, 0].max().item()) ** -0.25
    assert torch.isfinite(eigenvalues).all()
    assert eigenvalues.max() < 2.0 * floor_value
    assert eigenvalues.min() > 0


def test_eigh_clamps_rank_deficient_statistics():
    # Nine zero eigenvalues come out of float32 eigh as +-1e-5 noise; clamping at zero
    # keeps every damped eigenvalue at least eps (1e-2 here, well above that noise).
    g = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    stats = (g @ g.T).unsqueeze(0)
    result = inverse_root(stats.float(), torch.tensor([1e-2]), root_settings(method="eigh"))
    values, vectors = torch.linalg.eigh(stats[0])
    expected = (vectors * (values.clamp_min(0) + 1e-2).pow(-0.25)) @ vectors.T
    torch.testing.assert_close(result.root[0].double(), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("method", ["newton_db", "coupled_newton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("iterations", [10, 40])
def test_newton_solvers_stay_finite_on_rank_deficient_statistics(method, dtype, iterations):
    """Shampoo factors are low-rank early in training: rank 1..16 of 64 with eps=1e-12."""
    generator = torch.Generator().manual_seed(0)
    for rank in (1, 3, 16):
        g = torch.randn(8, 64, rank, generator=generator)
        stats = g @ g.transpose(1, 2)
        settings = root_settings(method=method, matmul_dtype=dtype, iterations=iterations)
        root = inverse_root(stats, torch.full((8,), 1e-12), settings).root
        assert torch.isfinite(root).all()
        # A^(-1/4) of a PSD matrix is positive definite.
        values = torch.linalg.eigvalsh(root.double())
        assert (values > 0).all()


@pytest.mark.parametrize("condition,tolerance", [(1e3, 1e-3), (1e5, 2e-2)])
def test_newton_db_resolves_ill_conditioned_factors_in_ten_iterations(condition, tolerance):
    """Scaled Newton-Schulz: ten iterations per pass reach eigh-like accuracy at condition
    1e3 and stay within 2% at 1e5, where the unscaled iteration was off by 77% (measured)."""
    stats, basis, values = spd_stack(4, 48, condition=condition, seed=2)
    result = inverse_root(stats.float(), torch.full((4,), 1e-12), root_settings(method="newton_db"))
    assert relative_error(result.root, reference_root(basis, values, 1e-12, 4)) < tolerance


def shampoo_factor(n: int, size: int, rank: int, seed: int) -> torch.Tensor:
    """Rank-deficient float64 factors ``G G^T`` whose gradient columns decay over two decades."""
    generator = torch.Generator().manual_seed(seed)
    grads = torch.randn(n, size, rank, generator=generator, dtype=torch.float64)
    grads = grads * torch.logspace(0, -2, rank, dtype=torch.float64)
    return grads @ grads.transpose(1, 2)


@pytest.mark.parametrize("method", ["newton_db", "coupled_newton", "chebyshev"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_iterative_solvers_never_wait_on_the_host(method, dtype):
    """Iteration counts and scalings are planned on the host and convergence is a mask, so
    no value is read back: the whole refresh can be queued on a GPU without a stall."""
    stats = shampoo_factor(3, 32, 4, seed=0).float()
    eps, scale = torch.full((3,), 1e-6), torch.full((3,), 2.0, dtype=torch.float64)
    settings = root_settings(method=method, matmul_dtype=dtype, relative_epsilon=True)
    result, counts = count_ops(lambda: inverse_root(stats, eps, settings, scale, 1e-6))
    assert counts.sync_count == 0, counts.syncs
    assert torch.isfinite(result.root).all()


def test_newton_db_fourth_root_is_one_pass_of_four_matmuls_per_iteration():
    """``A^(-1/4)`` at DASH's default damping: one scaled coupled iteration whose first step
    needs no matmul into ``X = I`` and whose last needs no ``M``, 4 (K - 1) = 40 matmuls with
    the Frobenius bound (two Newton-Schulz passes took 13 + 9 iterations, 66 matmuls)."""
    stats = shampoo_factor(2, 32, 4, seed=1).float()
    settings = root_settings(method="newton_db", scaling="frobenius", relative_epsilon=True)
    floor = spectrum_floor(settings, 32, 1e-6)
    iterations = planned_scaled_iterations(floor, 1.0, 4)
    _, counts = count_ops(lambda: inverse_root(stats, torch.full((2,), 1e-6), settings, None, 1e-6))
    assert iterations <= 11
    assert counts.launches["bmm"] == 4 * (iterations - 1)


@pytest.mark.parametrize("method", ["newton_db", "coupled_newton"])
@pytest.mark.parametrize("scaling", ["frobenius", "power_iteration"])
def test_newton_roots_of_rank_deficient_factors_at_the_default_damping(method, scaling):
    """Rank 8 of 64 with relative damping 1e-6, the optimizer's defaults: both solvers converge
    (residual well below the float32 tolerance's order) and stay within 3e-3 of the float64
    root; the remaining error is float32 roundoff amplified by the damped null space
    (the two-pass Newton-DB was 3.3e-3 off here with a residual of 6e-5)."""
    stats = shampoo_factor(4, 64, 8, seed=0)
    damping = 1e-6 * torch.linalg.matrix_norm(stats)
    values, vectors = torch.linalg.eigh(stats)
    expected = (vectors * (values + damping[:, None]).pow(-0.25).unsqueeze(1)) @ vectors.transpose(1, 2)
    settings = root_settings(method=method, scaling=scaling, relative_epsilon=True)
    result = inverse_root(stats.float(), torch.full((4,), 1e-6), settings, None, 1e-6)
    error = ((result.root.double() - expected).norm(dim=(1, 2)) / expected.norm(dim=(1, 2))).max().item()
    assert error < 3e-3
    assert result.residual.max() < 2e-5


@pytest.mark.parametrize("order", [2, 4])
def test_failure_residual_allows_the_largest_root_error_at_each_order(order):
    # A residual r of P = X^p A leaves the root's eigenvalues off by (1 - r)^(1/p): at the
    # threshold, exactly MAX_ROOT_ERROR (float32's roundoff floor is far below it).
    limit = failure_residual(root_settings(root_order=order))
    assert 1.0 - (1.0 - limit) ** (1.0 / order) == pytest.approx(MAX_ROOT_ERROR)


def test_eigh_roots_of_a_spiky_float32_factor_are_float64_accurate():
    """A factor with one dominant direction and a tail 1e-3 to 1e-6 below it (a recurrent
    layer's, under an Adam-trained output layer): an eigendecomposition in float32 misplaces the
    tail's eigenvalues by ~1e-7 of the largest one, a large relative error under a damping of
    1e-3 of the norm (1.1e-4 of the root, measured). The roots must match the float64 formula on
    the same float32 input to within the float32 rounding of the normalised block (1.2e-6)."""
    size = 96
    generator = torch.Generator().manual_seed(5)
    basis, _ = torch.linalg.qr(torch.randn(2, size, size, generator=generator, dtype=torch.float64))
    values = torch.cat([torch.ones(1), torch.logspace(-3, -6, size - 1)]).double().expand(2, size)
    stats = ((basis * values.unsqueeze(1)) @ basis.transpose(1, 2)).float()
    eps = torch.full((2,), 1e-3)
    settings = root_settings(method="eigh", root_order=2, relative_epsilon=True)
    result = inverse_root(stats, eps, settings).root

    exact = stats.double()
    damping = 1e-3 * torch.linalg.matrix_norm(exact)
    eigenvalues, eigenvectors = torch.linalg.eigh(exact)
    expected = (eigenvectors * (eigenvalues + damping[:, None]).pow(-0.5).unsqueeze(1)) @ eigenvectors.transpose(1, 2)
    assert relative_error(result, expected) < 1e-5


def test_a_float64_decomposition_resolves_the_tail_a_float32_one_mixes_at_the_default_damping():
    """A factor whose tail's eigenvalues lie closer together than float32 roundoff of the largest one (gaps
    of 1e-8 of it, under the default damping of 3e-5): a float32 decomposition turns those eigenvectors into
    one another, a float64 one does not. Against the float64 formula on the same float32 input, the root
    from ``eigh_dtype="float64"`` is as close as the float32 rounding of the normalised block allows (6e-8 of
    the largest eigenvalue moves the tail's by 0.6%; 3.9e-5 of the root, measured), the float32 one 20x
    further off (7.9e-4)."""
    size = 64
    generator = torch.Generator().manual_seed(7)
    basis, _ = torch.linalg.qr(torch.randn(2, size, size, generator=generator, dtype=torch.float64))
    tail = 1e-5 + 1e-8 * torch.arange(size - 1, dtype=torch.float64)  # near the damping, gaps of 1e-8
    values = torch.cat([torch.ones(1, dtype=torch.float64), tail]).expand(2, size)
    stats = ((basis * values.unsqueeze(1)) @ basis.transpose(1, 2)).float()
    eps = torch.full((2,), DashConfig().epsilon)
    exact = stats.double()
    damping = DashConfig().epsilon * torch.linalg.matrix_norm(exact)
    eigenvalues, eigenvectors = torch.linalg.eigh(exact)
    expected = (eigenvectors * (eigenvalues + damping[:, None]).pow(-0.5).unsqueeze(1)) @ eigenvectors.transpose(1, 2)
    errors = {
        dtype: relative_error(
            inverse_root(
                stats, eps, root_settings(method="eigh", root_order=2, relative_epsilon=True, eigh_dtype=dtype)
            ).root,
            expected,
        )
        for dtype in (torch.float32, torch.float64)
    }
    assert errors[torch.float64] < 1e-4, errors
    assert errors[torch.float32] > 10 * errors[torch.float64], errors


def test_a_float32_decomposition_that_fails_is_taken_again_in_float64():
    """A stack whose float32 eigendecomposition raises (simulated: torch's eigh refused float32 input) gets
    the float64 roots, not NaN."""
    stats, basis, values = spd_stack(2, 8, 1e3)
    settings = root_settings(method="eigh", root_order=2, eigh_dtype=torch.float32)
    real = torch.linalg.eigh

    def refuse_float32(matrix, *args, **kwargs):
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("did not converge")
        return real(matrix, *args, **kwargs)

    torch.linalg.eigh = refuse_float32
    try:
        result = inverse_root(stats.float(), torch.full((2,), 1e-3), settings).root
    finally:
        torch.linalg.eigh = real
    expected = inverse_root(stats.float(), torch.full((2,), 1e-3), root_settings(method="eigh", root_order=2)).root
    assert torch.isfinite(result).all()
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
