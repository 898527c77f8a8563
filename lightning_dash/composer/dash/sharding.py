"""Which FSDP a Composer trainer uses, and the checks Dash makes once FSDP2 has sharded the model.

Composer builds its ``State`` (with the parallelism config) before ``Event.INIT`` and
applies FSDP2 after it: each direct child of the ``ComposerModel`` is passed to
``fully_shard``, the optimizer's parameters are swapped for the sharded DTensors by name
(other group keys are kept), and then ``Event.BEFORE_LOAD`` runs (``Event.AFTER_LOAD``
when ``load_monolith_rank0_only`` makes Composer shard after loading).
"""

from __future__ import annotations

from composer.core import State
from torch.distributed.tensor import DTensor

from lightning_dash.distributed.placements import check_sharded_placements
from lightning_dash.optim import DASH
from lightning_dash.optim.stacks import param_names

__all__ = ["check_composer_sharding", "fsdp_version", "refuse_fsdp1"]


def fsdp_version(state: State) -> int:
    """0 without FSDP (DDP or one process), 1 for FSDP1 (``FSDPConfig``), 2 for FSDP2
    (``FSDP2Config``, or a dict with ``FSDP_VERSION=2``)."""
    return int(state.fsdp_config_version or 0)


def refuse_fsdp1(state: State) -> None:
    """Refuse FSDP1 at ``Event.INIT``, before Composer wraps the model (where, on a
    machine without CUDA, FSDP1 would stop asking for a GPU)."""
    if fsdp_version(state) == 1:
        raise ValueError(
            "Dash does not support FSDP1 (FSDPConfig, or a dict parallelism_config without FSDP_VERSION=2): "
            "use FSDP2, parallelism_config={'fsdp': FSDP2Config(...)} from composer.utils"
        )


def check_composer_sharding(dash: DASH) -> None:
    """Refuse parameters Composer's FSDP2 left whole, naming the first, and any that are
    not FSDP2 row shards over one mesh dimension (tensor parallelism, HSDP)."""
    params = [p for group in dash.param_groups for p in group["params"]]
    names = param_names(dash.param_groups)
    for name, param in zip(names, params):
        if not isinstance(param, DTensor):
            raise ValueError(
                f"Dash under FSDP2: {name} is not sharded (a plain tensor). Composer shards each child "
                "module of the ComposerModel, so a parameter the ComposerModel holds directly stays "
                "whole: move it into a child module"
            )
    check_sharded_placements(params, names)
