"""Newton-type inverse roots: the coupled Newton iteration (Guo and Higham) and the
coupled Newton-Schulz (product Denman-Beavers) iteration with host-planned scalings.

Both run a fixed number of batched iterations with a per-block convergence mask
(converged blocks are frozen with ``torch.where``, so no iteration waits on the host).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from lightning_dash.optim.root_common import (
    RootSettings,
    bmm,
    freeze,
    identity_like,
    spectral_upper_bound,
    symmetrize,
)


def _newton_schulz_map(value: float) -> float:
    """What one Newton-Schulz step does to an eigenvalue ``w`` of ``Z Y``."""
    return value * (3.0 - value) ** 2 / 4.0


@functools.lru_cache(maxsize=256)
def _scaling_schedule(lower: float, upper: float, iterations: int) -> tuple[float, ...]:
    """Per-iteration scalings ``c_k`` of ``Z Y`` for a spectrum inside ``[lower, upper]``.

    Scaling ``Y`` and ``Z`` together keeps ``Y = A Z``, so the fixed point is still
    ``Z = A^(-1/2)``. Each ``c_k`` balances the step's images of the interval ends,
    ``f(c l) = f(c u)``, which multiplies small eigenvalues by up to ~6.75 per step
    instead of 2.25 (a scaled Newton-Schulz in the spirit of Chen and Chow); once the
    interval is within [0.5, 1] the plain steps finish quadratically.
    """
    schedule = []
    low, high = lower, upper
    for _ in range(iterations):
        if low >= 0.5 and high <= 1.0:
            schedule.append(1.0)
            low, high = _newton_schulz_map(low), 1.0
            continue
        left, right = 1.0 / high, 3.0 / high
        for _ in range(60):
            middle = 0.5 * (left + right)
            if _newton_schulz_map(middle * low) < _newton_schulz_map(middle * high):
                left = middle
            else:
                right = middle
        scale = 0.5 * (left + right)
        schedule.append(scale)
        low, high = _newton_schulz_map(scale * low), 1.0
    return tuple(schedule)


def _converged_lower(lower: float, upper: float, iterations: int) -> float:
    """Lower end of the interval after running the schedule designed for ``[lower, upper]``."""
    low = lower
    for scale in _scaling_schedule(lower, upper, iterations):
        low = _newton_schulz_map(min(scale * low, 1.0))
    return low


@functools.lru_cache(maxsize=256)
def _design_lower(upper: float, iterations: int, floor: float) -> float:
    """The smallest eigenvalue (not below ``floor``) that ``iterations`` scaled steps
    bring to convergence; designing for smaller ones would leave every block unconverged."""
    target = 1.0 - 1e-6
    if _converged_lower(floor, upper, iterations) >= target:
        return floor
    low, high = math.log(floor), 0.0
    for _ in range(60):
        middle = 0.5 * (low + high)
        if _converged_lower(math.exp(middle), upper, iterations) >= target:
            high = middle
        else:
            low = middle
    return math.exp(high)


#: The most iterations the planner will choose.
MAX_PLANNED_ITERATIONS = 40


@functools.lru_cache(maxsize=256)
def planned_newton_schulz_iterations(lower: float, upper: float) -> int:
    """Fewest scaled Newton-Schulz steps that take every eigenvalue in ``[lower, upper]``
    to within 1e-6 of 1, plus one step of margin for matmul roundoff."""
    for iterations in range(1, MAX_PLANNED_ITERATIONS):
        if _converged_lower(lower, upper, iterations) >= 1.0 - 1e-6:
            return iterations + 1
    return MAX_PLANNED_ITERATIONS


@functools.lru_cache(maxsize=256)
def planned_coupled_newton_iterations(lower: float, root: int, tolerance: float) -> int:
    """Fewest coupled Newton steps that bring the product of the smallest eigenvalue
    ``lower`` within ``tolerance`` of 1 (larger ones converge first), plus one."""
    value = lower
    for iterations in range(1, MAX_PLANNED_ITERATIONS):
        value = value * ((root + 1 - value) / root) ** root
        if abs(1.0 - value) <= tolerance:
            return iterations + 1
    return MAX_PLANNED_ITERATIONS


def _newton_schulz_inverse_sqrt(
    matrices: Tensor, iterations: int | None, tolerance: float, dtype: torch.dtype, floor: float, upper: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Scaled coupled Newton-Schulz iteration; returns ``(A^(1/2), A^(-1/2), residual)``.

    The spectrum of every block must lie in ``[floor, upper]`` with ``upper < 3``; the
    per-step scalings come from these host-side bounds, so nothing waits on the device.
    ``iterations=None`` runs as many as that interval needs.
    """
    identity = identity_like(matrices)
    sqrt, inv_sqrt = matrices, identity.clone()
    active = torch.ones(matrices.shape[0], dtype=torch.bool, device=matrices.device)
    residual = torch.full((matrices.shape[0],), math.inf, device=matrices.device)
    if iterations is None:
        iterations = planned_newton_schulz_iterations(floor, upper)
    lower = _design_lower(upper, iterations, floor)
    for scale in _scaling_schedule(lower, upper, iterations):
        if scale != 1.0:
            root_scale = math.sqrt(scale)
            sqrt, inv_sqrt = sqrt * root_scale, inv_sqrt * root_scale
        product = bmm(inv_sqrt, sqrt, dtype)
        block_residual = (product - identity).abs().amax(dim=(1, 2))
        residual = torch.where(active, block_residual, residual)
        active = active & (block_residual > tolerance)
        correction = 1.5 * identity - 0.5 * product
        sqrt = freeze(active, bmm(sqrt, correction, dtype), sqrt)
        inv_sqrt = freeze(active, bmm(correction, inv_sqrt, dtype), inv_sqrt)
    return symmetrize(sqrt), symmetrize(inv_sqrt), residual


def newton_db(matrices: Tensor, root: int, settings: RootSettings, floor: float) -> tuple[Tensor, Tensor]:
    """``A^(-1/2)`` by scaled Newton-Schulz; ``A^(-1/4)`` by a second pass on ``A^(1/2)``,
    whose spectrum lies in ``[sqrt(floor), sqrt(upper)]``. ``floor`` bounds the scaled
    spectrum from below."""
    tolerance, dtype = settings.resolved_tolerance(), settings.matmul_dtype
    upper = spectral_upper_bound(settings.scaling)
    sqrt, inv_sqrt, residual = _newton_schulz_inverse_sqrt(
        matrices, settings.iterations, tolerance, dtype, floor, upper
    )
    if root == 2:
        return inv_sqrt, residual
    _, inv_fourth, residual_second = _newton_schulz_inverse_sqrt(
        sqrt, settings.iterations, tolerance, dtype, math.sqrt(floor), math.sqrt(upper)
    )
    return inv_fourth, torch.maximum(residual, residual_second)


def coupled_newton(matrices: Tensor, root: int, settings: RootSettings, floor: float) -> tuple[Tensor, Tensor]:
    """Guo-Higham coupled iteration ``X <- X N, M <- N^p M, N = ((p+1) I - M) / p``.

    Converges to ``A^(-1/p)`` for every eigenvalue of the scaled input in (0, p+1);
    without a set number of iterations, runs as many as an eigenvalue at ``floor`` needs.
    """
    dtype, tolerance = settings.matmul_dtype, settings.resolved_tolerance()
    iterations = settings.iterations or planned_coupled_newton_iterations(floor, root, tolerance)
    identity = identity_like(matrices)
    inverse_root, product = identity.clone(), matrices
    active = torch.ones(matrices.shape[0], dtype=torch.bool, device=matrices.device)
    residual = torch.full((matrices.shape[0],), math.inf, device=matrices.device)
    for _ in range(iterations):
        block_residual = (product - identity).abs().amax(dim=(1, 2))
        residual = torch.where(active, block_residual, residual)
        active = active & (block_residual > tolerance)
        step = ((root + 1) * identity - product) / root
        power = step
        for _ in range(int(math.log2(root))):
            power = bmm(power, power, dtype)
        inverse_root = freeze(active, bmm(inverse_root, step, dtype), inverse_root)
        product = freeze(active, bmm(power, product, dtype), product)
    return symmetrize(inverse_root), residual
