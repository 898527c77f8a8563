"""Which rank updates which blocks, and how the block updates and states travel between ranks.

Every rank computes the same :class:`ExchangePlan` from the same parameter shapes:
each rank's stacks and where its block updates sit in a flat buffer. After a step,
one all-gather of those buffers lets every rank add every block's update; for a
checkpoint, the ranks' per-parameter states are merged on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dash.optim.distributor import BlockUpdate, masked
from lightning_dash.optim.stacks import (
    GRAFTING_RMS,
    MOMENTUM,
    ROOT_FAILURES,
    ROOT_VALID,
    Region,
    StackPlan,
    add_stacks,
    stacks_by_placement,
)


@dataclass
class ExchangePlan:
    """Every rank's stacks, each stack's offset in its rank's flat update buffer, and
    the buffer size (the largest rank's; every rank sends the same size)."""

    plans: list[list[StackPlan]]
    offsets: list[list[int]]
    size: int


def split_by_owner(regions: list[Region], owners: list[int], world_size: int) -> list[list[Region]]:
    """Every rank's regions given the owner of each tile (tiles in region order).

    A region whose tiles all belong to one rank stays whole; otherwise it is split
    into one-tile regions.
    """
    owned: list[list[Region]] = [[] for _ in range(world_size)]
    position = 0
    for region in regions:
        region_owners = owners[position : position + region.num_blocks]
        if len(set(region_owners)) == 1:
            owned[region_owners[0]].append(region)
        else:
            for tile, owner in zip(region.single_tiles(), region_owners):
                owned[owner].append(tile)
        position += region.num_blocks
    return owned


def plan_exchange(regions: list[Region], params: list[Tensor], owners: list[int], world_size: int) -> ExchangePlan:
    """Lay out every rank's stacks (see :func:`split_by_owner`) and their all-gather buffers."""
    owned = split_by_owner(regions, owners, world_size)
    plans = [stacks_by_placement(rank_regions, params) for rank_regions in owned]
    offsets = []
    for rank_plans in plans:
        sizes = [plan.num_blocks * plan.block_shape[0] * plan.block_shape[1] for plan in rank_plans]
        offsets.append([sum(sizes[:k]) for k in range(len(sizes) + 1)])
    return ExchangePlan(plans, [o[:-1] for o in offsets], max(o[-1] for o in offsets))


def pack_updates(exchange: ExchangePlan, rank: int, updates: list[BlockUpdate], device: torch.device) -> Tensor:
    """This rank's flat buffer of block updates (zero for blocks that did not move;
    float64 when any update is)."""
    wide = any(item.update.dtype == torch.float64 for item in updates)
    buffer = torch.zeros(exchange.size, device=device, dtype=torch.float64 if wide else torch.float32)
    for item in updates:
        full, offset = exchange.plans[rank][item.stack], exchange.offsets[rank][item.stack]
        rows, cols = full.block_shape
        window = buffer[offset : offset + full.num_blocks * rows * cols].view(full.num_blocks, rows, cols)
        if item.index is None:
            window.copy_(item.update)
        else:
            window.index_copy_(0, item.index, item.update.to(window.dtype))
    return buffer


@dataclass
class GatheredUpdates:
    """Every rank's flat update buffer, in rank order, with the plan that reads them."""

    exchange: ExchangePlan
    buffers: list[Tensor]

    def tensors(self) -> list[Tensor]:
        return list(self.buffers)

    def apply(self, params: list[Tensor], skip: Tensor) -> None:
        """Add every rank's block updates (none when ``skip`` is set), in one foreach call."""
        updates = []
        for flat, plans, offsets in zip(self.buffers, self.exchange.plans, self.exchange.offsets):
            flat = masked(flat, skip)
            for plan, offset in zip(plans, offsets):
                rows, cols = plan.block_shape
                window = flat[offset : offset + plan.num_blocks * rows * cols]
                updates.append((plan, window.view(plan.num_blocks, rows, cols)))
        add_stacks(params, updates)


def merge_rank_states(states: list[dict[int, dict[str, Tensor]]]) -> dict[int, dict[str, Tensor]]:
    """Combine per-rank exports: each block (and each element of the parameter-shaped
    buffers) is owned by exactly one rank, whose values are non-zero only there."""
    combine: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        ROOT_VALID: torch.logical_or,
        MOMENTUM: torch.add,
        GRAFTING_RMS: torch.add,
        ROOT_FAILURES: torch.add,
    }
    merged: dict[int, dict[str, Tensor]] = {}
    for state in states:
        for key, entry in state.items():
            target = merged.setdefault(key, {})
            for name, value in entry.items():
                if name in target and name in combine:
                    target[name] = combine[name](target[name], value)
                else:
                    target[name] = value.clone()
    return merged
