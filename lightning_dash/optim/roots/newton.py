"""Newton-type inverse roots: one coupled Newton iteration (Guo and Higham) for p in {2, 4},
with host-planned scalings (``newton_db``) or without (``coupled_newton``).

The iteration ``X <- X N, M <- N^p M, N = ((p+1) I - M) / p`` from ``X = I, M = A`` drives
``M = X^p A`` to ``I`` and so ``X`` to ``A^(-1/p)``; for p = 2 it is the coupled
Newton-Schulz (product Denman-Beavers) iteration with ``M = Z Y``. Both solvers run a fixed,
host-planned number of batched iterations with a per-block convergence mask: a converged
block gets ``N = I``, which leaves ``X`` and ``M`` as they are, so no iteration waits on the
host (its matmuls still run, at full cost).

Matmuls per refresh of ``K`` iterations: ``log2(p) + 1`` for ``N^p M`` and one for ``X N``
in every iteration, except that the first multiplies nothing into ``X = I`` and the last
needs no ``M``: ``(log2(p) + 2) (K - 1)`` in all (``4 (K - 1)`` for the fourth root).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from lightning_dash.optim.roots.common import (
    MatmulFormat,
    RootSettings,
    bmm,
    freeze,
    spectral_upper_bound,
    symmetrize,
)


def _step_map(value: float, root: int) -> float:
    """What one coupled Newton step does to an eigenvalue ``w`` of ``M``: ``w ((p+1-w)/p)^p``."""
    return value * ((root + 1 - value) / root) ** root


#: The least a scaled step may map the top of the spectrum to (the step's fixed point is 1).
#: Balancing the interval's ends exactly would map the top to the bottom's level (~1e-5 at
#: the default damping), leaving ``M`` as ill-conditioned as ``A`` for several steps; that cost
#: two decimal digits of float32 accuracy (measured: 6.5e-5 instead of 1.1e-6 against float64
#: at a condition number of 20) for one fewer iteration.
TOP_IMAGE = 0.05


@functools.lru_cache(maxsize=8)
def _top_limit(root: int) -> float:
    """The largest scaled eigenvalue ``w`` in ``[1, p+1]`` whose image is at least :data:`TOP_IMAGE`."""
    low, high = 1.0, root + 1.0
    for _ in range(60):
        middle = 0.5 * (low + high)
        if _step_map(middle, root) >= TOP_IMAGE:
            low = middle
        else:
            high = middle
    return low


@functools.lru_cache(maxsize=256)
def _scaling_schedule(lower: float, upper: float, iterations: int, root: int = 2) -> tuple[float, ...]:
    """Per-iteration scalings ``c_k`` of ``M`` for a spectrum inside ``[lower, upper]``.

    Scaling ``M`` by ``c`` and ``X`` by ``c^(1/p)`` keeps ``M = X^p A``, so the fixed point
    is still ``X = A^(-1/p)``. Each ``c_k`` balances the step's images of the interval ends,
    ``f(c l) = f(c u)``, as far as the top's image stays at least :data:`TOP_IMAGE`; that
    multiplies small eigenvalues by up to 6.1 per step for p = 2 and 8.9 for p = 4 instead
    of ``((p+1)/p)^p`` = 2.25 and 2.44 (a scaled Newton in the spirit of Chen and Chow).
    Once the interval is within [0.5, 1] the plain steps finish quadratically.
    """
    schedule = []
    low, high = lower, upper
    for _ in range(iterations):
        if low >= 0.5 and high <= 1.0:
            schedule.append(1.0)
            low, high = _step_map(low, root), 1.0
            continue
        left, right = 1.0 / high, _top_limit(root) / high
        for _ in range(60):
            middle = 0.5 * (left + right)
            if _step_map(middle * low, root) < _step_map(middle * high, root):
                left = middle
            else:
                right = middle
        scale = 0.5 * (left + right)
        schedule.append(scale)
        low, high = _step_map(scale * low, root), 1.0
    return tuple(schedule)


def _converged_lower(lower: float, upper: float, iterations: int, root: int) -> float:
    """Lower end of the interval after running the schedule designed for ``[lower, upper]``."""
    low = lower
    for scale in _scaling_schedule(lower, upper, iterations, root):
        low = _step_map(min(scale * low, 1.0), root)
    return low


@functools.lru_cache(maxsize=256)
def _design_lower(upper: float, iterations: int, floor: float, root: int = 2) -> float:
    """The smallest eigenvalue (not below ``floor``) that ``iterations`` scaled steps
    bring to convergence; designing for smaller ones would leave every block unconverged."""
    target = 1.0 - 1e-6
    if _converged_lower(floor, upper, iterations, root) >= target:
        return floor
    low, high = math.log(floor), 0.0
    for _ in range(60):
        middle = 0.5 * (low + high)
        if _converged_lower(math.exp(middle), upper, iterations, root) >= target:
            high = middle
        else:
            low = middle
    return math.exp(high)


#: The most iterations the planner will choose.
MAX_PLANNED_ITERATIONS = 40


@functools.lru_cache(maxsize=256)
def planned_scaled_iterations(lower: float, upper: float, root: int = 2) -> int:
    """Fewest scaled steps that take every eigenvalue in ``[lower, upper]`` to within 1e-6
    of 1, plus one of margin for roundoff: the last iteration tests the converged ``M`` and
    updates ``X`` only where it has not converged, which costs one matmul."""
    for iterations in range(1, MAX_PLANNED_ITERATIONS):
        if _converged_lower(lower, upper, iterations, root) >= 1.0 - 1e-6:
            return iterations + 1
    return MAX_PLANNED_ITERATIONS


@functools.lru_cache(maxsize=256)
def planned_coupled_newton_iterations(lower: float, root: int, tolerance: float) -> int:
    """Fewest coupled Newton steps that bring the product of the smallest eigenvalue
    ``lower`` within ``tolerance`` of 1 (larger ones converge first), plus one."""
    value = lower
    for iterations in range(1, MAX_PLANNED_ITERATIONS):
        value = _step_map(value, root)
        if abs(1.0 - value) <= tolerance:
            return iterations + 1
    return MAX_PLANNED_ITERATIONS


def _largest_magnitude(matrices: Tensor) -> Tensor:
    """Per-block ``max|x|``: the infinity norm (one read), except on the CPU, where ``amax``
    and ``amin`` are vectorised passes and the infinity norm is ~15x slower than both."""
    if matrices.device.type == "cpu":
        return torch.maximum(matrices.amax(dim=(1, 2)), matrices.amin(dim=(1, 2)).neg())
    return torch.linalg.vector_norm(matrices, ord=math.inf, dim=(1, 2))


def _residual(product: Tensor, scale: float, owned: bool) -> Tensor:
    """Per-block ``max|scale * product - I|``, reading ``product`` once.

    The diagonal is shifted by ``-1 / scale`` for the reduction and then restored exactly
    from a copy, so ``product`` is left as it was; it is copied first unless the solver
    ``owned`` it.
    """
    work = product if owned else product.clone()
    diagonal = work.diagonal(dim1=1, dim2=2)
    saved = diagonal.clone()
    diagonal.sub_(1.0 / scale)
    distance = _largest_magnitude(work)
    diagonal.copy_(saved)
    return distance if scale == 1.0 else scale * distance


def _coupled_iteration(
    matrices: Tensor, root: int, schedule: tuple[float, ...], tolerance: float, dtype: MatmulFormat
) -> tuple[Tensor, Tensor]:
    """``len(schedule)`` coupled Newton steps with scalings ``schedule``; returns
    ``(A^(-1/p), residual)``, the residual ``max|I - c M|`` of the last ``M`` tested.

    ``N = c^(1/p) ((p+1) I - c M) / p`` is built as ``beta M + alpha I`` with per-block
    coefficients; a converged block gets ``alpha = 1, beta = 0``, i.e. ``N = I``, which
    float32 and float64 matmuls reproduce exactly (``X I = X``), so it stays frozen without a
    ``torch.where`` on the iterates (bfloat16 or float16 matmuls round it to that dtype once,
    below their convergence tolerance). ``X = I`` needs no matmul in the first step, and
    ``M`` none in the last.
    """
    n = matrices.shape[0]
    ones = matrices.new_ones(n, 1, 1)
    zeros = torch.zeros_like(ones)
    active = torch.ones(n, dtype=torch.bool, device=matrices.device)
    residual = torch.full((n,), math.inf, dtype=matrices.dtype, device=matrices.device)
    inverse_root, product = matrices, matrices
    for index, scale in enumerate(schedule):
        block_residual = _residual(product, scale, owned=index > 0)
        residual = torch.where(active, block_residual, residual)
        active = active & (block_residual > tolerance)
        root_scale = scale ** (1.0 / root)
        alpha = freeze(active, ones * ((root + 1) * root_scale / root), ones)
        beta = freeze(active, ones * (-scale * root_scale / root), zeros)
        step = product * beta
        step.diagonal(dim1=1, dim2=2).add_(alpha[:, :, 0])
        inverse_root = step if index == 0 else bmm(inverse_root, step, dtype)
        if index + 1 < len(schedule):
            power = step
            for _ in range(int(math.log2(root))):
                power = bmm(power, power, dtype)
            product = bmm(power, product, dtype)
    return symmetrize(inverse_root), residual


def newton_db(matrices: Tensor, settings: RootSettings, floor: float) -> tuple[Tensor, Tensor]:
    """``A^(-1/p)`` for p in {2, 4} by one scaled coupled Newton iteration (for p = 2 the
    scaled Newton-Schulz iteration) whose scalings are planned on the host from the spectrum
    bounds ``[floor, upper]``; ``iterations=None`` runs as many as that interval needs."""
    root, tolerance, dtype = settings.root_order, settings.resolved_tolerance(), settings.matmul_format
    upper = spectral_upper_bound(settings.scaling)
    iterations = settings.iterations or planned_scaled_iterations(floor, upper, root)
    lower = _design_lower(upper, iterations, floor, root)
    return _coupled_iteration(matrices, root, _scaling_schedule(lower, upper, iterations, root), tolerance, dtype)


def coupled_newton(matrices: Tensor, settings: RootSettings, floor: float) -> tuple[Tensor, Tensor]:
    """Guo-Higham coupled iteration ``X <- X N, M <- N^p M, N = ((p+1) I - M) / p``, unscaled.

    Converges to ``A^(-1/p)`` for every eigenvalue of the scaled input in (0, p+1);
    without a set number of iterations, runs as many as an eigenvalue at ``floor`` needs.
    """
    root, tolerance = settings.root_order, settings.resolved_tolerance()
    iterations = settings.iterations or planned_coupled_newton_iterations(floor, root, tolerance)
    return _coupled_iteration(matrices, root, (1.0,) * iterations, tolerance, settings.matmul_format)
