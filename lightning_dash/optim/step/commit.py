"""The checks that span a whole step and its commit: which parameters move, whether some gradient
or update is not finite (on the device, no host read), weight decay, and the masked write that
makes a candidate the state unless the step is skipped."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.stacks.layout import Layout


def active_params(layout: Layout) -> set[int]:
    """Indices of parameters with a gradient (empty ones excepted); a host-side decision."""
    candidates = [i for i, p in enumerate(layout.params) if p.grad is not None and p.numel() > 0]
    for index in candidates:
        if layout.params[index].grad.is_sparse:
            raise ValueError(f"params: DASH does not support sparse gradients ({layout.names[index]})")
    return set(candidates)


def local_peaks(layout: Layout, active: set[int], device: torch.device) -> Tensor:
    """The largest magnitude of each active gradient's local part, as one vector (NaN
    propagates; an empty part counts as zero). Two launches, no host read."""
    held = [grad for i in sorted(active) if (grad := layout.local(layout.params[i].grad)).numel() > 0]
    if not held:
        return torch.zeros(1, device=device)
    return torch.stack([norm.to(torch.float32) for norm in torch._foreach_norm(held, math.inf)])


def any_nonfinite(tensors: list[Tensor], device: torch.device) -> Tensor:
    """A 0-d float on ``device``: 1 when some entry of ``tensors`` is not finite, else 0 (empty ones pass)."""
    if not (tensors := [tensor for tensor in tensors if tensor.numel() > 0]):
        return torch.zeros((), device=device)
    peaks = torch.stack([norm.to(torch.float32) for norm in torch._foreach_norm(tensors, math.inf)])
    return (~torch.isfinite(peaks)).any().to(torch.float32)


def gradients_all_zero(layout: Layout, active: set[int], reduce_max: Callable[[Tensor], Tensor]) -> bool:
    """Whether every active gradient is exactly zero on every rank (reads one value back)."""
    device = layout.params[min(active)].device
    peaks = torch.nan_to_num(local_peaks(layout, active, device), nan=math.inf)
    return bool(reduce_max(peaks.max().view(1)).item() == 0)


def decay_weights(layout: Layout, groups: list[dict[str, Any]], active: set[int], skip: Tensor, vectors: bool) -> None:
    """Decoupled weight decay ``W <- W (1 - lr wd)`` of the moving parameters, 1-D ones too
    if ``vectors`` (none when the 0-d bool ``skip`` is set)."""
    for group_index, group in enumerate(groups):
        factor = 1.0 - group["lr"] * group["weight_decay"]
        if factor != 1.0:
            moving = [i for i in sorted(active) if layout.group_of[i] == group_index]
            moving = moving if vectors else [i for i in moving if layout.params[i].dim() >= 2]
            decayed = [layout.local(layout.params[i]) for i in moving]
            if decayed:
                torch._foreach_mul_(decayed, torch.where(skip, 1.0, torch.full_like(skip, factor, dtype=torch.float64)))


def commit_masked(current: Tensor, candidate: Tensor, index: Tensor | None, skip: Tensor) -> None:
    """``current`` (at ``index``, or whole) takes ``candidate`` unless ``skip`` is set; in place."""
    if index is None:
        torch.where(skip, current, candidate.to(current.dtype), out=current)
    else:
        current.index_copy_(0, index, torch.where(skip, current.index_select(0, index), candidate.to(current.dtype)))
