"""Saving and resuming DASH: the standard torch state-dict layout, checked at load.

``state_dict()`` holds per-parameter copies of every statistic (see
:mod:`.state` for the keys) plus a ``dash`` entry with the optimizer-wide counters
and grafting type; with blocks owned by several ranks the ranks' states are merged
first, so a checkpoint does not depend on the world size it was written at.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.blocks import matrix_shape
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


def restore_entries(saved_state: dict[Any, dict[str, Tensor]], saved_groups: list[dict[str, Any]],
                    params: list[Tensor]) -> dict[Tensor, dict[str, Tensor]]:
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
DASH_GROUP_KEYS = ("grafting_beta2", "grafting_epsilon", "precondition_frequency",
                   "start_preconditioning_step", "shampoo_blend")


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
        side = min(block_size, shape[0] - i * block_size) if key.startswith("left") else (
            min(block_size, shape[1] - j * block_size))
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
