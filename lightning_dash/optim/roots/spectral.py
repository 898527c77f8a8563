"""Spectrum-based inverse roots: the eigendecomposition (reference quality, with a
roundoff-aware null space) and a Chebyshev interpolant evaluated by Clenshaw's recurrence."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dash.optim.roots.common import (
    UNIT_ROUNDOFF,
    RootSettings,
    bmm,
    identity_like,
    spectral_upper_bound,
    symmetrize,
)


def chebyshev_floor(degree: int, tolerance: float = 1e-3) -> float:
    """Smallest relative eigenvalue for which a degree-``degree`` interpolant is accurate.

    For ``x^(-1/p)`` on ``[lo, 1]`` the interpolation error decays like
    ``exp(-2 degree sqrt(lo))``; this returns the ``lo`` where that reaches ``tolerance``.
    """
    return (math.log(1.0 / tolerance) / (2.0 * degree)) ** 2


def chebyshev(matrices: Tensor, relative_eps: Tensor, settings: RootSettings) -> Tensor:
    """Clenshaw evaluation of the Chebyshev interpolant of ``x^(-1/p)`` on ``[low, high]``.

    ``matrices`` has its spectrum in ``[relative_eps, ~1]``. ``low`` is the larger of
    ``relative_eps`` and :func:`chebyshev_floor`: eigenvalues below it are
    extrapolated, which stays bounded (about 1.5 ``low^(-1/p)``) and acts as extra
    damping; the root is accurate to the formula only where the spectrum (damping
    included) lies above the floor, i.e. for ``epsilon`` of at least about the floor
    times the scale. Extrapolating above ``high`` grows without bound, so ``high``
    covers the scale's uncertainty: 1 for the Frobenius bound, 1.5 for power iteration.
    """
    root, degree, dtype = settings.root_order, settings.chebyshev_degree, settings.matmul_format
    low = relative_eps.double().clamp_min(chebyshev_floor(degree))
    high = spectral_upper_bound(settings.scaling)
    nodes = torch.arange(degree + 1, device=matrices.device, dtype=torch.float64)
    angles = math.pi * (nodes + 0.5) / (degree + 1)
    mid, half = (high + low) / 2, (high - low) / 2
    points = mid[:, None] + half[:, None] * torch.cos(angles)[None, :]
    values = points.pow(-1.0 / root)
    basis = torch.cos(nodes[:, None] * angles[None, :])
    coefficients = (2.0 / (degree + 1)) * values @ basis.T
    coefficients[:, 0] *= 0.5
    coefficients = coefficients.to(matrices.dtype)

    identity = identity_like(matrices)
    mapped = (matrices - mid.to(matrices.dtype)[:, None, None] * identity) / half.to(matrices.dtype)[:, None, None]
    following = torch.zeros_like(matrices)
    current = coefficients[:, degree, None, None] * identity
    for k in range(degree - 1, 0, -1):
        following, current = (
            current,
            (2.0 * bmm(mapped, current, dtype) - following + coefficients[:, k, None, None] * identity),
        )
    result = bmm(mapped, current, dtype) - following + coefficients[:, 0, None, None] * identity
    return symmetrize(result)


#: ``eigh`` treats eigenvalues below this many units of roundoff of the statistics' dtype,
#: relative to the block's largest eigenvalue, as exactly zero (see :func:`eigh`).
NULL_SPACE_UNITS = 16.0


def eigh(matrices: Tensor, eps: Tensor, root: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Exact roots from an eigendecomposition taken in ``dtype`` (float64 statistics: always
    float64), with the near-null space of a rank-deficient block treated as exactly null (as a
    pseudo-inverse does).

    Why float64 by default: a float32 decomposition turns each eigenvector by about 1e-7 of the
    largest eigenvalue over its gap to the next one. In the deep tail that a small damping lets
    through, the gaps are that small, so the tail's directions come out mixed, differently for two
    runs whose gradients differ by roundoff, and training carries the difference on (at
    ``epsilon`` 1e-5, two data-parallel ranks moved a byte-level GRU by 0.19 of its movement after
    10 steps with float32 decompositions, 0.010 with float64 ones, torch's Muon 0.043;
    ``benchmarks/numerics/roundoff.py``). Sharper eigenvalues alone do not help (Rayleigh quotients
    of float32 eigenvectors, taken in float64, left the 0.19 as it was). On a CPU a float64
    decomposition costs about 1.7x a float32 one. The root is then assembled in the statistics'
    dtype, as ``(V s^(1/2)) (V s^(1/2))^T`` (assembled in float64 it moved the same GRU by the same
    amount, at float64's cost of the product).

    Eigenvalues below :data:`NULL_SPACE_UNITS` units of roundoff of the statistics' dtype
    times the block's largest eigenvalue (about 1e-6 of it for float32 statistics) are
    roundoff of the statistics, not statistics: a rank-12 factor of a 20 x 20 block has
    eight such eigenvalues of either sign, and their values differ between two runs whose
    gradients differ by roundoff. Set to zero before ``eps`` is added, they get the root of
    ``eps`` alone in every run, as the exact factor's null space would, so roundoff in the
    gradients is not amplified by ``eps^(-1/p)``.

    A stack whose float32 decomposition raises is decomposed again in float64; one whose float64
    decomposition raises comes back as NaN. Blocks with non-finite roots are left as they are: the
    optimizer rejects and counts them on the device, and retries them at the next refresh. Nothing
    here reads a value back (on CUDA, torch's eigh itself checks its error code on the host).
    """
    symmetric = symmetrize(matrices)
    work = torch.float64 if matrices.dtype == torch.float64 else dtype
    try:
        eigenvalues, eigenvectors = torch.linalg.eigh(symmetric.to(work))
    except RuntimeError:  # torch.linalg.LinAlgError: the decomposition did not converge
        if work == torch.float64:
            return torch.full_like(matrices, math.nan)
        return eigh(matrices, eps, root, torch.float64)
    noise = NULL_SPACE_UNITS * UNIT_ROUNDOFF[matrices.dtype] * eigenvalues[:, -1:].clamp_min(0.0)
    eigenvalues = torch.where(eigenvalues > noise, eigenvalues, torch.zeros_like(eigenvalues))
    half = (eigenvalues + eps.to(work)[:, None]).pow(-0.5 / root)
    vectors = (eigenvectors * half.unsqueeze(1)).to(matrices.dtype)
    return vectors @ vectors.transpose(1, 2)
