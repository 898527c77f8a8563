"""DASH state in distributed checkpoints, whatever the world size at save and at load.

Each rank writes its share of :meth:`DASH.sharded_state_dict` (the blocks it owns,
its rows of the one-dimensional buffers) with ``torch.distributed.checkpoint``. At
load, each rank asks only for what it owns under the current world size: the blocks
of its ownership plan and its rows of the one-dimensional buffers (resharded by
``torch.distributed.checkpoint``), so no rank reads the whole optimizer state and no
consolidation step is needed. A full single-file checkpoint holds the same form,
gathered on rank 0; every rank keeps only its blocks when loading it.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from lightning_dash.integration.checkpoint_files import (
    METADATA_FILE,
    is_distributed_checkpoint,
    load_file,
)
from lightning_dash.optim import DASH
from lightning_dash.optim.stacks import param_names

_TILE = re.compile(r"^(?P<item>[a-z_]+)_(?P<i>\d+)_(?P<j>\d+)$")


def name_parameters(optimizer: DASH, module: nn.Module) -> bool:
    """Name the parameters of ``optimizer``'s groups after ``module``'s (``param_names``,
    as torch's named parameter groups), so checkpoints key the state by name; returns
    whether it did (every parameter must belong to ``module``; groups already named stay)."""
    if all("param_names" in group for group in optimizer.param_groups):
        return True
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        return False
    for group in optimizer.param_groups:
        group["param_names"] = [names[id(p)] for p in group["params"]]
    return True


def full_state(optimizer: DASH) -> dict[str, Any] | None:
    """The whole world-size-free state on rank 0 (None elsewhere). Collective."""
    optimizer.consolidate_state_dict()
    if optimizer.distributor.rank != 0:
        optimizer.state_dict()  # clears what consolidation left on this rank
        return None
    return optimizer.state_dict()


def checkpoint_state(optimizer: DASH, distributed: bool) -> dict[str, Any]:
    """What a checkpoint holds for ``optimizer``: this rank's share for a distributed
    checkpoint, the whole state (rank 0; empty elsewhere) for a single file."""
    if distributed:
        return optimizer.sharded_state_dict()
    return full_state(optimizer) or {}


def optimizer_template(optimizer: DASH, metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
    """What this rank loads of the optimizer state saved under ``prefix`` in a distributed
    checkpoint whose ``state_dict_metadata`` is ``metadata``: every step count, the
    blocks it owns, its rows of the one-dimensional buffers, and the groups and counters."""
    owned = {name: set(tiles) for name, tiles in optimizer.owned_tiles().items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_name = dict(zip(param_names(optimizer.param_groups), params))
    distributor = optimizer.distributor
    state: dict[str, dict[str, torch.Tensor]] = {}
    head = f"{prefix}.state."
    for key, item_metadata in metadata.items():
        if not key.startswith(head) or not isinstance(item_metadata, TensorStorageMetadata):
            continue
        name, item = key[len(head) :].rsplit(".", 1)
        dtype = item_metadata.properties.dtype
        tile = _TILE.match(item)
        if tile is not None:
            if (int(tile["i"]), int(tile["j"])) not in owned.get(name, set()):
                continue
            value = torch.empty(item_metadata.size, dtype=dtype)
        elif item == "step" or name not in by_name:
            value = torch.empty(item_metadata.size, dtype=dtype)
        else:  # a one-dimensional parameter's buffer, sharded like the parameter
            param = by_name[name]
            local = torch.empty(distributor.local(param).shape, dtype=dtype, device=distributor.local(param).device)
            value = distributor.shard_like(param, local)
        state.setdefault(name, {})[item] = value
    template = optimizer.sharded_state_dict()
    template["state"] = state
    return template


def load_model(module: nn.Module, path: Path, key: str, strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Load ``module``'s weights saved under ``key`` (a distributed checkpoint folder, or a
    full single file, at any world size) and return the rest of the checkpoint: the
    metadata file's contents, or the file without ``key``. ``path`` must have passed
    :func:`~lightning_dash.integration.checkpoint_files.complete_checkpoint`. Collective."""
    if is_distributed_checkpoint(path):
        state = {key: get_model_state_dict(module)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(module, state[key], options=StateDictOptions(strict=strict))
        return load_file(path / METADATA_FILE, weights_only=weights_only)
    checkpoint = load_file(path, mmap=True, map_location="cpu", weights_only=weights_only)
    weights = checkpoint.pop(key)
    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True, strict=strict))
    return checkpoint


def read_whole(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """Everything a distributed checkpoint folder holds, whole, in one dict (its shards
    joined, plus its metadata file's entries): how a run with whole parameters (DDP)
    reads a checkpoint written by sharded ranks. ``path`` must have passed
    :func:`~lightning_dash.integration.checkpoint_files.complete_checkpoint`. Not collective."""
    with tempfile.TemporaryDirectory() as folder:
        whole = Path(folder) / "whole.pt"
        dcp_to_torch_save(str(path), str(whole))
        content = torch.load(whole, map_location="cpu", weights_only=weights_only)
    return {**load_file(path / METADATA_FILE, weights_only=weights_only), **content}


def load_optimizer(optimizer: DASH, path: Path, prefix: str) -> None:
    """Load this rank's part of the optimizer state saved under ``prefix`` in the
    distributed checkpoint folder ``path``. Collective."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if not any(key.startswith(f"{prefix}.") for key in metadata):
        raise KeyError(f"the checkpoint at {path} holds no optimizer state under {prefix!r}")
    template = {prefix: optimizer_template(optimizer, metadata, prefix)}
    dcp.load(template, checkpoint_id=str(path))
    optimizer.load_state_dict(template[prefix])
