"""Batched inverse p-th roots of stacked symmetric positive semi-definite matrices.

Every solver computes ``(s S + d I)^(-1/p)`` for a stack ``S`` of shape ``(n, b, b)``
stored divided by a per-block scale ``s`` and damped by ``d`` (absolute, or relative
to the block's Frobenius norm), and returns the roots in float32 (float64 for float64
statistics) together with a per-block residual where one is available for free. Each
block is divided by its own magnitude before any solver sees it, so the roots do not
depend on the gradients' scale.

* ``eigh``: eigendecomposition (in float32 or float64, ``eigh_dtype``); reference quality.
* ``coupled_newton``: the coupled Newton iteration of Guo and Higham for p in {2, 4}.
* ``newton_db``: the same coupled iteration (for p = 2 the coupled Newton-Schulz, product
  Denman-Beavers, iteration) with per-step scalings planned on the host from the known
  spectral bounds (small eigenvalues grow up to ~6x per step for p = 2 and ~9x for p = 4
  instead of 2.25x and 2.44x); ``A^(-1/4)`` in one pass.
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

import math
from dataclasses import replace

import torch
from torch import Tensor

from lightning_dash.optim.roots.common import (
    INVERSE_ROOT_METHODS,
    RootResult,
    RootSettings,
    add_diagonal,
    noise_floor,
    working_dtype,
)
from lightning_dash.optim.roots.newton import coupled_newton, newton_db
from lightning_dash.optim.roots.scaling import spectral_scale
from lightning_dash.optim.roots.spectral import chebyshev, eigh


def normalise(statistics: Tensor, eps: Tensor, scale: Tensor | None, relative: bool) -> tuple[Tensor, Tensor, Tensor]:
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
    work = working_dtype(statistics)
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


def spectrum_floor(settings: RootSettings, size: int, min_eps: float | None) -> float:
    """A host-side lower bound of the smallest eigenvalue the Newton solvers see (after
    :func:`normalise` and the solver's scaling): the relative damping ``e`` over the
    largest possible scale, never below the matmul dtype's :func:`noise_floor`.

    With relative damping the normalised block has its largest eigenvalue at most 1 and
    its smallest at least ``e = eps / (1 + eps)``; power iteration scales by at most 1.1,
    the Frobenius norm by at most ``1 + e sqrt(b)``. Absolute damping gives no bound.
    """
    floor = noise_floor(settings.matmul_format)
    if not settings.relative_epsilon or min_eps is None:
        return floor
    damping = min_eps / (1.0 + min_eps)
    largest_scale = 1.1 if settings.scaling == "power_iteration" else 1.0 + damping * math.sqrt(size)
    return max(floor, damping / largest_scale)


def inverse_root(
    statistics: Tensor,
    eps: Tensor,
    settings: RootSettings,
    scale: Tensor | None = None,
    min_eps: float | None = None,
) -> RootResult:
    """Compute ``(scale * statistics + d I)^(-1/p)`` for every block of a stack (``p = settings.root_order``).

    Args:
        statistics: ``(n, b, b)`` symmetric PSD matrices (float32 or float64).
        eps: ``(n,)`` non-negative damping: ``d = eps`` or, with
            ``settings.relative_epsilon``, ``d = eps * ||scale * statistics||_F``.
        settings: solver, root order p (2 or 4 for the Newton solvers; any for eigh and
            chebyshev), scaling and matmul precision.
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
        raise ValueError(f"inverse_root_method must be one of {INVERSE_ROOT_METHODS}, got {settings.method!r}")
    root = settings.root_order
    matrices, eps, magnitude = normalise(statistics, eps, scale, settings.relative_epsilon)
    if matrices.dtype == torch.float64:
        settings = replace(settings, matmul_dtype=torch.float64)
    if settings.method == "eigh":
        result, residual = eigh(matrices, eps, root, settings.eigh_dtype), None
    else:
        matrices = add_diagonal(matrices, eps)
        solver_scale = spectral_scale(matrices, settings.scaling)
        scaled = matrices / solver_scale[:, None, None]
        if settings.method != "chebyshev":  # lift the spectrum to the noise floor, in place on the new ``scaled``
            lift = (noise_floor(settings.matmul_format) - eps / solver_scale).clamp_min(0.0)
            scaled.diagonal(dim1=1, dim2=2).add_(lift.unsqueeze(1))
        floor = spectrum_floor(settings, matrices.shape[-1], min_eps)
        if settings.method == "newton_db":
            result, residual = newton_db(scaled, settings, floor)
        elif settings.method == "coupled_newton":
            result, residual = coupled_newton(scaled, settings, floor)
        else:
            result, residual = chebyshev(scaled, eps / solver_scale, settings), None
        result = result * solver_scale.pow(-1.0 / root)[:, None, None]
    return RootResult(result * magnitude.pow(-1.0 / root).to(result.dtype)[:, None, None], residual)
