"""Micro-group planning (pure): every rank's share of a micro-group fits the capacity, the
most expensive blocks go first, and the reported peak is what the schedule holds."""

from __future__ import annotations

import random

import pytest

from lightning_dash.distributed.micro_groups import (
    MIB,
    assign_micro_groups,
    capacity_bytes,
    check_micro_group_mib,
    peak_gathered_bytes,
)


def random_blocks(count: int, ranks: int, seed: int) -> tuple[list[float], list[int], list[int]]:
    rng = random.Random(seed)
    sides = [rng.choice([32, 64, 128, 256, 512]) for _ in range(count)]
    costs = [float(side**3) for side in sides]
    owners = [rng.randrange(ranks) for _ in range(count)]
    footprints = [2 * 4 * side * side for side in sides]
    return costs, owners, footprints


def brute_force_peak(groups: list[int], owners: list[int], footprints: list[int], rank: int) -> int:
    """Walk the schedule: micro-group g's gradients and updates, with g + 1's gradients arriving."""
    count = max(groups) + 1
    peak = 0
    mine = [(group, f) for group, owner, f in zip(groups, owners, footprints) if owner == rank]
    for g in range(count):
        current = sum(f for group, f in mine if group == g)
        following = sum(f // 2 for group, f in mine if group == g + 1)
        peak = max(peak, current + following)
    return peak


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_ranks_share_fits_and_the_peak_stays_within_the_budget(seed):
    costs, owners, footprints = random_blocks(300, 4, seed)
    budget_mib = 3.0
    capacity = capacity_bytes(budget_mib)
    assert capacity == 2 * MIB
    groups = assign_micro_groups(costs, owners, footprints, capacity)
    assert len(set(groups)) == max(groups) + 1 > 1  # no empty micro-group numbers
    for rank in range(4):
        for group in set(groups):
            share = [f for g, o, f in zip(groups, owners, footprints) if o == rank and g == group]
            assert sum(share) <= capacity or len(share) == 1
    peaks = peak_gathered_bytes(groups, owners, footprints, 4)
    assert peaks == [brute_force_peak(groups, owners, footprints, rank) for rank in range(4)]
    assert max(peaks) <= budget_mib * MIB


def test_most_expensive_blocks_come_first_on_each_rank():
    costs, owners, footprints = random_blocks(200, 3, 7)
    groups = assign_micro_groups(costs, owners, footprints, capacity_bytes(2.0))
    for rank in range(3):
        mine = sorted((g, -c) for g, c, o in zip(groups, costs, owners) if o == rank)
        assert [-c for _, c in mine] == sorted((c for c, o in zip(costs, owners) if o == rank), reverse=True)


def test_a_block_larger_than_the_capacity_travels_alone_and_is_reported():
    # Rank 0: one 6 MiB block and two 1 MiB blocks under a 3 MiB budget (capacity 2 MiB).
    footprints = [6 * MIB, MIB, MIB, MIB]
    groups = assign_micro_groups([9.0, 2.0, 1.0, 5.0], [0, 0, 0, 1], footprints, capacity_bytes(3.0))
    assert groups == [0, 1, 1, 0]
    # Rank 0: 7 MiB, above the budget, as reported; rank 1: its one block.
    assert peak_gathered_bytes(groups, [0, 0, 0, 1], footprints, 2) == [6 * MIB + MIB, MIB]


def test_without_a_budget_every_block_is_in_one_micro_group():
    costs, owners, footprints = random_blocks(50, 2, 3)
    groups = assign_micro_groups(costs, owners, footprints, None)
    assert groups == [0] * 50
    whole = [sum(f for f, o in zip(footprints, owners) if o == rank) for rank in range(2)]
    assert peak_gathered_bytes(groups, owners, footprints, 2) == whole
    assert peak_gathered_bytes([], [], [], 2) == [0, 0]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "64"])
def test_a_bad_budget_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="micro_group_mib must be a positive number of MiB or None"):
        check_micro_group_mib(bad)


def test_a_good_budget_is_kept():
    assert check_micro_group_mib(None) is None
    assert check_micro_group_mib(256) == 256.0
