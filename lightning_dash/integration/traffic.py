"""Bytes FSDP2's own collectives move per step, next to which DASH's block exchanges are reported."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def _all_gathers(module: nn.Module, inherited: int, out: dict[int, tuple[Tensor, int]]) -> None:
    """All-gathers per step of each parameter under ``module``: an FSDP2 unit without an
    FSDP2 parent (a root) keeps its parameters gathered from the forward through the
    backward (1); any other unit reshards after the forward and gathers again (2)."""
    gathers = (2 if inherited else 1) if isinstance(module, FSDPModule) else inherited
    for param in module.parameters(recurse=False):
        if gathers and id(param) not in out:
            out[id(param)] = (param, gathers)
    for child in module.children():
        _all_gathers(child, gathers, out)


def fsdp_bytes_per_step(module: nn.Module, world_size: int) -> float:
    """Bytes one rank sends per step in FSDP2's collectives, from their sizes.

    A ring all-gather or reduce-scatter makes each rank send ``W - 1`` shards. Each
    parameter is all-gathered once (in a root unit) or twice (in a unit that reshards
    after the forward, FSDP2's default), and its gradient reduce-scattered once.
    """
    gathers: dict[int, tuple[Tensor, int]] = {}
    _all_gathers(module, 0, gathers)
    return float(
        (world_size - 1)
        * sum(
            param.to_local().numel() * param.element_size() * (count + 1)
            for param, count in gathers.values()
            if isinstance(param, DTensor) and param.requires_grad
        )
    )
