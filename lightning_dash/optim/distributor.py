"""What DASH needs from a data-parallel runtime, as a protocol, and the single-process case.

The optimizer never imports ``torch.distributed``: a trainer integration hands it an
object with the :class:`BlockDistributor` interface (``lightning_dash.distributed``
provides one over a process group). Without one, :class:`LocalDistributor` owns every
block. Methods are collective unless stated otherwise: every rank calls them in the
same order with the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from lightning_dash.optim.blocks import Region, StackPlan
from lightning_dash.optim.layout import stacks_by_placement


@dataclass
class BlockUpdate:
    """The update of the moving blocks of one of this rank's stacks.

    ``stack`` is the stack's position in the plans :meth:`BlockDistributor.plan_stacks`
    returned, ``plan`` the regions of the moving blocks, ``index`` their positions in
    the whole stack (None: every block), ``update`` a ``(blocks, rows, cols)`` tensor.
    """

    stack: int
    plan: StackPlan
    index: Tensor | None
    update: Tensor


class SharedUpdates(Protocol):
    """Every rank's block updates after the exchange, before they are applied."""

    def tensors(self) -> list[Tensor]:
        """Everything :meth:`apply` would add (checked for finiteness first, identically on every rank)."""
        ...

    def apply(self, params: list[Tensor]) -> None:
        """Add every update to its parameter (not collective)."""
        ...


class BlockDistributor(Protocol):
    """Block ownership and the collectives of ZeRO-1-style DASH."""

    rank: int
    world_size: int

    @property
    def balance(self) -> float:
        """max / mean of the per-rank cost of the current ownership (not collective)."""
        ...

    def plan_stacks(self, regions: list[Region], params: list[Tensor], frequencies: list[int]) -> list[StackPlan]:
        """The stacks of the blocks this rank owns (not collective: deterministic on every rank).

        ``regions`` are every block region of every parameter, ``frequencies`` the
        ``precondition_frequency`` of each region's parameter (for the cost model).
        Blocks planned before keep their owner.
        """
        ...

    def share_updates(self, updates: list[BlockUpdate]) -> SharedUpdates:
        """Exchange this rank's block updates so that every rank can apply all of them."""
        ...

    def reduce_failures(self, summary: Tensor) -> Tensor:
        """``[failed roots, longest streak]`` summed and maxed over ranks."""
        ...

    def gather_states(self, state: dict[int, dict[str, Tensor]]) -> dict[int, dict[str, Tensor]] | None:
        """Every rank's per-parameter state (keyed by state-dict position, each block held
        by one rank) merged into one on rank 0; None on the other ranks."""
        ...


@dataclass
class _LocalUpdates:
    updates: list[BlockUpdate]

    def tensors(self) -> list[Tensor]:
        return [item.update for item in self.updates]

    def apply(self, params: list[Tensor]) -> None:
        for item in self.updates:
            item.plan.add_to(params, item.update)


class LocalDistributor:
    """One process owning every block: no communication."""

    rank = 0
    world_size = 1
    balance = 1.0

    def plan_stacks(self, regions: list[Region], params: list[Tensor], frequencies: list[int]) -> list[StackPlan]:
        return stacks_by_placement(regions, params)

    def share_updates(self, updates: list[BlockUpdate]) -> SharedUpdates:
        return _LocalUpdates(updates)

    def reduce_failures(self, summary: Tensor) -> Tensor:
        return summary

    def gather_states(self, state: dict[int, dict[str, Tensor]]) -> dict[int, dict[str, Any]] | None:
        return state
