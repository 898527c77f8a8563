"""Saving and resuming DASH: the standard torch state-dict layout, checked at load.

``state_dict()`` holds per-parameter copies of every statistic (see
:mod:`.state` for the keys) plus a ``dash`` entry with the optimizer-wide counters
and grafting type; with blocks owned by several ranks the ranks' states are merged
first, so a checkpoint does not depend on the world size it was written at.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.blocks import matrix_shape
from lightning_dash.optim.distributor import BlockDistributor
from lightning_dash.optim.layout import Layout, export_layout, param_names
from lightning_dash.optim.state import (
    FACTOR_KEYS,
    GRAFTING_RMS,
    LEGACY_SECOND_MOMENT,
    ROOT_FAILURES,
    ROOT_VALID,
    grid_shape,
)

#: The optimizer-wide counters a state dict carries under ``"dash"`` (with ``grafting``).
COUNTERS = ("root_failure_count", "nonfinite_grad_skips", "nonfinite_update_skips")


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


def check_loadable(state_dict: dict, params: list[Tensor], names: list[str], block_size: int) -> None:
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
        _check_tiles(entry, param, name, block_size)


def _check_tiles(entry: dict, param: Tensor, name: str, block_size: int) -> None:
    if param.dim() < 2 or param.numel() == 0:
        return
    shape = matrix_shape(param.shape)
    rows, cols = grid_shape(shape, block_size)
    for item, value in entry.items():
        key, _, tile = item.rpartition("_")
        key, _, row = key.rpartition("_")
        if key not in FACTOR_KEYS:
            continue
        i, j = int(row), int(tile)
        side = (
            min(block_size, shape[0] - i * block_size)
            if key.startswith("left")
            else (min(block_size, shape[1] - j * block_size))
        )
        if i >= rows or j >= cols or tuple(value.shape) != (side, side):
            raise ValueError(
                f"load_state_dict: saved {item} of {name} {tuple(value.shape)} does not fit "
                f"block_size={block_size} for a parameter of shape {tuple(param.shape)}; was it "
                "saved with another block_size or for another model?"
            )
    for item in (ROOT_VALID, ROOT_FAILURES):
        if item in entry and tuple(entry[item].shape) != (rows, cols):
            raise ValueError(
                f"load_state_dict: saved {item} of {name} has a {tuple(entry[item].shape)} tile grid, "
                f"block_size={block_size} gives {(rows, cols)}; was it saved with another block_size?"
            )


def upgrade_entry(entry: dict) -> dict:
    """An older per-parameter entry in today's layout: the grafting second moment
    becomes its square root (factors without a saved scale are taken as unscaled)."""
    if LEGACY_SECOND_MOMENT in entry and GRAFTING_RMS not in entry:
        entry = dict(entry)
        entry[GRAFTING_RMS] = entry.pop(LEGACY_SECOND_MOMENT).clamp_min(0).sqrt()
    return entry


class DashStateDict(torch.optim.Optimizer):
    """The state_dict and resume logic of :class:`~lightning_dash.optim.DASH` (its base class).

    Relies on the optimizer's layout (``_layout``, ``_current_layout``), its
    distributor, its root refresher (``roots``, ``_settle_roots``) and its counters.
    """

    _layout: Layout | None
    _distributor: BlockDistributor
    _consolidated: dict[int, dict[str, Tensor]] | None
    collective_state_dict: bool
    block_size: int
    grafting: str

    def _flat_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _current_layout(self) -> Layout:
        raise NotImplementedError

    def _settle_roots(self, collective: bool) -> None:
        raise NotImplementedError

    def _local_state(self) -> dict[int, dict[str, Tensor]]:
        """This process's statistics keyed by state-dict position (copies); the replicated
        one-dimensional parameters come from rank 0 only."""
        if self._layout is None:
            return {}
        positions = {id(p): i for i, p in enumerate(self._flat_params())}
        exported = export_layout(self._layout, self.block_size, include_vectors=self._distributor.rank == 0)
        return {positions[id(self._layout.params[index])]: entry for index, entry in exported.items()}

    def consolidate_state_dict(self) -> None:
        """Collect every rank's blocks on rank 0 so that its :meth:`state_dict` is complete.

        Collective: call it on every rank (Lightning's strategies do before saving).
        """
        self._settle_roots(collective=True)
        if self._distributor.world_size == 1:
            return
        if self._layout is None and any(len(entry) > 1 for entry in self.state.values()):
            # Statistics sit in ``self.state`` (a retired layout, or a loaded checkpoint that
            # every rank holds whole): stack them first, so each rank reports only its blocks.
            self._current_layout()
        local = {
            key: {name: value.cpu() for name, value in entry.items()} for key, entry in self._local_state().items()
        }
        self._consolidated = self._distributor.gather_states(local)

    def state_dict(self) -> dict[str, Any]:
        """Standard torch layout: ``state`` keyed by parameter index, plus ``param_groups``.

        Every statistic, root, momentum and step count is a per-parameter copy. With
        blocks owned by several ranks, :meth:`consolidate_state_dict` must run first
        (on every rank); the complete state is then returned on rank 0. With
        ``collective_state_dict`` set, this call consolidates by itself (every rank
        must call it) and the other ranks get only the step counts.
        """
        self._settle_roots(collective=False)
        sharded = self._distributor.world_size > 1
        if sharded and self.collective_state_dict:
            self.consolidate_state_dict()
            if self._distributor.rank != 0:
                return super().state_dict()
        if sharded and self._consolidated is None:
            raise RuntimeError(
                "DASH state is sharded across ranks: call consolidate_state_dict() on every rank "
                "first, then state_dict() on rank 0"
            )
        entries = self._consolidated if sharded else self._local_state()
        self._consolidated = None
        extra = {name: getattr(self, name) for name in COUNTERS}
        return with_state(super().state_dict(), entries, {**extra, "grafting": self.grafting})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`, onto the current parameters' devices.

        Tensors keep their saved dtype (statistics stay float32 for low-precision
        parameters); the stacks are rebuilt at the next step.
        """
        check_loadable(state_dict, self._flat_params(), param_names(self.param_groups), self.block_size)
        self.roots.discard()
        state_dict = dict(state_dict)
        saved_state = state_dict.pop("state")
        extra = state_dict.pop("dash", {})
        self._layout = None
        self._consolidated = None
        super().load_state_dict({**state_dict, "state": {}})
        self.state.clear()
        self.state.update(restore_entries(saved_state, state_dict["param_groups"], self._flat_params()))
        # torch.distributed.checkpoint keeps only "state" and "param_groups": without the
        # "dash" entry the counters and grafting type stay as they are.
        for name in COUNTERS:
            setattr(self, name, int(extra.get(name, getattr(self, name))))
        saved_grafting = extra.get("grafting", self.grafting)
        if saved_grafting != self.grafting:
            warnings.warn(
                f"DASH.load_state_dict: the checkpoint's grafting={saved_grafting!r} replaces "
                f"grafting={self.grafting!r} (the checkpoint wins, as after a GraftingSchedule switch)",
                stacklevel=2,
            )
        self.grafting = saved_grafting
