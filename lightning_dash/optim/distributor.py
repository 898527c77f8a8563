"""What DASH needs from a data-parallel runtime, as a protocol, and the single-process case.

The optimizer never imports ``torch.distributed``: a trainer integration hands it an
object with the :class:`BlockDistributor` interface (``lightning_dash.distributed``
provides one over a process group). Without one, :class:`LocalDistributor` owns every
block. Methods are collective unless stated otherwise: every rank calls them in the
same order with the same metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_dash.optim.roots.common import working_dtype
from lightning_dash.optim.stacks.blocks import Region, StackPlan, add_stacks
from lightning_dash.optim.stacks.layout import stacks_by_placement


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


#: Turns the gradients of this rank's stacks at the given positions into their updates.
ComputeUpdates = Callable[[list[int], list[Tensor]], list[BlockUpdate]]


class SharedUpdates(Protocol):
    """Every rank's block updates after the exchange, before they are applied."""

    def tensors(self) -> list[Tensor]:
        """Everything :meth:`apply` would add (checked for finiteness first, identically on every rank)."""
        ...

    def apply(self, params: list[Tensor], skip: Tensor) -> None:
        """Add every update to its parameter, or nothing where the 0-d bool ``skip`` is
        set (decided on the device; not collective)."""
        ...


class BlockDistributor(Protocol):
    """Block ownership and the collectives of ZeRO-1-style DASH.

    With ``shards_parameters`` False every rank holds whole parameters and identical
    gradients (DDP); with True each rank holds a row shard of every parameter and of
    its gradient (FSDP2), and the distributor moves gradient rows to block owners.
    """

    rank: int
    world_size: int
    shards_parameters: bool

    @property
    def balance(self) -> float:
        """max / mean of the per-rank cost of the current ownership (not collective)."""
        ...

    def plan_stacks(
        self, regions: list[Region], params: list[Tensor], frequencies: list[int], names: list[str] | None = None
    ) -> list[StackPlan]:
        """The stacks of the blocks this rank owns (not collective: deterministic on every rank).

        ``regions`` are every block region of every parameter, ``frequencies`` the
        ``precondition_frequency`` of each region's parameter (for the cost model),
        ``names`` every parameter's name (for messages).
        Blocks planned before keep their owner.
        """
        ...

    def local(self, tensor: Tensor) -> Tensor:
        """The part of a parameter, or of its gradient, that this rank holds and updates
        elementwise (not collective)."""
        ...

    def local_part(self, param: Tensor, value: Tensor) -> Tensor:
        """This rank's part of ``value``, a tensor shaped like ``param``: whole, or already
        sharded like it (not collective)."""
        ...

    def shard_like(self, param: Tensor, local: Tensor) -> Tensor:
        """``local`` (this rank's part of a tensor shaped like ``param``) as a tensor shaped
        like ``param``: itself when parameters are whole, else a sharded tensor (not collective)."""
        ...

    def exchange_blocks(self, plans: list[StackPlan], params: list[Tensor], compute: ComputeUpdates) -> SharedUpdates:
        """Hand ``compute`` the gradients of this rank's stacks (``plans``), one
        ``(blocks, rows, cols)`` tensor per stack in its state dtype, zero where a parameter
        has no gradient, with the stacks' positions in ``plans``; share the updates it returns
        with every rank that applies them. All stacks at once, or a micro-group at a time
        where a memory budget asks for it."""
        ...

    def reduce_max(self, values: Tensor) -> Tensor:
        """Elementwise maximum over ranks of a small vector (the same vector when every
        rank computed it from the same data)."""
        ...

    def reduce_failures(self, summary: Tensor) -> Tensor:
        """``[failed roots, longest streak]`` summed and maxed over ranks."""
        ...

    def gather_states(self, state: dict[int, dict[str, Tensor]]) -> dict[int, dict[str, Tensor]] | None:
        """Every rank's per-parameter state (keyed by state-dict position, each block held
        by one rank) merged into one on rank 0; None on the other ranks."""
        ...


def masked(update: Tensor, skip: Tensor) -> Tensor:
    """``update``, or zero where the step is skipped (``skip``: a 0-d bool on its device)."""
    return torch.where(skip, 0.0, update)


@dataclass
class _LocalUpdates:
    updates: list[BlockUpdate]

    def tensors(self) -> list[Tensor]:
        return [item.update for item in self.updates]

    def apply(self, params: list[Tensor], skip: Tensor) -> None:
        add_stacks(params, [(item.plan, masked(item.update, skip)) for item in self.updates])


def gather_gradients(plans: list[StackPlan], params: list[Tensor]) -> list[Tensor]:
    """The gradient tiles of ``plans`` from whole parameters (zero where there is no gradient)."""
    stacks = []
    for plan in plans:
        grads = {}
        for region in plan.regions:
            param = params[region.param_index]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            grads[region.param_index] = grad.reshape(region.view.shape)
        stacks.append(plan.gather(grads, dtype=working_dtype(params[plan.regions[0].param_index])))
    return stacks


class WholeParameters(ABC):
    """The :class:`BlockDistributor` methods of ranks that hold whole parameters and
    identical gradients (one process, or DDP after its all-reduce)."""

    shards_parameters = False

    def local(self, tensor: Tensor) -> Tensor:
        return tensor

    def local_part(self, param: Tensor, value: Tensor) -> Tensor:
        return value

    def shard_like(self, param: Tensor, local: Tensor) -> Tensor:
        return local

    def exchange_blocks(self, plans: list[StackPlan], params: list[Tensor], compute: ComputeUpdates) -> SharedUpdates:
        """Every stack at once: the gradients are already here, whole."""
        return self.share_updates(compute(list(range(len(plans))), gather_gradients(plans, params)))

    @abstractmethod
    def share_updates(self, updates: list[BlockUpdate]) -> SharedUpdates:
        """Every rank's block updates, from this rank's (collective where blocks have several owners)."""

    def reduce_max(self, values: Tensor) -> Tensor:
        return values


class LocalDistributor(WholeParameters):
    """One process owning every block: no communication."""

    rank = 0
    world_size = 1
    balance = 1.0

    def plan_stacks(
        self, regions: list[Region], params: list[Tensor], frequencies: list[int], names: list[str] | None = None
    ) -> list[StackPlan]:
        return stacks_by_placement(regions, params)

    def share_updates(self, updates: list[BlockUpdate]) -> SharedUpdates:
        return _LocalUpdates(updates)

    def reduce_failures(self, summary: Tensor) -> Tensor:
        return summary

    def gather_states(self, state: dict[int, dict[str, Tensor]]) -> dict[int, dict[str, Any]] | None:
        return state


#: Looks at the parameters (and their names) DASH is built on without a distributor and returns the
#: distributor they call for, or None. The communication package registers its own
#: (:func:`register_distributor_finder`), so that the optimizer itself never imports one.
DistributorFinder = Callable[[list[Tensor], list[str]], "BlockDistributor | None"]
_FINDERS: list[DistributorFinder] = []


def register_distributor_finder(finder: DistributorFinder) -> None:
    """Have ``finder`` consulted whenever DASH is built without a distributor (once per finder)."""
    if finder not in _FINDERS:
        _FINDERS.append(finder)


def found_distributor(params: list[Tensor], names: list[str]) -> BlockDistributor | None:
    """The distributor the first registered finder returns for ``params``, or None (one process's)."""
    for finder in _FINDERS:
        distributor = finder(params, names)
        if distributor is not None:
            return distributor
    return None
