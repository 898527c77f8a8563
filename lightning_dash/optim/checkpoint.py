"""Saving and resuming DASH: the standard torch state-dict layout, checked at load.

``state_dict()`` holds per-parameter copies of every statistic (see
:mod:`~lightning_dash.optim.stacks.state` for the keys) plus a ``dash`` entry with the optimizer-wide counters
and grafting type; with blocks owned by several ranks the ranks' states are merged
first, so a checkpoint does not depend on the world size it was written at.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_dash.optim.layout_keeper import LayoutKeeper
from lightning_dash.optim.routing import ParameterRouting
from lightning_dash.optim.saved_state import (
    LAYOUT_OPTIONS,
    NUMERICS_OPTIONS,
    VECTOR_BUFFERS,
    check_loadable,
    check_same_layout,
    check_same_names,
    restore_entries,
    warn_on_changed_numerics,
    with_state,
)
from lightning_dash.optim.stacks.layout import Layout, export_layout, param_names
from lightning_dash.optim.step.bookkeeping import COUNTERS


class CheckpointedOptimizer(Protocol):
    """What the checkpointer reads and restores of its optimizer (DASH): torch's optimizer
    state, the grafting kind a checkpoint may switch, and the options and counters a state
    dict records (read by name: ``LAYOUT_OPTIONS``, ``NUMERICS_OPTIONS``, ``COUNTERS``).
    Typed by shape, so that this module does not import the optimizer's."""

    param_groups: list[dict[str, Any]]
    state: Any
    grafting: str
    collective_state_dict: bool

    @property
    def inverse_root_method_in_use(self) -> str: ...


class Checkpointer:
    """The state dicts of one :class:`~lightning_dash.optim.DASH` and its resume, held by it.

    Reads the optimizer's public options and counters, packs with torch's own
    ``Optimizer.state_dict`` and exports or rebuilds the stacks through the ``keeper``.

    Args:
        optimizer: the DASH optimizer whose state this is.
        keeper: where its statistics live (stacked, or per parameter in ``optimizer.state``).
        routing: how each parameter is preconditioned (the tile layout at load depends on it).
        current_layout: builds the stacks when there are none (DASH resolves its solver first).
    """

    def __init__(
        self,
        optimizer: CheckpointedOptimizer,
        keeper: LayoutKeeper,
        routing: ParameterRouting,
        current_layout: Callable[[], Layout],
    ) -> None:
        self.optimizer = optimizer
        self.keeper = keeper
        self.routing = routing
        self.current_layout = current_layout
        self._consolidated: dict[int, dict[str, Tensor]] | None = None

    def _flat_params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def owned_tiles(self) -> dict[str, list[tuple[int, int]]]:
        """See :meth:`DASH.owned_tiles <lightning_dash.optim.DASH.owned_tiles>`."""
        layout = self.current_layout()
        owned: dict[str, list[tuple[int, int]]] = {}
        size = layout.block_size
        for stack in layout.stacks:
            for region in stack.plan.regions:
                for tile in region.single_tiles():
                    position = (tile.view.tile_row(tile.row_start, size), tile.col_start // size)
                    owned.setdefault(layout.names[tile.param_index], []).append(position)
        return owned

    def _local_state(self, tiles: bool = False) -> dict[int, dict[str, Tensor]]:
        """This process's statistics keyed by state-dict position (copies). Replicated
        one-dimensional parameters come from rank 0 only; sharded ones from every rank
        (its part). ``tiles``: every block statistic under its own key."""
        layout = self.keeper.layout
        if layout is None:
            return {}
        positions = {id(p): i for i, p in enumerate(self._flat_params())}
        distributor = self.keeper.distributor
        vectors = distributor.rank == 0 or distributor.shards_parameters
        exported = export_layout(layout, include_vectors=vectors, tiles=tiles)
        return {positions[id(layout.params[index])]: entry for index, entry in exported.items()}

    def _extra(self) -> dict[str, Any]:
        """What a state dict carries under ``"dash"``: counters and what the blocks depend on."""
        optimizer = self.optimizer
        extra = {name: getattr(optimizer, name) for name in COUNTERS}
        layout = {name: getattr(optimizer, name) for name in LAYOUT_OPTIONS}
        layout["inverse_root_method"] = optimizer.inverse_root_method_in_use  # what "auto" chose
        numerics = {name: getattr(optimizer, name) for name in NUMERICS_OPTIONS}
        return {**extra, "grafting": optimizer.grafting, **layout, **numerics}

    def _packed(self, entries: dict[int, dict[str, Tensor]]) -> dict[str, Any]:
        return with_state(torch.optim.Optimizer.state_dict(self.optimizer), entries, self._extra())

    def _named(self, packed: dict[str, Any]) -> dict[str, Any]:
        """``packed`` with parameters named instead of numbered (state keys and groups)."""
        names = param_names(self.optimizer.param_groups)
        packed["state"] = {names[position]: entry for position, entry in packed["state"].items()}
        for group in packed["param_groups"]:
            group["params"] = [names[position] for position in group["params"]]
        return packed

    def sharded_state_dict(self) -> dict[str, Any]:
        """See :meth:`DASH.sharded_state_dict <lightning_dash.optim.DASH.sharded_state_dict>`."""
        self.keeper.settle(collective=False)
        flat = self._flat_params()
        entries = self._local_state(tiles=True)
        for position, entry in entries.items():
            for name in VECTOR_BUFFERS:
                if name in entry:
                    entry[name] = self.keeper.distributor.shard_like(flat[position], entry[name])
        return self._named(self._packed(entries))

    def consolidate_state_dict(self) -> None:
        """See :meth:`DASH.consolidate_state_dict <lightning_dash.optim.DASH.consolidate_state_dict>`."""
        self.keeper.settle(collective=True)
        distributor = self.keeper.distributor
        if distributor.world_size == 1:
            return
        if self.keeper.layout is None and any(len(entry) > 1 for entry in self.optimizer.state.values()):
            # Statistics sit in ``optimizer.state`` (a retired layout, or a loaded checkpoint that
            # every rank holds whole): stack them first, so each rank reports only its blocks.
            self.current_layout()
        tiles = distributor.shards_parameters
        flat = self._flat_params()
        # Sharded one-dimensional buffers go as tensors sharded like their parameters: the
        # distributor makes them whole (with every layout of shards, replicas included).
        local = {
            key: {
                name: distributor.shard_like(flat[key], value) if tiles and name in VECTOR_BUFFERS else value.cpu()
                for name, value in entry.items()
            }
            for key, entry in self._local_state(tiles=tiles).items()
        }
        self._consolidated = distributor.gather_states(local)

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`DASH.state_dict <lightning_dash.optim.DASH.state_dict>`."""
        self.keeper.settle(collective=False)
        distributor = self.keeper.distributor
        sharded = distributor.world_size > 1
        if sharded and self.optimizer.collective_state_dict and self._consolidated is None:
            # (Already consolidated on every rank, as Fabric and Lightning do before calling
            # this on rank 0 alone: consolidating again would wait for the other ranks forever.)
            self.consolidate_state_dict()
            if distributor.rank != 0:
                return torch.optim.Optimizer.state_dict(self.optimizer)
        if distributor.shards_parameters and self._consolidated is None:
            return self.sharded_state_dict()
        if sharded and self._consolidated is None:
            raise RuntimeError(
                "DASH state is sharded across ranks: call consolidate_state_dict() on every rank "
                "first, then state_dict() on rank 0"
            )
        entries = self._consolidated if sharded else self._local_state()
        self._consolidated = None
        packed = self._packed(entries)
        return self._named(packed) if distributor.shards_parameters else packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See :meth:`DASH.load_state_dict <lightning_dash.optim.DASH.load_state_dict>`."""
        optimizer = self.optimizer
        local = self.keeper.distributor.local  # sharded one-dimensional buffers: this rank's part
        state_dict = {
            **state_dict,
            "state": {
                key: {name: local(value) if isinstance(value, Tensor) else value for name, value in entry.items()}
                for key, entry in state_dict.get("state", {}).items()
            },
        }
        # "auto" takes a checkpoint of any solver: the roots are recomputed at the next refresh.
        fixed = {name: getattr(optimizer, name) for name in LAYOUT_OPTIONS if getattr(optimizer, name) != "auto"}
        check_same_layout(state_dict, fixed)
        names = param_names(optimizer.param_groups)
        views = self.routing.views(optimizer.param_groups)
        check_loadable(state_dict, self._flat_params(), views, names, self.keeper.block_size)
        check_same_names(state_dict, optimizer.param_groups)
        self.keeper.roots.discard()
        self.keeper.books.verdicts.discard()
        state_dict = dict(state_dict)
        saved_state = state_dict.pop("state")
        extra = state_dict.pop("dash", {})
        self.keeper.layout = None
        self._consolidated = None
        kept = list(optimizer.param_groups)
        torch.optim.Optimizer.load_state_dict(optimizer, {**state_dict, "state": {}})
        # torch puts new group dictionaries in place; the loaded values go into the old ones
        # instead, which the optimizer DASH was converted from and its schedulers still edit.
        for index, (old, loaded) in enumerate(zip(kept, optimizer.param_groups)):
            if old is not loaded:
                old.clear()
                old.update(loaded)
                optimizer.param_groups[index] = old
        optimizer.state.clear()
        optimizer.state.update(restore_entries(saved_state, state_dict["param_groups"], self._flat_params()))
        # torch.distributed.checkpoint keeps only "state" and "param_groups": without the
        # "dash" entry the counters and grafting type stay as they are.
        for name in COUNTERS:
            setattr(optimizer, name, int(extra.get(name, getattr(optimizer, name))))
        warn_on_changed_numerics(extra, {name: getattr(optimizer, name) for name in NUMERICS_OPTIONS})
        saved_grafting = extra.get("grafting", optimizer.grafting)
        if saved_grafting != optimizer.grafting:
            warnings.warn(
                f"DASH.load_state_dict: the checkpoint's grafting={saved_grafting!r} replaces "
                f"grafting={optimizer.grafting!r} (the checkpoint wins, as after a GraftingSchedule switch)",
                stacklevel=3,
            )
        optimizer.grafting = saved_grafting


class CheckpointMethods:
    """DASH's checkpoint methods, each handing the call to the optimizer's :class:`Checkpointer`
    (``self._checkpointer``): the public surface, with what each promises, apart from the step."""

    _checkpointer: Checkpointer

    def owned_tiles(self) -> dict[str, list[tuple[int, int]]]:
        """The blocks this process owns, as ``(i, j)`` tile positions per parameter name
        (the keys of :meth:`sharded_state_dict`); plans the ownership if not done yet."""
        return self._checkpointer.owned_tiles()

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's share of the state, in the form that does not depend on the world size.

        ``state`` is keyed by parameter name (the groups' ``param_names``, else the
        position). Every statistic of a block sits under its own key (``left_factor_i_j``,
        ``momentum_i_j``, ``root_valid_i_j``, ...) in the dict of the block's owner only;
        the buffers of one-dimensional parameters are shaped like them (sharded like
        them when parameters are sharded DTensors); every rank holds every ``step``.
        Not collective: each rank writes its share (``torch.distributed.checkpoint``),
        and :meth:`load_state_dict` takes any union of shares at any world size.
        """
        return self._checkpointer.sharded_state_dict()

    def consolidate_state_dict(self) -> None:
        """Collect every rank's blocks on rank 0 so that its :meth:`state_dict` is complete.

        Collective: call it on every rank (Lightning's strategies do before saving).
        """
        self._checkpointer.consolidate_state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Standard torch layout: ``state`` keyed by parameter index, plus ``param_groups``.

        Every statistic, root, momentum and step count is a per-parameter copy. With
        blocks owned by several ranks, :meth:`consolidate_state_dict` must run first
        (on every rank); the complete state is then returned on rank 0. With
        ``collective_state_dict`` set, this call consolidates by itself (every rank
        must call it) and the other ranks get only the step counts. With parameters
        sharded across ranks (FSDP2) the state is in the world-size-free form of
        :meth:`sharded_state_dict`: this rank's share, or after consolidation the
        whole state on rank 0.
        """
        return self._checkpointer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`, onto the current parameters' devices.

        Tensors keep their saved dtype (statistics stay float32 for low-precision
        parameters); the stacks are rebuilt at the next step. The parameter-group
        dictionaries stay the same objects (their values are loaded into them), so an
        optimizer DASH was converted from, and its schedulers, keep driving it.
        """
        self._checkpointer.load_state_dict(state_dict)
