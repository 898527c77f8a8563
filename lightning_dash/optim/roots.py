"""Batched inverse p-th roots of stacked symmetric positive semi-definite matrices.

Every solver computes ``(s S + d I)^(-1/p)`` for a stack ``S`` of shape ``(n, b, b)``
stored divided by a per-block scale ``s`` and damped by ``d`` (absolute, or relative
to the block's Frobenius norm), and returns the roots in float32 (float64 for float64
statistics) together with a per-block residual where one is available for free. Each
block is divided by its own magnitude before any solver sees it, so the roots do not
depend on the gradients' scale.

* ``eigh``: eigendecomposition; reference quality; retries failed blocks in float64.
* ``coupled_newton``: the coupled Newton iteration of Guo and Higham for p in {2, 4}.
* ``newton_db``: the coupled Newton-Schulz (product Denman-Beavers) iteration for
  ``A^(-1/2)``, with per-step scalings planned on the host from the known spectral
  bounds (small eigenvalues grow up to ~6.75x per step instead of 2.25x);
  ``A^(-1/4)`` takes a second pass on the square root.
* ``chebyshev``: a Chebyshev interpolant of ``x^(-1/p)`` evaluated with Clenshaw's
  recurrence.

The Newton solvers damp each block by at least :data:`NOISE_FLOOR_UNITS` units of
roundoff of the matmul dtype relative to its scale (the effective epsilon is
``max(eps, 8 u s)``), which keeps rank-deficient statistics from diverging. They run
a fixed number of batched iterations with a per-block convergence test implemented
as a mask: converged blocks are frozen with
``torch.where``, so no iteration waits on the host. Matmuls may run in bfloat16 or
float16; iterates are kept and accumulated in float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

from lightning_dash.optim.scaling import spectral_scale

INVERSE_ROOT_METHODS = ("eigh", "coupled_newton", "newton_db", "chebyshev")
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Unit roundoff of each matmul dtype.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

#: The Newton solvers lift every eigenvalue of the scaled input to at least this many
#: units of roundoff of the matmul dtype. Each iteration perturbs near-null directions
#: by about one unit of roundoff and then amplifies them ~2.25x; without the lift a
#: rank-deficient factor drifts negative and diverges (seen in float32 at 20
#: iterations, in bfloat16 and float16 at 10). Four units already sufficed in tests.
NOISE_FLOOR_UNITS = 8.0

#: Residual ``max|I - product|`` under which a block counts as converged, per matmul dtype.
#: Each is a few units of roundoff of that dtype times the growth seen in practice.
DEFAULT_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@dataclass(frozen=True)
class RootResult:
    """Roots of a stack and, for the Newton solvers, the last per-block residual."""

    root: Tensor
    residual: Optional[Tensor]


@dataclass(frozen=True)
class RootSettings:
    """How inverse roots are computed; shared by every stack of one optimizer."""

    method: str = "newton_db"
    scaling: str = "power_iteration"
    matmul_dtype: torch.dtype = torch.float32
    iterations: Optional[int] = None
    chebyshev_degree: int = 40
    tolerance: Optional[float] = None
    relative_epsilon: bool = False

    def resolved_tolerance(self) -> float:
        return DEFAULT_TOLERANCE[self.matmul_dtype] if self.tolerance is None else self.tolerance


#: Largest relative error of any eigenvalue of a Newton root that is still accepted.
MAX_ROOT_ERROR = 0.1


def failure_residual(settings: RootSettings) -> float:
    """Residual above which a Newton root counts as failed.

    Both Newton solvers report ``max|I - P|`` for a product ``P`` whose eigenvalues
    ``w`` tend to 1, and the root's eigenvalues are off by the factor ``w^(1/q)``:
    ``q = 2`` for Newton-DB (each pass is an inverse square root), ``q = 4`` for the
    coupled Newton iteration of ``A^(-1/4)``. A residual ``r`` thus allows an error of
    ``1 - (1 - r)^(1/q)``; the threshold ``1 - (1 - MAX_ROOT_ERROR)^q`` (0.19 and 0.34)
    accepts at most :data:`MAX_ROOT_ERROR`. It is never below four times the
    convergence tolerance of the matmul dtype, the residual roundoff alone leaves.
    """
    order = 2 if settings.method == "newton_db" else 4
    theory = 1.0 - (1.0 - MAX_ROOT_ERROR) ** order
    return max(theory, 4.0 * DEFAULT_TOLERANCE[settings.matmul_dtype])


def noise_floor(dtype: torch.dtype) -> float:
    """Smallest relative eigenvalue the Newton solvers work with in ``dtype`` (``8 u``)."""
    return NOISE_FLOOR_UNITS * UNIT_ROUNDOFF[dtype]


def spectral_upper_bound(scaling: str) -> float:
    """Largest eigenvalue of ``A / s`` to plan for: 1 for the Frobenius bound; 1.5 for
    power iteration, whose estimate may fall somewhat below the true largest eigenvalue."""
    return 1.0 if scaling == "frobenius" else 1.5


def _identity_like(matrices: Tensor) -> Tensor:
    n, size, _ = matrices.shape
    return torch.eye(size, dtype=matrices.dtype, device=matrices.device).expand(n, size, size)


def _bmm(left: Tensor, right: Tensor, dtype: torch.dtype) -> Tensor:
    """Batched matmul with operands in ``dtype`` (or in the operands' own dtype when that
    is wider, as for float64 stacks) and a result in the operands' dtype."""
    if dtype == left.dtype or left.dtype == torch.float64:
        return torch.bmm(left, right)
    return torch.bmm(left.to(dtype), right.to(dtype)).to(left.dtype)


def _symmetrize(matrices: Tensor) -> Tensor:
    return 0.5 * (matrices + matrices.transpose(1, 2))


def _add_diagonal(matrices: Tensor, values: Tensor) -> Tensor:
    out = matrices.clone()
    out.diagonal(dim1=1, dim2=2).add_(values.unsqueeze(1))
    return out


def _freeze(active: Tensor, new: Tensor, old: Tensor) -> Tensor:
    return torch.where(active[:, None, None], new, old)


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
    matrices: Tensor, iterations: Optional[int], tolerance: float, dtype: torch.dtype, floor: float, upper: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Scaled coupled Newton-Schulz iteration; returns ``(A^(1/2), A^(-1/2), residual)``.

    The spectrum of every block must lie in ``[floor, upper]`` with ``upper < 3``; the
    per-step scalings come from these host-side bounds, so nothing waits on the device.
    ``iterations=None`` runs as many as that interval needs.
    """
    identity = _identity_like(matrices)
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
        product = _bmm(inv_sqrt, sqrt, dtype)
        block_residual = (product - identity).abs().amax(dim=(1, 2))
        residual = torch.where(active, block_residual, residual)
        active = active & (block_residual > tolerance)
        correction = 1.5 * identity - 0.5 * product
        sqrt = _freeze(active, _bmm(sqrt, correction, dtype), sqrt)
        inv_sqrt = _freeze(active, _bmm(correction, inv_sqrt, dtype), inv_sqrt)
    return _symmetrize(sqrt), _symmetrize(inv_sqrt), residual


def _newton_db(matrices: Tensor, root: int, settings: RootSettings, floor: float) -> tuple[Tensor, Tensor]:
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


def _coupled_newton(matrices: Tensor, root: int, settings: RootSettings, floor: float) -> tuple[Tensor, Tensor]:
    """Guo-Higham coupled iteration ``X <- X N, M <- N^p M, N = ((p+1) I - M) / p``.

    Converges to ``A^(-1/p)`` for every eigenvalue of the scaled input in (0, p+1);
    without a set number of iterations, runs as many as an eigenvalue at ``floor`` needs.
    """
    dtype, tolerance = settings.matmul_dtype, settings.resolved_tolerance()
    iterations = settings.iterations or planned_coupled_newton_iterations(floor, root, tolerance)
    identity = _identity_like(matrices)
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
            power = _bmm(power, power, dtype)
        inverse_root = _freeze(active, _bmm(inverse_root, step, dtype), inverse_root)
        product = _freeze(active, _bmm(power, product, dtype), product)
    return _symmetrize(inverse_root), residual


def chebyshev_floor(degree: int, tolerance: float = 1e-3) -> float:
    """Smallest relative eigenvalue for which a degree-``degree`` interpolant is accurate.

    For ``x^(-1/p)`` on ``[lo, 1]`` the interpolation error decays like
    ``exp(-2 degree sqrt(lo))``; this returns the ``lo`` where that reaches ``tolerance``.
    """
    return (math.log(1.0 / tolerance) / (2.0 * degree)) ** 2


def _chebyshev(
    matrices: Tensor, relative_eps: Tensor, root: int, settings: RootSettings
) -> Tensor:
    """Clenshaw evaluation of the Chebyshev interpolant of ``x^(-1/p)`` on ``[low, high]``.

    ``matrices`` has its spectrum in ``[relative_eps, ~1]``. ``low`` is the larger of
    ``relative_eps`` and :func:`chebyshev_floor`: eigenvalues below it are
    extrapolated, which stays bounded (about 1.5 ``low^(-1/p)``) and acts as extra
    damping; the root is accurate to the formula only where the spectrum (damping
    included) lies above the floor, i.e. for ``epsilon`` of at least about the floor
    times the scale. Extrapolating above ``high`` grows without bound, so ``high``
    covers the scale's uncertainty: 1 for the Frobenius bound, 1.5 for power iteration.
    """
    degree, dtype = settings.chebyshev_degree, settings.matmul_dtype
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

    identity = _identity_like(matrices)
    mapped = (matrices - mid.to(matrices.dtype)[:, None, None] * identity) / half.to(matrices.dtype)[:, None, None]
    following = torch.zeros_like(matrices)
    current = coefficients[:, degree, None, None] * identity
    for k in range(degree - 1, 0, -1):
        following, current = current, (
            2.0 * _bmm(mapped, current, dtype) - following + coefficients[:, k, None, None] * identity
        )
    result = _bmm(mapped, current, dtype) - following + coefficients[:, 0, None, None] * identity
    return _symmetrize(result)


#: ``eigh`` treats eigenvalues below this many units of roundoff of the statistics' dtype,
#: relative to the block's largest eigenvalue, as exactly zero (see :func:`_eigh`).
NULL_SPACE_UNITS = 16.0


def _eigh(matrices: Tensor, eps: Tensor, root: int) -> Tensor:
    """Exact roots from ``eigh``, with the near-null space of a rank-deficient block
    treated as exactly null (as a pseudo-inverse does).

    Eigenvalues below :data:`NULL_SPACE_UNITS` units of roundoff times the block's
    largest eigenvalue (about 1e-6 of it in float32) are roundoff, not statistics: a
    rank-12 factor of a 20 x 20 block has eight such eigenvalues of either sign, and
    their values differ between two runs whose gradients differ by roundoff. Set to
    zero before ``eps`` is added, they get the root of ``eps`` alone in every run, as
    the exact (float64) factor's null space would, so roundoff in the gradients is not
    amplified by ``eps^(-1/4)``.

    A stack whose decomposition raises, or blocks whose roots come out non-finite,
    are recomputed in float64; a stack whose float64 decomposition raises too comes
    back as NaN, which the optimizer rejects and counts as failed. This check reads
    one flag back to the host.
    """

    def roots_from(symmetric: Tensor, block_eps: Tensor) -> Tensor:
        eigenvalues, eigenvectors = torch.linalg.eigh(symmetric)
        noise = NULL_SPACE_UNITS * UNIT_ROUNDOFF[matrices.dtype] * eigenvalues[:, -1:].clamp_min(0.0)
        eigenvalues = torch.where(eigenvalues > noise, eigenvalues, torch.zeros_like(eigenvalues))
        scaled = (eigenvalues + block_eps[:, None]).pow(-1.0 / root)
        return (eigenvectors * scaled.unsqueeze(1)) @ eigenvectors.transpose(1, 2)

    def in_float64(symmetric: Tensor, block_eps: Tensor) -> Tensor:
        try:
            return roots_from(symmetric.double(), block_eps.double()).to(matrices.dtype)
        except RuntimeError:  # torch.linalg.LinAlgError: not even float64 converged
            return torch.full_like(symmetric, math.nan)

    symmetric = _symmetrize(matrices)
    try:
        result = roots_from(symmetric, eps)
    except RuntimeError:
        return in_float64(symmetric, eps)
    bad = ~torch.isfinite(result).all(dim=(1, 2))
    if bool(bad.any()):
        result[bad] = in_float64(symmetric[bad], eps[bad])
    return result


def _working_dtype(statistics: Tensor) -> torch.dtype:
    """float64 statistics are solved in float64; everything else in float32."""
    return torch.float64 if statistics.dtype == torch.float64 else torch.float32


def normalise(statistics: Tensor, eps: Tensor, scale: Optional[Tensor], relative: bool
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Rewrite ``scale * statistics + d I`` as ``a * (normalised + e I)`` with ``a > 0``.

    ``d`` is ``eps`` (absolute damping) or, with ``relative``, ``eps`` times the
    Frobenius norm of ``scale * statistics`` (an upper bound of its largest
    eigenvalue). The normalised block has Frobenius norm at most 1 and ``e <= 1``, so
    every solver sees the same well-scaled input whatever the gradients' scale; the
    per-block ``a`` is computed in float64 and folded back as ``a^(-1/p)``. A zero
    block without damping (no gradient yet, relative damping) becomes the identity:
    its root is never used in earnest, since its direction is zero. Returns
    ``(normalised, e, a)``.
    """
    work = _working_dtype(statistics)
    matrices = statistics.to(work)
    norm = torch.linalg.matrix_norm(matrices, ord="fro").double()
    block_scale = torch.ones_like(norm) if scale is None else scale.double()
    magnitude = block_scale * norm
    damping = eps.double() * magnitude if relative else eps.double()
    total = magnitude + damping
    empty = total <= 0
    total = torch.where(empty, torch.ones_like(total), total)
    coefficient = torch.where(norm > 0, block_scale / total, torch.zeros_like(total))
    normalised = matrices * coefficient.to(work)[:, None, None]
    identity = torch.eye(matrices.shape[-1], dtype=work, device=matrices.device)
    normalised = torch.where(empty[:, None, None], identity, normalised)
    return normalised, (damping / total).to(work), total


def spectrum_floor(settings: RootSettings, size: int, min_eps: Optional[float]) -> float:
    """A host-side lower bound of the smallest eigenvalue the Newton solvers see (after
    :func:`normalise` and the solver's scaling): the relative damping ``e`` over the
    largest possible scale, never below the matmul dtype's :func:`noise_floor`.

    With relative damping the normalised block has its largest eigenvalue at most 1 and
    its smallest at least ``e = eps / (1 + eps)``; power iteration scales by at most 1.1,
    the Frobenius norm by at most ``1 + e sqrt(b)``. Absolute damping gives no bound.
    """
    floor = noise_floor(settings.matmul_dtype)
    if not settings.relative_epsilon or min_eps is None:
        return floor
    damping = min_eps / (1.0 + min_eps)
    largest_scale = 1.1 if settings.scaling == "power_iteration" else 1.0 + damping * math.sqrt(size)
    return max(floor, damping / largest_scale)


def inverse_root(statistics: Tensor, eps: Tensor, root: int, settings: RootSettings,
                 scale: Optional[Tensor] = None, min_eps: Optional[float] = None) -> RootResult:
    """Compute ``(scale * statistics + d I)^(-1/root)`` for every block of a stack.

    Args:
        statistics: ``(n, b, b)`` symmetric PSD matrices (float32 or float64).
        eps: ``(n,)`` non-negative damping: ``d = eps`` or, with
            ``settings.relative_epsilon``, ``d = eps * ||scale * statistics||_F``.
        root: the root order p (2 or 4 for the Newton solvers; any for eigh/chebyshev).
        settings: solver, scaling and matmul precision.
        scale: ``(n,)`` positive factor each block is stored divided by (None: 1);
            kept separate so that statistics of any magnitude never overflow.
        min_eps: the smallest entry of ``eps``, known on the host. With relative
            damping it bounds the spectrum (:func:`spectrum_floor`), and Newton solvers
            without a set number of iterations run exactly as many as that needs.

    Every solver works on the block divided by its own magnitude (see
    :func:`normalise`), so the result does not depend on the gradients' scale beyond
    the damping. float64 statistics are solved in float64 (the matmul dtype does not
    apply to them).

    Returns:
        A :class:`RootResult` in the working dtype; non-finite entries signal a failed
        block and are left for the caller to reject.
    """
    if settings.method not in INVERSE_ROOT_METHODS:
        raise ValueError(
            f"inverse_root_method must be one of {INVERSE_ROOT_METHODS}, got {settings.method!r}"
        )
    matrices, eps, magnitude = normalise(statistics, eps, scale, settings.relative_epsilon)
    if matrices.dtype == torch.float64:
        settings = replace(settings, matmul_dtype=torch.float64)
    if settings.method == "eigh":
        result, residual = _eigh(matrices, eps, root), None
    else:
        matrices = _add_diagonal(matrices, eps)
        solver_scale = spectral_scale(matrices, settings.scaling)
        scaled = matrices / solver_scale[:, None, None]
        if settings.method != "chebyshev":
            scaled = _add_diagonal(scaled, (noise_floor(settings.matmul_dtype) - eps / solver_scale).clamp_min(0.0))
        floor = spectrum_floor(settings, matrices.shape[-1], min_eps)
        if settings.method == "newton_db":
            result, residual = _newton_db(scaled, root, settings, floor)
        elif settings.method == "coupled_newton":
            result, residual = _coupled_newton(scaled, root, settings, floor)
        else:
            result, residual = _chebyshev(scaled, eps / solver_scale, root, settings), None
        result = result * solver_scale.pow(-1.0 / root)[:, None, None]
    return RootResult(result * magnitude.pow(-1.0 / root).to(result.dtype)[:, None, None], residual)
