"""The distributor DASH takes by itself when it is built on sharded parameters without one.

Users who shard a model themselves (``fully_shard``, ``parallelize_module``, HSDP, or a trainer such
as Hugging Face's that applies FSDP2 before it builds the optimizer) then write ``DASH(params)`` as they
would write ``AdamW(params)``. DTensor parameters call for a
:class:`~lightning_dash.distributed.ShardedDistributor` over the default process group: each block is
owned by one rank, which gathers its pieces, computes its update and sends the pieces back. A layout it
cannot step is refused when DASH is built, with what to do instead.
"""

from __future__ import annotations

import sys

from torch import Tensor

from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit
from lightning_dash.optim.distributor import BlockDistributor, register_distributor_finder


def sharded_distributor_for(params: list[Tensor], names: list[str]) -> BlockDistributor | None:
    """A :class:`~lightning_dash.distributed.ShardedDistributor` when ``params`` are DTensors, else None.

    Raises ``ValueError`` for sharded parameters beside plain ones and for placements DASH cannot
    exchange (``Partial``, a shard of a higher dimension), each naming the first such parameter. Meshes
    may differ between parameters (a norm sharded over the data-parallel ranks beside layers sharded
    over data and tensor parallelism); at the first step every rank's pieces are gathered once and a
    layout whose pieces do not tile each matrix is refused there.
    """
    tensor_module = sys.modules.get("torch.distributed.tensor")  # not loaded: no parameter is a DTensor
    if tensor_module is None or not any(isinstance(p, tensor_module.DTensor) for p in params):
        return None
    for param, name in zip(params, names):
        if not isinstance(param, tensor_module.DTensor):
            raise ValueError(
                f"{name} of shape {tuple(param.shape)} is a plain tensor beside sharded parameters (DTensors): "
                "DASH steps one layout at a time; pass it to fully_shard as well (shard the root module last), "
                "or give it to another optimizer"
            )
    from lightning_dash.distributed.placements import check_sharded_placements
    from lightning_dash.distributed.sharded import ShardedDistributor

    check_sharded_placements(params, names)
    settle_gloo_workers_at_exit()  # as the strategies do: no abort at exit after a run that succeeded
    return ShardedDistributor()


register_distributor_finder(sharded_distributor_for)
