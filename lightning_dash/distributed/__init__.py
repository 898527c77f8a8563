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

__all__ = [
    "OwnershipPlan",
    "block_cost",
    "block_shapes",
    "greedy_parameters",
    "plan_ownership",
    "plan_parameter_ownership",
    "round_robin_parameters",
]
