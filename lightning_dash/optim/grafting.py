"""Grafting rules: the first-order optimizer whose step size DASH borrows.

DASH takes the direction of Shampoo and, per block, the Frobenius norm of a
simple diagonal optimizer's direction ("grafting"), so learning-rate schedules
tuned for that optimizer keep working. The same rules drive one-dimensional
parameters, which are not preconditioned at all.

Every function is pure elementwise arithmetic on tensors of any shape;
hyperparameters may be Python numbers or tensors that broadcast per block.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

Scalar = Union[float, Tensor]

GRAFTING_TYPES = ("adam", "adagrad", "rmsprop", "sgd", "none")


def uses_second_moment(kind: str) -> bool:
    """Whether ``kind`` keeps a per-element second-moment accumulator.

    ``"none"`` keeps one too: it drives one-dimensional parameters and blocks
    without a valid root, which fall back to Adam.
    """
    return kind != "sgd"


def update_second_moment(accumulator: Tensor, grad: Tensor, kind: str, beta2: Scalar) -> None:
    """Accumulate ``grad**2`` in place: a running sum for AdaGrad, an EMA otherwise."""
    if kind == "adagrad":
        accumulator.addcmul_(grad, grad)
    else:
        accumulator.lerp_(grad * grad, 1.0 - beta2)


def grafting_direction(
    momentum: Tensor,
    accumulator: Tensor | None,
    kind: str,
    epsilon: Scalar,
    second_moment_correction: Scalar,
) -> Tensor:
    """The grafting optimizer's direction for a (bias-corrected) momentum.

    Args:
        momentum: the momentum the step follows, already bias-corrected.
        accumulator: the second-moment state (unused for ``"sgd"``).
        kind: one of :data:`GRAFTING_TYPES`; ``"none"`` behaves as Adam here.
        epsilon: added to the root of the second moment.
        second_moment_correction: Adam's ``1 - beta2**t`` (1 disables it).
    """
    if kind == "sgd":
        return momentum
    if kind in ("adagrad", "rmsprop"):
        denominator = accumulator.sqrt()
    else:
        denominator = (accumulator / second_moment_correction).sqrt()
    return momentum / (denominator + epsilon)


def graft_norm(direction: Tensor, reference: Tensor) -> Tensor:
    """Rescale each block of ``direction`` to the Frobenius norm of ``reference``.

    Blocks are indexed by the leading dimension. A zero ``direction`` stays zero.
    """
    dims = tuple(range(1, direction.dim()))
    target = torch.linalg.vector_norm(reference, dim=dims, keepdim=True)
    current = torch.linalg.vector_norm(direction, dim=dims, keepdim=True)
    return direction * (target / current.clamp_min(torch.finfo(current.dtype).tiny))
