"""FSDP2's gradient average under Composer, checked on the backend and corrected where it sums.

FSDP2 reduce-scatters float32 and bfloat16 gradients with ``ReduceOp.AVG``. Under torch
2.7 gloo's ``reduce_scatter_tensor`` treats ``AVG`` as a sum, so every rank's gradients
arrive world-size times the global-batch mean. AdamW hardly notices a constant factor;
DASH's statistics, its SGD grafting and the state a checkpoint carries to another world
size do. One probe tells what the backend does; where it sums, each FSDP2 module divides
its reduce-scatter output through FSDP2's public all-reduce hook, before the gradients
are viewed out, so the optimizer, gradient clipping and every callback see the mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from composer.core import State
from composer.distributed.fsdp2 import create_mixed_precision_policy
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["average_factor", "correct_gradient_average"]

#: Reduce dtypes FSDP2 reduce-scatters with ``ReduceOp.AVG``; float16 sums with its own
#: division before and after, which is right on every backend.
_AVERAGED_DTYPES = (torch.float32, torch.bfloat16)


def average_factor(group: dist.ProcessGroup, device: torch.device) -> int:
    """What ``reduce_scatter_tensor(op=AVG)`` makes of ones on every rank: 1 where the
    backend averages, the group's size where it sums. Collective over ``group``."""
    size = dist.get_world_size(group)
    out = torch.empty(1, device=device)
    try:
        dist.reduce_scatter_tensor(out, torch.ones(size, device=device), op=dist.ReduceOp.AVG, group=group)
    except RuntimeError:  # a backend that refuses AVG: FSDP2 fails by itself there
        return 1
    return round(out.item())


def _divide_by(factor: int):
    def divide(output: Tensor) -> None:
        output.div_(factor)

    return divide


def correct_gradient_average(state: State, parameter: Tensor) -> int:
    """Make FSDP2's reduce-scatter an average on this backend, for the model of ``state``
    (already sharded; ``parameter`` is one of its DTensor parameters). Returns the factor
    the backend was off by (1: nothing to correct). Collective."""
    factor = average_factor(parameter.device_mesh.get_group(), parameter.device)
    if factor == 1:
        return 1
    policy = create_mixed_precision_policy(state.precision, state.fsdp_config.mixed_precision)
    reduce_dtype = policy.reduce_dtype or policy.param_dtype or parameter.dtype
    if reduce_dtype not in _AVERAGED_DTYPES:
        return 1
    model: nn.Module = state.model
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(_divide_by(factor))
    return factor
