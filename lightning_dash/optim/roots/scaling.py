"""Spectral scaling of stacked symmetric positive semi-definite matrices.

Newton-type inverse-root iterations converge only when the spectrum of their
input lies in a bounded interval, so every stack is divided by a per-block scale
``s`` close to (and ideally not below) its largest eigenvalue first.

All functions are pure, batched over a leading block dimension ``(n, b, b)`` and
free of host synchronisation.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Scales whose estimate may fall below the largest eigenvalue are inflated by
#: this factor. The Newton solvers tolerate eigenvalues up to 3x (Newton-Schulz)
#: and 5x (coupled Newton, p=4) of the scale, so 1.1 trades a little convergence
#: speed on the small eigenvalues for a wide safety margin.
POWER_ITERATION_SAFETY = 1.1

_start_vectors: dict[tuple[str, int, int], Tensor] = {}


def frobenius_scale(matrices: Tensor) -> Tensor:
    """Per-block Frobenius norm: an upper bound of the largest eigenvalue of a PSD block."""
    scale = torch.linalg.matrix_norm(matrices, ord="fro")
    return scale.clamp_min(torch.finfo(matrices.dtype).tiny)


def _power_iteration_start(device: torch.device, size: int, num_vectors: int) -> Tensor:
    """Fixed pseudo-random start vectors, drawn from a private generator.

    The result never depends on the global random state, so a resumed run
    recomputes exactly the same roots as an uninterrupted one.
    """
    key = (str(device), size, num_vectors)
    vectors = _start_vectors.get(key)
    if vectors is None:
        generator = torch.Generator(device="cpu").manual_seed(0x5EED)
        vectors = torch.randn(size, num_vectors, generator=generator, dtype=torch.float32)
        vectors = torch.nn.functional.normalize(vectors, dim=0).to(device)
        _start_vectors[key] = vectors
    return vectors


def power_iteration_scale(matrices: Tensor, num_vectors: int = 8, iterations: int = 10) -> Tensor:
    """Estimate each block's largest eigenvalue by multi-vector power iteration.

    ``num_vectors`` start vectors are iterated together; the largest Rayleigh
    quotient (never above the true largest eigenvalue) is combined with the mean
    eigenvalue ``trace / b`` as a floor, then inflated by
    :data:`POWER_ITERATION_SAFETY`.
    """
    n, size, _ = matrices.shape
    work = matrices.float()
    vectors = _power_iteration_start(work.device, size, min(num_vectors, size))
    vectors = vectors.expand(n, -1, -1)
    for _ in range(iterations):
        vectors = torch.nn.functional.normalize(torch.bmm(work, vectors), dim=1)
    rayleigh = (vectors * torch.bmm(work, vectors)).sum(dim=1).amax(dim=1)
    mean_eigenvalue = work.diagonal(dim1=1, dim2=2).sum(dim=1) / size
    estimate = torch.maximum(rayleigh, mean_eigenvalue) * POWER_ITERATION_SAFETY
    return estimate.clamp_min(torch.finfo(torch.float32).tiny)


def spectral_scale(matrices: Tensor, method: str) -> Tensor:
    """Dispatch to the scaling named by ``method`` ("frobenius" or "power_iteration")."""
    if method == "frobenius":
        return frobenius_scale(matrices)
    if method == "power_iteration":
        return power_iteration_scale(matrices)
    raise ValueError(f"matrix_scaling must be 'frobenius' or 'power_iteration', got {method!r}")
