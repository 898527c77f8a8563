"""Which rank owns which Shampoo block: a deterministic, process-group-free plan.

In data-parallel training each block is owned by one rank, which keeps its
statistics and computes its update; one all-gather then shares the parameters.
The step therefore takes as long as the most loaded rank, so blocks are spread
by a cost model with greedy longest-processing-time (LPT) scheduling. Every rank
computes the same plan from the same parameter shapes, so no communication is
needed to agree on it.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dash.optim.stacks import MatrixView, param_regions

STEP_FLOPS_PER_TERM = 4
"""Per-step flops per ``rows * cols * (rows + cols)``: 2 for the factor updates
``G G^T`` and ``G^T G``, 2 for the direction ``L^{-1/4} M R^{-1/4}``."""

ROOT_FLOPS_PER_CUBE = 12
"""Root flops per ``b**3`` and iteration in the cost model: three ``b^3`` matmuls per
iteration and two passes, as Newton-DB ran when the ownership plans and balance tables
were made (its one-pass form now costs 4 matmuls per iteration, 8 flops per ``b**3``; only
the ratio of root to statistics cost matters to the plan, so the constant was kept)."""


def _require_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def block_cost(rows: int, cols: int, precondition_frequency: int = 10, root_iterations: int = 10) -> float:
    """Flops of one optimizer step for a ``rows`` x ``cols`` block, roots amortized.

    ``4 * rows * cols * (rows + cols)`` per step (factor updates and preconditioned
    direction, :data:`STEP_FLOPS_PER_TERM`) plus
    ``12 * (rows**3 + cols**3) * root_iterations / precondition_frequency`` for the
    inverse fourth roots of both factors (:data:`ROOT_FLOPS_PER_CUBE`), which are
    recomputed every ``precondition_frequency`` steps.
    """
    for name, value in [
        ("rows", rows),
        ("cols", cols),
        ("precondition_frequency", precondition_frequency),
        ("root_iterations", root_iterations),
    ]:
        _require_positive(name, value)
    step = STEP_FLOPS_PER_TERM * rows * cols * (rows + cols)
    root = ROOT_FLOPS_PER_CUBE * (rows**3 + cols**3) * root_iterations / precondition_frequency
    return float(step + root)


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of the per-rank loads: the step time relative to a perfect split
    (1.0 when nothing costs)."""
    total = sum(loads)
    return 1.0 if total == 0 else max(loads) / (total / len(loads))


@dataclass(frozen=True)
class OwnershipPlan:
    """The owner rank of each item (block or parameter) and the resulting load per rank."""

    owners: tuple[int, ...]
    loads: tuple[float, ...]
    world_size: int

    @property
    def max_over_mean(self) -> float:
        """Imbalance: the step time relative to a perfect split (1.0 when nothing costs)."""
        return imbalance(self.loads)

    def blocks_of(self, rank: int) -> list[int]:
        """Indices of the items owned by ``rank``, in input order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return [index for index, owner in enumerate(self.owners) if owner == rank]


def _validate(costs: Sequence[float], world_size: int) -> None:
    _require_positive("world_size", world_size)
    for index, cost in enumerate(costs):
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"costs must be finite and non-negative, got costs[{index}] = {cost}")


def _plan(owners: list[int], costs: Sequence[float], world_size: int) -> OwnershipPlan:
    loads = [0.0] * world_size
    for owner, cost in zip(owners, costs):
        loads[owner] += cost
    return OwnershipPlan(tuple(owners), tuple(loads), world_size)


def lpt_assign(
    costs: Sequence[float],
    world_size: int,
    loads: Sequence[float] | None = None,
    preferred: Sequence[int | None] | None = None,
) -> list[int]:
    """Greedy longest-processing-time assignment, deterministically: items by cost
    descending (ties by input index), each to the currently least-loaded rank, starting
    from ``loads`` (default: all zero), the lowest of equally loaded ranks.

    With ``preferred`` (each item's rank that already holds its data, or None), an item
    goes to its preferred rank when that is among the least loaded, and items of equal
    cost are taken in turns by preferred rank (one preferring rank 0, one preferring rank
    1, ..., then each one's second), so that a round of equal items can each land where
    they are. Both only reorder or choose among equals, so the loads are plain LPT's, whose
    makespan is within ``4/3 - 1/(3 * world_size)`` of optimal."""
    _validate(costs, world_size)
    if preferred is None:
        order = sorted(range(len(costs)), key=lambda index: (-costs[index], index))
    else:
        seen: Counter[tuple[float, int | None]] = Counter()
        turn = []
        for cost, rank in zip(costs, preferred):
            turn.append(seen[cost, rank])
            seen[cost, rank] += 1
        order = sorted(
            range(len(costs)),
            key=lambda i: (-costs[i], turn[i], -1 if preferred[i] is None else preferred[i], i),
        )
    current = [float(load) for load in (loads or [0.0] * world_size)]
    heap = [(load, rank) for rank, load in enumerate(current)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for index in order:
        while heap[0][0] != current[heap[0][1]]:  # an entry from before that rank's load grew
            heapq.heappop(heap)
        least, rank = heap[0]
        wanted = preferred[index] if preferred is not None else None
        if wanted is not None and current[wanted] == least:
            rank = wanted
        owners[index] = rank
        current[rank] += costs[index]
        heapq.heappush(heap, (current[rank], rank))
    return owners


def plan_ownership(costs: Sequence[float], world_size: int) -> OwnershipPlan:
    """Assign each block to a rank by greedy LPT (:func:`lpt_assign`)."""
    return _plan(lpt_assign(costs, world_size), costs, world_size)


def block_shapes(param_shapes: Sequence[Sequence[int]], block_size: int) -> list[tuple[int, int]]:
    """Tile shapes of every parameter of two or more dimensions, in block order, each
    viewed as one ``(shape[0], rest)`` matrix (the optimizer's default view; a 3-D
    stack of experts under DASH is one matrix per expert, see :mod:`lightning_dash.optim.routing`).

    Parameters in order; within one, the regions of
    :func:`~lightning_dash.optim.stacks.blocks.param_regions` in order and each region's
    tiles row-major (the order of their stack offsets). 1-D parameters have no blocks.
    """
    _require_positive("block_size", block_size)
    shapes = []
    for index, shape in enumerate(param_shapes):
        if len(shape) < 2:
            continue
        for region in param_regions(index, MatrixView.of(tuple(shape)), block_size):
            shapes.extend([region.block_shape] * region.num_blocks)
    return shapes


def plan_parameter_ownership(
    param_shapes: Sequence[Sequence[int]],
    world_size: int,
    block_size: int = 1024,
    precondition_frequency: int = 10,
) -> OwnershipPlan:
    """The block ownership plan of a model, from its parameter shapes alone."""
    costs = [block_cost(rows, cols, precondition_frequency) for rows, cols in block_shapes(param_shapes, block_size)]
    return plan_ownership(costs, world_size)


def round_robin_parameters(param_costs: Sequence[float], world_size: int) -> OwnershipPlan:
    """Baseline: parameter ``i`` goes to rank ``i % world_size``, whatever its cost."""
    _validate(param_costs, world_size)
    return _plan([index % world_size for index in range(len(param_costs))], param_costs, world_size)


def greedy_parameters(param_costs: Sequence[float], world_size: int) -> OwnershipPlan:
    """Baseline: whole parameters (the sum of their blocks' costs) placed by LPT."""
    return plan_ownership(param_costs, world_size)
