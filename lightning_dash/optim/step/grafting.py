"""Grafting rules: the first-order optimizer whose step size DASH borrows.

DASH takes the direction of Shampoo and, per block, the Frobenius norm of a
simple diagonal optimizer's direction ("grafting"), so learning-rate schedules
tuned for that optimizer keep working. The same rules drive one-dimensional
parameters, which are not preconditioned at all.

Every function is pure elementwise arithmetic on tensors of any shape;
hyperparameters may be Python numbers or tensors that broadcast per block.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Scalar = float | Tensor

GRAFTING_TYPES = ("adam", "adagrad", "rmsprop", "sgd", "none")
#: The norms in which the Shampoo direction matches the grafting direction (:data:`GRAFTS`).
GRAFTING_NORMS = ("frobenius", "spectral")
#: Power iterations of the spectral grafting norm's estimate.
SPECTRAL_ITERATIONS = 8


def uses_second_moment(kind: str) -> bool:
    """Whether ``kind`` keeps a per-element second-moment accumulator.

    ``"none"`` keeps one too: it drives one-dimensional parameters and blocks
    without a valid root, which fall back to Adam.
    """
    return kind != "sgd"


def next_rms(rms: Tensor, grad: Tensor, kind: str, beta2: Scalar) -> Tensor:
    """The next root of the second moment (a new tensor), without ever squaring ``grad``.

    The grafting optimizers accumulate ``v <- b2 v + (1 - b2) g^2`` (an EMA) or
    ``v <- v + g^2`` (AdaGrad). The state holds ``r = sqrt(v)``, updated as
    ``hypot(sqrt(b2) r, sqrt(1 - b2) |g|)``: ``g^2`` overflows float32 from
    ``|g| ~ 2e19``, ``r`` stays finite for every finite gradient (the EMA is never
    above ``max(r, |g|)``).
    """
    if kind == "adagrad":
        return torch.hypot(rms, grad)
    keep = beta2.sqrt() if isinstance(beta2, Tensor) else math.sqrt(beta2)
    add = (1.0 - beta2).sqrt() if isinstance(beta2, Tensor) else math.sqrt(1.0 - beta2)
    return torch.hypot(rms * keep, grad * add)


def grafting_direction(
    momentum: Tensor,
    rms: Tensor | None,
    kind: str,
    epsilon: Scalar,
    second_moment_correction: Scalar,
) -> Tensor:
    """The grafting optimizer's direction for a (bias-corrected) momentum.

    Args:
        momentum: the momentum the step follows, already bias-corrected.
        rms: the root of the second moment (see :func:`update_rms`; unused for ``"sgd"``).
        kind: one of :data:`GRAFTING_TYPES`; ``"none"`` behaves as Adam here.
        epsilon: added to the root of the second moment.
        second_moment_correction: Adam's ``1 - beta2**t`` (1 disables it).

    Adam's ``m / (r / sqrt(c) + eps)`` is evaluated as ``m sqrt(c) / (r + eps sqrt(c))``,
    which cannot overflow for a large ``r``.
    """
    if kind == "sgd":
        return momentum
    if kind in ("adagrad", "rmsprop"):
        return momentum / (rms + epsilon)
    root = (
        second_moment_correction.sqrt()
        if isinstance(second_moment_correction, Tensor)
        else math.sqrt(second_moment_correction)
    )
    return (momentum * root) / (rms + epsilon * root)


def block_norm(blocks: Tensor) -> Tensor:
    """Frobenius norm of each block (leading dimension) in float64, shaped to broadcast
    over it: one pass, and no overflow for float32 entries of any finite magnitude nor
    underflow below ~1e-19 (float64 squares them exactly enough)."""
    dims = tuple(range(1, blocks.dim()))
    return torch.linalg.vector_norm(blocks, dim=dims, keepdim=True, dtype=torch.float64)


def graft_norm(direction: Tensor, reference: Tensor) -> Tensor:
    """Rescale each block of ``direction`` to the Frobenius norm of ``reference``.

    Blocks are indexed by the leading dimension. A zero ``direction`` stays zero. The
    ratio of the norms is applied as its square root, twice: with ``root_order=2`` the raw
    direction scales like the inverse of the gradients (1e30 at gradients of 1e-30), and the
    ratio itself (1e-52 there) would underflow the direction's dtype, while its square root
    stays in range wherever both norms are.
    """
    return _rescale(direction, block_norm(direction), block_norm(reference))


def _rescale(direction: Tensor, current: Tensor, target: Tensor) -> Tensor:
    """``direction`` times ``target / current`` per block (0 where ``current`` is 0), the ratio
    applied as its square root twice (see :func:`graft_norm`)."""
    ratio = torch.where(current > 0, target / current, 0.0)
    half = ratio.sqrt().clamp_max(torch.finfo(direction.dtype).max).to(direction.dtype)
    return (direction * half).mul_(half)  # the second factor in place: one allocation, as before


def spectral_norm(blocks: Tensor, iterations: int = SPECTRAL_ITERATIONS) -> Tensor:
    """An estimate of each block's largest singular value, shaped ``(n, 1, 1)`` (float64).

    ``iterations`` steps of power iteration on ``B^T B`` from one fixed start vector ``v``, so that
    every process computes the same value, then ``||B v||``: never above the largest singular value,
    and exact when the top singular values are equal. The products are multiply-and-sum reductions
    (several times faster than a batched matmul with one column on a CPU) and both vectors are
    normalised after each product, their norms taken in float64: no overflow or underflow for float32
    entries of any finite magnitude, and no pass that copies the blocks.
    """
    # golden-angle phases: a fixed vector of mixed signs that no weight matrix's structure shares
    start = torch.arange(1, blocks.shape[-1] + 1, device=blocks.device, dtype=blocks.dtype).mul_(2.399963).sin_()
    right = start.expand(blocks.shape[0], -1)
    for _ in range(iterations):
        left = _unit(torch.linalg.vecdot(blocks, right.unsqueeze(1), dim=-1))  # B v: (n, rows)
        right = _unit(torch.linalg.vecdot(blocks, left.unsqueeze(2), dim=-2))  # B^T B v: (n, cols)
    image = torch.linalg.vecdot(blocks, right.unsqueeze(1), dim=-1)
    return torch.linalg.vector_norm(image, dim=1, dtype=torch.float64).view(-1, 1, 1)


def _unit(vectors: Tensor) -> Tensor:
    """Each row divided by its norm (taken in float64); a zero row stays zero."""
    norm = torch.linalg.vector_norm(vectors, dim=1, keepdim=True, dtype=torch.float64)
    return (vectors / torch.where(norm > 0, norm, 1.0)).to(vectors.dtype)


def graft_spectral(direction: Tensor, reference: Tensor) -> Tensor:
    """Rescale each block of ``direction`` to the largest singular value of ``reference``'s block.

    A whitened direction spreads its norm evenly over its singular values, where a diagonal
    optimizer's concentrates in a few. At an equal spectral norm (the most a unit input's output can
    move) the whitened step is the larger in Frobenius norm, by the square root of the ratio of the
    two stable ranks. A zero ``direction`` stays zero.
    """
    return _rescale(direction, spectral_norm(direction), spectral_norm(reference.to(direction.dtype)))


#: The grafting rule of each :data:`GRAFTING_NORMS` entry.
GRAFTS = {"frobenius": graft_norm, "spectral": graft_spectral}
