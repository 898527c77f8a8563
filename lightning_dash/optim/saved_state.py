"""What a DASH state dict holds beyond torch's layout, and whether DASH can resume from one.

The options a checkpoint records under ``"dash"`` and the warnings when a resumed optimizer
differs; per-parameter entries merged in and restored; the checks at load that reject another
optimizer's state, another block layout, other parameter names or non-finite statistics; and
the upgrade of entries written by older versions. Pure functions on state dicts.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.stacks.blocks import MatrixView
from lightning_dash.optim.stacks.layout import param_names
from lightning_dash.optim.stacks.state import (
    FACTOR_KEYS,
    GRAFTING_RMS,
    LEGACY_SECOND_MOMENT,
    MOMENTUM,
    ROOT_FAILURES,
    ROOT_VALID,
)

#: Options the saved statistics depend on, also carried under ``"dash"`` and checked at load.
LAYOUT_OPTIONS = ("block_size", "inverse_root_method")
#: Optimizer-wide options that shape the step, carried under ``"dash"`` (since version 0.5): a resumed
#: run whose optimizer has other values is told which, and what to pass to keep the checkpoint's.
NUMERICS_OPTIONS = ("root_order", "nesterov", "lr_scale", "grafting_norm", "root_schedule", "eigh_dtype")
#: What a checkpoint written before an option was recorded trained with (version 0.5 saved no grafting_norm,
#: 0.6 no root_schedule or eigh_dtype; 0.5 decomposed in float32, 0.6 in float64).
UNRECORDED_NUMERICS = {"grafting_norm": "frobenius", "root_schedule": "from_start", "eigh_dtype": "float64"}
#: What version 0.4 used for them (``lr_scale`` 8 for optimizers converted from Adam or AdamW).
VERSION_04_NUMERICS = {
    "root_order": 2,
    "nesterov": True,
    "lr_scale": "8.0 if converted from Adam/AdamW, else 1.0",
    "grafting_norm": "'frobenius'",
    "root_schedule": "'from_start'",
    "eigh_dtype": "'float32'",
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
