"""Bytes FSDP2's own collectives move per step, next to which DASH's row exchanges are reported."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor


def fsdp_bytes_per_step(module: nn.Module, world_size: int) -> float:
    """Bytes one rank sends per step in FSDP2's collectives, from their sizes.

    A ring all-gather or reduce-scatter makes each rank send ``W - 1`` shards. FSDP2
    all-gathers the parameters in the forward and again in the backward (units
    reshard after the forward by default) and reduce-scatters the gradients: about
    ``3 (W - 1)`` times the bytes of this rank's shards.
    """
    shard_bytes = sum(
        param.to_local().numel() * param.element_size()
        for param in module.parameters()
        if isinstance(param, DTensor) and param.requires_grad
    )
    return 3.0 * (world_size - 1) * shard_bytes
