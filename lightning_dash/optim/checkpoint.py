"""Saving and resuming DASH: the standard torch state-dict layout, checked at load.

``state_dict()`` holds per-parameter copies of every statistic (see
:mod:`~lightning_dash.optim.stacks.state` for the keys) plus a ``dash`` entry with the optimizer-wide counters
and grafting type; with blocks owned by several ranks the ranks' states are merged
first, so a checkpoint does not depend on the world size it was written at.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_dash.optim.layout_keeper import LayoutKeeper
from lightning_dash.optim.routing import ParameterRouting
from lightning_dash.optim.stacks.blocks import MatrixView
from lightning_dash.optim.stacks.layout import Layout, export_layout, param_names
from lightning_dash.optim.stacks.state import (
    FACTOR_KEYS,
    GRAFTING_RMS,
    LEGACY_SECOND_MOMENT,
    MOMENTUM,
    ROOT_FAILURES,
    ROOT_VALID,
)
from lightning_dash.optim.step.bookkeeping import COUNTERS

if TYPE_CHECKING:
    from lightning_dash.optim.optimizer import DASH

#: Options the saved statistics depend on, also carried under ``"dash"`` and checked at load.
LAYOUT_OPTIONS = ("block_size", "inverse_root_method")
#: Optimizer-wide options that shape the step, carried under ``"dash"`` (since version 0.5): a resumed
#: run whose optimizer has other values is told which, and what to pass to keep the checkpoint's.
NUMERICS_OPTIONS = ("root_order", "nesterov", "lr_scale", "grafting_norm")
#: What a checkpoint written before an option was recorded trained with (version 0.5 saved no grafting_norm).
UNRECORDED_NUMERICS = {"grafting_norm": "frobenius"}
#: What version 0.4 used for them (``lr_scale`` 8 for optimizers converted from Adam or AdamW).
VERSION_04_NUMERICS = {
    "root_order": 2,
    "nesterov": True,
    "lr_scale": "8.0 if converted from Adam/AdamW, else 1.0",
    "grafting_norm": "'frobenius'",
}


def warn_on_changed_numerics(extra: dict[str, Any], current: dict[str, Any]) -> None:
    """Say which step-shaping options differ from the checkpoint's (or that a checkpoint from
    version 0.4 or older records none of them), naming the values that reproduce its training."""
    if not extra:  # torch.distributed.checkpoint keeps no "dash" entry: nothing to compare with
        return
    recorded = {name: extra[name] for name in NUMERICS_OPTIONS if name in extra}
    if not recorded:
        keep = ", ".join(f"{name}={value}" for name, value in VERSION_04_NUMERICS.items())
        warnings.warn(
            "DASH.load_state_dict: this checkpoint was written by lightning-dash 0.4 or older and does not "
            f"record {list(NUMERICS_OPTIONS)}; this optimizer continues with "
            f"{', '.join(f'{k}={v!r}' for k, v in current.items())}. To continue as version 0.4 trained, pass "
            f"{keep} (per-group options such as precondition_frequency and epsilon come from the checkpoint)",
            stacklevel=4,
        )
        return
    saved = {**UNRECORDED_NUMERICS, **recorded}
    changed = {name: value for name, value in saved.items() if current[name] != value}
    if changed:
        warnings.warn(
            "DASH.load_state_dict: the checkpoint was trained with "
            f"{', '.join(f'{k}={v!r}' for k, v in changed.items())}; this optimizer continues with "
            f"{', '.join(f'{k}={current[k]!r}' for k in changed)} (pass the checkpoint's values to keep them)",
            stacklevel=4,
        )


def with_state(packed: dict[str, Any], entries: dict[int, dict[str, Tensor]], extra: dict[str, Any]) -> dict[str, Any]:
    """``packed`` (torch's ``Optimizer.state_dict()``) with DASH's per-parameter
    ``entries`` merged in, step counters copied, and ``extra`` under ``"dash"``."""
    for key, entry in entries.items():
        packed["state"][key] = {**packed["state"].get(key, {}), **entry}
    for key, entry in packed["state"].items():
        if isinstance(entry.get("step"), Tensor):  # a copy: the live counter keeps counting
            packed["state"][key] = {**entry, "step": entry["step"].clone()}
    packed["dash"] = extra
    return packed


def restore_entries(
    saved_state: dict[Any, dict[str, Tensor]], saved_groups: list[dict[str, Any]], params: list[Tensor]
) -> dict[Tensor, dict[str, Tensor]]:
    """Saved per-parameter entries placed on the current parameters' devices (steps on
    the CPU). As torch's optimizers do, the saved groups' parameter keys (indices, or
    names from ``torch.distributed.checkpoint``) name the current parameters by position."""
    saved_keys = [key for group in saved_groups for key in group["params"]]
    by_key = dict(zip(saved_keys, params))
    restored = {}
    for key, entry in saved_state.items():
        param = by_key[key]
        restored[param] = {
            name: value.to("cpu") if name == "step" else value.to(param.device)
            for name, value in upgrade_entry(entry).items()
        }
    return restored


#: Per-group keys every DASH state dict carries (an AdamW state dict has none of them).
DASH_GROUP_KEYS = (
    "grafting_beta2",
    "grafting_epsilon",
    "precondition_frequency",
    "start_preconditioning_step",
    "shampoo_blend",
)


def check_loadable(
    state_dict: dict, params: list[Tensor], views: list[MatrixView | None], names: list[str], block_size: int
) -> None:
    """Reject, with a ``ValueError`` naming the problem, a state dict DASH cannot resume
    from: another optimizer's, one whose block layout differs from ``block_size`` for
    these ``params`` (in state-dict order), or one holding non-finite statistics.
    Checked at load so that nothing fails, or NaNs the model, steps later."""
    for position, group in enumerate(state_dict.get("param_groups", [])):
        missing = [key for key in DASH_GROUP_KEYS if key not in group]
        if missing:
            raise ValueError(
                f"load_state_dict: param_groups[{position}] lacks the DASH keys {missing}: this is not "
                "a DASH state dict (to start DASH from another optimizer's run, load the model's "
                "weights only)"
            )
    saved_keys = [key for group in state_dict.get("param_groups", []) for key in group["params"]]
    position_of = {key: position for position, key in enumerate(saved_keys)}
    for key, entry in state_dict.get("state", {}).items():
        if key not in position_of or position_of[key] >= len(params):
            continue  # torch's own checks report a parameter-count mismatch
        position = position_of[key]
        param, name = params[position], names[position]
        for item, value in entry.items():
            if isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"load_state_dict: saved {item} of {name} holds non-finite values")
        _check_tiles(entry, views[position], param, name, block_size)


def check_same_layout(state_dict: dict, current: dict[str, Any]) -> None:
    """Reject a state dict written with another block size or root solver (when it says)."""
    saved = state_dict.get("dash", {})
    for name, value in current.items():
        if name in saved and saved[name] != value:
            raise ValueError(
                f"load_state_dict: the checkpoint was written with {name}={saved[name]!r} and this "
                f"optimizer has {name}={value!r}; its statistics and roots do not carry over: create "
                f"the optimizer with {name}={saved[name]!r}"
            )


def check_same_names(state_dict: dict, param_groups: list[dict[str, Any]]) -> None:
    """Reject a state dict whose parameters are named and named differently from ``param_groups``'."""
    saved = [key for group in state_dict.get("param_groups", []) for key in group["params"]]
    if not saved or not all(isinstance(key, str) for key in saved):
        return
    current = param_names(param_groups)
    if not all("param_names" in group for group in param_groups) and not saved[0].startswith("param_groups["):
        return  # names on one side only: positions decide, as in torch
    for position, (was, now) in enumerate(zip(saved, current)):
        if was != now:
            raise ValueError(
                f"load_state_dict: parameter {position} is {was!r} in the checkpoint and {now!r} here: "
                "the checkpoint is of another model (or the parameters are in another order)"
            )
    if len(saved) != len(current):
        raise ValueError(
            f"load_state_dict: the checkpoint has {len(saved)} parameters and this optimizer {len(current)}: "
            "the checkpoint is of another model"
        )


def _check_tiles(entry: dict, view: MatrixView | None, param: Tensor, name: str, block_size: int) -> None:
    if view is None:
        return
    shape = view.shape
    rows, cols = view.grid(block_size)
    for item, value in entry.items():
        key, _, tile = item.rpartition("_")
        key, _, row = key.rpartition("_")
        if key not in FACTOR_KEYS:
            continue
        i, j = int(row), int(tile)
        side = view.tile_height(i, block_size) if key.startswith("left") else min(block_size, shape[1] - j * block_size)
        if i >= rows or j >= cols or tuple(value.shape) != (side, side):
            raise ValueError(
                f"load_state_dict: saved {item} of {name} {tuple(value.shape)} does not fit "
                f"block_size={block_size} for a parameter of shape {tuple(param.shape)}; was it "
                "saved with another block_size, precondition or split_rows, or for another model?"
            )
    for item in (ROOT_VALID, ROOT_FAILURES):
        if item in entry and tuple(entry[item].shape) != (rows, cols):
            raise ValueError(
                f"load_state_dict: saved {item} of {name} has a {tuple(entry[item].shape)} tile grid, "
                f"block_size={block_size} gives {(rows, cols)}; was it saved with another block_size?"
            )


#: The per-parameter buffers of a one-dimensional parameter, shaped like it.
VECTOR_BUFFERS = (MOMENTUM, GRAFTING_RMS)


def upgrade_entry(entry: dict) -> dict:
    """An older per-parameter entry in today's layout: the grafting second moment
    becomes its square root (factors without a saved scale are taken as unscaled)."""
    if LEGACY_SECOND_MOMENT in entry and GRAFTING_RMS not in entry:
        entry = dict(entry)
        entry[GRAFTING_RMS] = entry.pop(LEGACY_SECOND_MOMENT).clamp_min(0).sqrt()
    return entry


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
        self, optimizer: DASH, keeper: LayoutKeeper, routing: ParameterRouting, current_layout: Callable[[], Layout]
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
