"""DASH's state in Composer checkpoints, in the form ``torch.distributed.checkpoint.state_dict`` expects.

Composer saves and loads optimizers with torch's ``get_optimizer_state_dict`` and
``set_optimizer_state_dict``. Both expect ``state`` and the groups' ``params`` keyed by
position (they re-key them to fully qualified names themselves), call
``optimizer.state_dict()`` on every rank, and shape what it returns by the checkpoint type:

- **sharded** (FSDP2's default, ``torch.distributed.checkpoint`` folders): every rank
  writes its dict. DASH returns its share (:meth:`DASH.sharded_state_dict`): the tiles of
  the blocks it owns and its rows of the one-dimensional buffers. At load the template is
  the share a fresh optimizer owns at the new world size, so each rank reads exactly its
  blocks from a checkpoint of any world size.
- **whole** (one file: Composer's DDP, or ``FSDP2Config(state_dict_type="full")``): torch
  keeps rank 0's dict only, so DASH gathers every block there (collective). A whole load
  distributes the file into a template first, which must hold exactly the file's keys:
  torch drops scalars the template lacks with a ``KeyError``, and a template key the file
  lacks would keep the template's value as if it were loaded. The keys the file holds are
  therefore recorded when it is written (:attr:`CheckpointForm.saved_keys`, stored by the
  Dash algorithm, which Composer loads before the optimizer), and the template is made of
  them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim import DASH
from lightning_dash.optim.stacks import param_names

__all__ = ["CheckpointForm", "KeyRecord", "by_position"]

#: The keys of a whole state's per-parameter entries: position -> key -> (shape, dtype
#: name) of a tensor, or None for any other value.
KeyRecord = dict[int, dict[str, tuple[tuple[int, ...], str] | None]]


def by_position(packed: dict[str, Any], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``packed`` (a DASH state dict) with its state and groups keyed by parameter position,
    where DASH keyed them by name (parameters sharded by FSDP2)."""
    index: dict[Any, int] = {name: position for position, name in enumerate(param_names(param_groups))}
    packed["state"] = {index.get(key, key): entry for key, entry in packed["state"].items()}
    for group in packed["param_groups"]:
        group["params"] = [index.get(key, key) for key in group["params"]]
    return packed


def record_keys(state: dict[int, dict[str, Any]]) -> KeyRecord:
    """The keys, shapes and dtypes of a state dict's per-parameter entries."""
    return {
        position: {
            key: (tuple(value.shape), str(value.dtype).removeprefix("torch.")) if isinstance(value, Tensor) else None
            for key, value in entry.items()
        }
        for position, entry in state.items()
    }


def _placeholders(record: KeyRecord, device: torch.device) -> dict[int, dict[str, Any]]:
    """Empty tensors (on ``device``, as torch wants every non-scalar of a template) under
    the recorded keys; the whole load replaces each by the file's value."""
    return {
        position: {
            key: 0 if kind is None else torch.empty(kind[0], dtype=getattr(torch, kind[1]), device=device)
            for key, kind in entry.items()
        }
        for position, entry in record.items()
    }


class CheckpointForm:
    """Answers ``state_dict()`` for a DASH optimizer that Composer checkpoints.

    Installed on the optimizer as its ``state_dict`` (torch's checkpoint functions call
    the optimizer's own method; the class keeps its name, which Composer's checkpoints use
    as the optimizer's key).

    Args:
        optimizer: the DASH optimizer the Dash algorithm installed.
        sharded_files: whether checkpoints are ``torch.distributed.checkpoint`` folders
            written by every rank (FSDP2's ``state_dict_type="sharded"``), else one file.
    """

    def __init__(self, optimizer: DASH, sharded_files: bool) -> None:
        self.optimizer = optimizer
        self.sharded_files = sharded_files
        #: The keys of the whole state this rank last returned (rank 0's are complete).
        self.saved_keys: KeyRecord | None = None
        #: True while Composer loads a checkpoint (from ``Event.BEFORE_LOAD`` to ``Event.AFTER_LOAD``).
        self.loading = False
        self._expected: KeyRecord | None = None
        # Under DDP the blocks are gathered inside state_dict(); under FSDP2 whole files too.
        optimizer.collective_state_dict = True
        optimizer.state_dict = self.state_dict  # type: ignore[method-assign]

    def expect_whole_file(self, keys: KeyRecord) -> None:
        """The next load is of a whole file holding ``keys``: templates are made of them."""
        self._expected = keys

    def finish_loading(self) -> None:
        self.loading = False
        self._expected = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's dict for torch's checkpoint functions, keyed by position."""
        optimizer = self.optimizer
        if self.loading and self._expected is not None:
            packed = torch.optim.Optimizer.state_dict(optimizer)
            device = next(p for group in optimizer.param_groups for p in group["params"]).device
            packed["state"] = _placeholders(self._expected, device)
            return packed
        if self.sharded_files or self.loading:
            # (A load's template: what this rank owns. Gathering on rank 0 would leave the
            # other ranks without a template.)
            return by_position(optimizer.sharded_state_dict(), optimizer.param_groups)
        packed = by_position(DASH.state_dict(optimizer), optimizer.param_groups)
        self.saved_keys = record_keys(packed["state"])
        return packed
