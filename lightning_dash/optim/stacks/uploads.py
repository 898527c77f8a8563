"""Host values (hyperparameters, block positions) as device tensors, without waiting.

``torch.tensor(values, device="cuda")`` copies from host memory and then waits for the
device. A step that needs per-block values instead builds them in host memory and
copies with ``non_blocking=True``: the host goes on at once, and the copy takes its
place in the device's queue.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

_TYPECODES = {torch.float32: "f", torch.float64: "d", torch.int64: "q", torch.int32: "i", torch.bool: "b"}


def upload(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``, copied without a host wait."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    host = torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)
    # A tensor torch owns, never one over the Python array's memory: such a tensor must take
    # the GIL when freed, which aborts a process whose interpreter is already shutting down.
    return host.clone() if device.type == "cpu" else host.to(device, non_blocking=True)


def upload_runs(runs: Sequence[tuple[int, int]], device: torch.device) -> Tensor:
    """The positions ``start, ..., start + length - 1`` of every ``(start, length)`` run."""
    positions = [position for start, length in runs for position in range(start, start + length)]
    return upload(positions, torch.int64, device)
