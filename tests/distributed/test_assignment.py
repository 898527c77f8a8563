"""Block ownership: LPT against brute force, invariants, determinism and validation."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_dash.distributed import (
    OwnershipPlan,
    block_cost,
    block_shapes,
    greedy_parameters,
    plan_ownership,
    plan_parameter_ownership,
    round_robin_parameters,
)
from lightning_dash.distributed.assignment import lpt_assign


def optimal_makespan(costs: list[float], world_size: int) -> float:
    """The smallest maximum load over every assignment (exhaustive)."""
    best = float("inf")
    for owners in itertools.product(range(world_size), repeat=len(costs)):
        loads = [0.0] * world_size
        for owner, cost in zip(owners, costs):
            loads[owner] += cost
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_lpt_within_graham_bound_of_brute_force_optimum(seed):
    rng = random.Random(seed)
    costs = [rng.uniform(1.0, 100.0) for _ in range(7)]
    world_size = 3
    optimum = optimal_makespan(costs, world_size)
    makespan = max(plan_ownership(costs, world_size).loads)
    assert optimum <= makespan <= (4 / 3 - 1 / (3 * world_size)) * optimum + 1e-9


def test_lpt_is_not_optimal_on_grahams_instance_but_within_the_bound():
    # The optimum splits {5, 4} | {3, 3, 3} = 9; LPT gives {5, 3} | {4, 3, 3} = 10 <= 9 * 7/6.
    costs = [3, 5, 3, 4, 3]
    assert optimal_makespan(costs, 2) == 9
    assert plan_ownership(costs, 2).loads == (8.0, 10.0)


@pytest.mark.parametrize("world_size", [1, 2, 5, 16])
def test_every_block_assigned_once_and_loads_add_up(world_size):
    rng = random.Random(world_size)
    costs = [rng.choice([0.0, 1.0, 2.5, rng.uniform(0, 50)]) for _ in range(40)]
    plan = plan_ownership(costs, world_size)
    assert len(plan.owners) == len(costs)
    assert all(0 <= owner < world_size for owner in plan.owners)
    assert sorted(i for rank in range(world_size) for i in plan.blocks_of(rank)) == list(range(len(costs)))
    for rank in range(world_size):
        assert plan.loads[rank] == pytest.approx(sum(costs[i] for i in plan.blocks_of(rank)))


def test_plan_is_deterministic_and_breaks_ties_by_index_then_rank():
    costs = [2.0, 7.0, 2.0, 7.0, 2.0, 1.0]
    assert plan_ownership(costs, 3) == plan_ownership(list(costs), 3)
    # Sorted: blocks 1 and 3 (cost 7) take ranks 0 and 1; then blocks 0, 2, 4 (cost 2)
    # and 5 (cost 1) all go to rank 2, whose load stays lowest until it reaches 7.
    plan = plan_ownership(costs, 3)
    assert plan.owners == (2, 0, 2, 1, 2, 2)
    assert plan.loads == (7.0, 7.0, 7.0)


def test_equal_ties_go_to_lowest_rank_in_input_order():
    plan = plan_ownership([1.0] * 5, 5)
    assert plan.owners == (0, 1, 2, 3, 4)


def test_equal_costs_spread_evenly():
    plan = plan_ownership([3.0] * 12, 4)
    assert [len(plan.blocks_of(rank)) for rank in range(4)] == [3, 3, 3, 3]
    assert plan.max_over_mean == 1.0


def test_single_rank_owns_everything():
    plan = plan_ownership([4.0, 1.0, 2.0], 1)
    assert plan.owners == (0, 0, 0)
    assert plan.loads == (7.0,)
    assert plan.max_over_mean == 1.0


def test_more_ranks_than_blocks_leaves_ranks_empty():
    plan = plan_ownership([6.0, 2.0], 4)
    assert sorted(plan.owners) == [0, 1]
    assert plan.loads == (6.0, 2.0, 0.0, 0.0)
    assert plan.blocks_of(3) == []
    assert plan.max_over_mean == pytest.approx(6.0 / (8.0 / 4))


def test_zero_costs_have_unit_imbalance():
    assert plan_ownership([0.0, 0.0], 3).max_over_mean == 1.0
    assert plan_ownership([], 2) == OwnershipPlan((), (0.0, 0.0), 2)


def test_block_shapes_follow_the_tiling():
    assert block_shapes([(1030, 17)], 1024) == [(1024, 17), (6, 17)]
    shapes = block_shapes([(2500, 2100)], 1024)
    assert len(shapes) == 9
    assert shapes.count((1024, 1024)) == 4 and shapes.count((452, 52)) == 1


def test_block_shapes_skip_vectors_and_flatten_trailing_dims():
    assert block_shapes([(5,), (4, 3, 2), (7,), (2, 2)], 4) == [(4, 4), (4, 2), (2, 2)]


def test_plan_parameter_ownership_composes_shapes_and_costs():
    shapes = [(2048, 512), (512,), (300, 700)]
    plan = plan_parameter_ownership(shapes, 2, block_size=512, precondition_frequency=5)
    costs = [block_cost(r, c, 5) for r, c in block_shapes(shapes, 512)]
    assert plan == plan_ownership(costs, 2)
    assert len(plan.owners) == 4 + 2


def test_parameter_baselines():
    costs = [5.0, 1.0, 1.0, 1.0, 4.0]
    round_robin = round_robin_parameters(costs, 2)
    assert round_robin.owners == (0, 1, 0, 1, 0)
    assert round_robin.loads == (10.0, 2.0)
    greedy = greedy_parameters(costs, 2)
    assert greedy.loads == (6.0, 6.0)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: plan_ownership([1.0], 0), "world_size"),
        (lambda: plan_ownership([1.0, -1.0], 2), "costs"),
        (lambda: plan_ownership([float("nan")], 2), "costs"),
        (lambda: round_robin_parameters([1.0], -1), "world_size"),
        (lambda: greedy_parameters([-2.0], 1), "costs"),
        (lambda: block_cost(0, 4), "rows"),
        (lambda: block_cost(4, -1), "cols"),
        (lambda: block_cost(4, 4, precondition_frequency=0), "precondition_frequency"),
        (lambda: block_cost(4, 4, root_iterations=0), "root_iterations"),
        (lambda: block_shapes([(4, 4)], 0), "block_size"),
        (lambda: plan_ownership([1.0], 2).blocks_of(2), "rank"),
    ],
)
def test_invalid_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_block_cost_is_symmetric_and_root_term_grows_as_frequency_falls():
    assert block_cost(1024, 52) == block_cost(52, 1024)
    costs = [block_cost(512, 256, precondition_frequency=f) for f in (100, 10, 1)]
    assert costs[0] < costs[1] < costs[2]
    # The root term is the only part that depends on the frequency: exactly 1/f.
    step = 4 * 512 * 256 * (512 + 256)
    root = 12 * (512**3 + 256**3) * 10
    assert costs[2] == pytest.approx(step + root)
    assert costs[1] == pytest.approx(step + root / 10)


@pytest.mark.parametrize("seed", range(6))
def test_preferences_keep_plain_lpt_loads(seed):
    rng = random.Random(seed)
    world_size = rng.randint(2, 6)
    costs = [float(rng.choice([1, 2, 3, 5])) for _ in range(rng.randint(5, 40))]
    preferred = [rng.choice([None, *range(world_size)]) for _ in costs]
    plain, placed = lpt_assign(costs, world_size), lpt_assign(costs, world_size, preferred=preferred)

    def loads(owners):
        totals = [0.0] * world_size
        for owner, cost in zip(owners, costs):
            totals[owner] += cost
        return sorted(totals)

    assert loads(placed) == loads(plain)  # only equal loads were chosen among


def test_equal_blocks_all_land_on_their_holders_when_holders_are_balanced():
    # 16 equal blocks of one weight at 2 ranks: rank 0 holds the first 8, rank 1 the last 8
    preferred = [0] * 8 + [1] * 8
    assert lpt_assign([1.0] * 16, 2, preferred=preferred) == preferred
    assert lpt_assign([1.0] * 16, 2) == [0, 1] * 8  # plain LPT moves half of them
    # two sizes, three ranks, each rank holding as many of each size: every block stays
    costs = [4.0] * 6 + [1.0] * 9
    preferred = [0, 0, 1, 1, 2, 2] + [2, 1, 0] * 3
    assert lpt_assign(costs, 3, preferred=preferred) == preferred
