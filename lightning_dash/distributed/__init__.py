"""Ownership and communication shared by the Lightning and Composer integrations, and the distributor
plain ``DASH(params)`` finds by itself on sharded parameters (:mod:`.found`, registered on import).

:class:`ShardedDistributor` is imported on first use: it needs ``torch.distributed.tensor``
(about 0.6 s to import), which plain ``from lightning_dash import DASH`` does not.
"""

from typing import TYPE_CHECKING, Any

from lightning_dash.distributed.assignment import (
    OwnershipPlan,
    block_cost,
    block_shapes,
    greedy_parameters,
    plan_ownership,
    plan_parameter_ownership,
    round_robin_parameters,
)
from lightning_dash.distributed.demo_optimizer import DeMo
from lightning_dash.distributed.demo_synchronizer import DemoSynchronizer
from lightning_dash.distributed.found import sharded_distributor_for
from lightning_dash.distributed.process_group import ProcessGroupDistributor, shard_across_ranks

if TYPE_CHECKING:
    from lightning_dash.distributed.sharded import ShardedDistributor

__all__ = [
    "DeMo",
    "DemoSynchronizer",
    "OwnershipPlan",
    "ProcessGroupDistributor",
    "ShardedDistributor",
    "block_cost",
    "block_shapes",
    "greedy_parameters",
    "plan_ownership",
    "plan_parameter_ownership",
    "round_robin_parameters",
    "shard_across_ranks",
    "sharded_distributor_for",
]


def __getattr__(name: str) -> Any:
    if name == "ShardedDistributor":
        from lightning_dash.distributed.sharded import ShardedDistributor

        return ShardedDistributor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
