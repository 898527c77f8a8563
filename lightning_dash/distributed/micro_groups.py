"""Micro-groups: a sharded step's blocks exchanged and computed a memory budget at a time.

Under FSDP2 and tensor parallelism an owner gathers each of its blocks' gradients whole and
computes the block's update whole before the pieces go back to their holders. Done in one
round, a rank holds every block it owns twice over (gradient and update) at once: a
1/world share of the model, twice, which is gigabytes on a few ranks. Canzona bounds this
with micro-groups; here each rank's blocks, most expensive first, fill micro-group 0 up to
a byte capacity, then micro-group 1, and so on, so every micro-group carries a similar,
bounded amount of work on every rank.

The step exchanges the next micro-group's gradients while it computes the current one
(:meth:`~lightning_dash.distributed.ShardedDistributor.exchange_blocks`), so the whole
blocks alive at once are one micro-group's gradients and updates plus the next one's
gradients. A micro-group's capacity is two thirds of the budget, which keeps that sum
within it. Only a block larger than the capacity on its own can exceed it: it forms a
micro-group by itself, and :func:`peak_gathered_bytes` reports the real peak.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from lightning_dash.optim.stacks import Region

MIB = 1 << 20


def check_micro_group_mib(value: float | None) -> float | None:
    """``value`` if it is a positive, finite number of MiB (or None: one micro-group)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"micro_group_mib must be a positive number of MiB or None, got {value!r}")
    return float(value)


def capacity_bytes(budget_mib: float) -> int:
    """Bytes of whole blocks (gradients and updates) one micro-group may hold on a rank."""
    return max(1, int(budget_mib * MIB * 2 // 3))


def assign_micro_groups(
    costs: Sequence[float], owners: Sequence[int], footprints: Sequence[int], capacity: int | None
) -> list[int]:
    """The micro-group of each block (not collective: the same on every rank).

    ``costs``: each block's cost; ``owners``: its owning rank; ``footprints``: the bytes
    its gradient and update take on the owner. Each rank's blocks, in decreasing cost,
    fill micro-group 0 until the next would pass ``capacity`` bytes, then micro-group 1,
    and so on; a block larger than ``capacity`` has a micro-group to itself on its rank.
    ``capacity`` None: every block in micro-group 0.
    """
    if capacity is None:
        return [0] * len(costs)
    order = sorted(range(len(costs)), key=lambda block: (-costs[block], block))
    current: dict[int, tuple[int, int]] = {}
    groups = [0] * len(costs)
    for block in order:
        group, filled = current.get(owners[block], (0, 0))
        if filled and filled + footprints[block] > capacity:
            group, filled = group + 1, 0
        groups[block] = group
        current[owners[block]] = (group, filled + footprints[block])
    return groups


def peak_gathered_bytes(
    groups: Sequence[int], owners: Sequence[int], footprints: Sequence[int], world_size: int
) -> list[int]:
    """For every rank, the most bytes of whole blocks it holds at once in a step: a
    micro-group's gradients and updates (``footprints``, half each) and the next
    micro-group's gradients, which are exchanged meanwhile."""
    count = max(groups, default=-1) + 1
    held = [[0] * (count + 1) for _ in range(world_size)]
    for group, owner, footprint in zip(groups, owners, footprints):
        held[owner][group] += footprint
    return [max((mine[g] + mine[g + 1] // 2 for g in range(count)), default=0) for mine in held]


def warn_block_above_budget(
    tile: Region, footprint: int, peak: int, budget_mib: float, names: Sequence[str] | None
) -> None:
    """Warn that the largest block (``tile``, a single-block region) does not fit a
    micro-group of ``budget_mib``: it travels alone and the step's peak passes the budget."""
    rows, cols = tile.block_shape
    where = names[tile.param_index] if names else f"parameter {tile.param_index}"
    needed = math.ceil(1.5 * footprint / MIB * 1000) / 1000
    warnings.warn(
        f"micro_group_mib={budget_mib:g} is smaller than one block: the {rows}x{cols} block of {where} at rows "
        f"{tile.row_start}:{tile.row_start + rows}, columns {tile.col_start}:{tile.col_start + cols} needs "
        f"{footprint / MIB:.3g} MiB (its gradient and update) and travels alone, so a step holds up to "
        f"{peak / MIB:.3g} MiB of whole blocks; set micro_group_mib to at least {needed:g} or lower block_size",
        stacklevel=2,
    )
