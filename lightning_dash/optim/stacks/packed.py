"""A Kronecker factor and its inverse root held in the room of one matrix and a row.

Both matrices of a block side are symmetric, so one triangle of each describes it. A side
of length ``s`` keeps the two in one ``(s + 1, s)`` tensor: the factor's upper triangle
(diagonal included) in rows ``0 .. s-1``, the root's lower triangle (diagonal included)
one row down, in rows ``1 .. s``. The two triangles never overlap, so a stack of ``n``
sides is one dense ``(n, s + 1, s)`` tensor, half of two full stacks, and every batched
kernel still runs on it. The full matrices are formed when they are used (one elementwise
pass each) and never kept.

Pure functions on stacks; the inputs are never modified.
"""

from __future__ import annotations

import torch
from torch import Tensor


def empty_pairs(num_blocks: int, size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``num_blocks`` pairs of zero ``size x size`` matrices."""
    return torch.zeros(num_blocks, size + 1, size, device=device, dtype=dtype)


def pair_side(pairs: Tensor) -> int:
    """The side ``s`` of the matrices a stack of pairs ``(n, s + 1, s)`` holds."""
    return pairs.shape[-1]


def _upper(size: int, device: torch.device) -> Tensor:
    """``(size, size)`` mask: on and above the diagonal."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu_()


def factor_rows(pairs: Tensor) -> Tensor:
    """A view ``(n, s, s)`` whose upper triangles are the factors (below them: parts of the roots)."""
    return pairs[:, :-1]


def factors(pairs: Tensor) -> Tensor:
    """The full symmetric factors ``(n, s, s)`` of a stack of pairs."""
    top = factor_rows(pairs)
    return torch.where(_upper(pair_side(pairs), pairs.device), top, top.mT)


def roots(pairs: Tensor) -> Tensor:
    """The full symmetric roots ``(n, s, s)`` of a stack of pairs."""
    bottom = pairs[:, 1:]
    return torch.where(_upper(pair_side(pairs), pairs.device).mT, bottom, bottom.mT)


def with_factors(pairs: Tensor, factors: Tensor) -> Tensor:
    """New pairs holding the upper triangles of ``factors`` (nothing below them is read) and the
    roots of ``pairs``."""
    top = torch.where(_upper(pair_side(pairs), pairs.device), factors.to(pairs.dtype), factor_rows(pairs))
    return torch.cat([top, pairs[:, -1:]], dim=1)


def with_roots(pairs: Tensor, roots: Tensor, select: Tensor) -> Tensor:
    """New pairs holding the factors of ``pairs`` and, where the ``(n,)`` bool ``select`` is set,
    ``roots`` (their lower triangles); elsewhere the roots of ``pairs``."""
    lower = _upper(pair_side(pairs), pairs.device).mT
    bottom = torch.where(lower & select[:, None, None], roots.to(pairs.dtype), pairs[:, 1:])
    return torch.cat([pairs[:, :1], bottom], dim=1)


def pack(factors: Tensor, roots: Tensor) -> Tensor:
    """Pairs of full factors and roots ``(n, s, s)`` each (their upper and lower triangles)."""
    pairs = empty_pairs(factors.shape[0], factors.shape[-1], factors.device, factors.dtype)
    everywhere = torch.ones(factors.shape[0], dtype=torch.bool, device=factors.device)
    return with_roots(with_factors(pairs, factors), roots, everywhere)
