"""Kronecker factor statistics that stay finite for any finite gradient.

Shampoo's factors accumulate ``L <- b2 L + (1 - b2) G G^T`` and
``R <- b2 R + (1 - b2) G^T G``. In float32, ``G G^T`` overflows once gradient
entries pass ~1e19 and underflows below ~1e-19, and one overflowed factor poisons
every later step. Each block therefore keeps its factors divided by a float64 scale
``s`` (``L = s * L_hat``), the running average of the squared largest gradient entry.
Gradients are divided by their largest entry before they are squared, so every
stored entry stays within ``[-b, b]`` for a block of side ``b``, and ``s`` (float64)
spans any finite float32 gradient squared. Both factors share ``s``: ``G G^T`` and
``G^T G`` have the same trace.

Pure functions on stacks ``(n, rows, cols)``; decays may be Python floats or per-block
tensors. A decay of 1 accumulates AdaGrad-style sums instead of an average.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dash.optim import precision

Decay = float | Tensor


def _weights(decay: Decay) -> tuple[Decay, Decay]:
    """``(keep, add)`` weights of the old statistics and the new term, in float64."""
    if isinstance(decay, Tensor):
        keep = decay.double().reshape(-1)
        return keep, torch.where(keep < 1.0, 1.0 - keep, torch.ones_like(keep))
    return float(decay), (1.0 - decay if decay < 1.0 else 1.0)


def accumulate_factors(
    left: Tensor, right: Tensor, scale: Tensor, grad: Tensor, decay: Decay, matmul_precision: str = "float32"
) -> tuple[Tensor, Tensor, Tensor]:
    """New ``(left, right, scale)`` after one gradient stack (inputs are not modified).

    ``left`` and ``right`` are the stored factors (``L / s`` and ``R / s``), ``scale``
    the ``(n,)`` float64 ``s``, ``grad`` the blocks' gradients in the factors' dtype;
    ``matmul_precision``: how the products ``G G^T`` and ``G^T G`` run (:mod:`..precision`).
    Entry by entry, the new factors' upper triangles depend only on the old ones' upper
    triangles, so ``left`` and ``right`` may hold anything below their diagonals (packed
    statistics pass their rows as they are, :mod:`...stacks.packed`).
    """
    dtype = left.dtype
    peak = torch.linalg.vector_norm(grad, ord=math.inf, dim=(1, 2))
    unit = grad / torch.where(peak > 0, peak, torch.ones_like(peak))[:, None, None]
    keep, add = _weights(decay)
    squared = peak.double().square()
    new_scale = keep * scale + add * squared
    safe = torch.where(new_scale > 0, new_scale, torch.ones_like(new_scale))
    old_weight = (keep * scale / safe).to(dtype)[:, None, None]
    new_weight = (add * squared / safe).sqrt().to(dtype)[:, None, None]
    unit.mul_(new_weight)
    left_next = precision.baddbmm(left * old_weight, unit, unit.transpose(1, 2), matmul_precision)
    right_next = precision.baddbmm(right * old_weight, unit.transpose(1, 2), unit, matmul_precision)
    return left_next, right_next, new_scale
