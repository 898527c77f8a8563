"""Ownership and communication shared by the Lightning and Composer integrations."""

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
from lightning_dash.distributed.process_group import ProcessGroupDistributor, shard_across_ranks
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
]
