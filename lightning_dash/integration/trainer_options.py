"""Checking a strategy's own keywords when it is built, with one rule for every front-end.

A keyword that neither DASH nor the strategy's base class takes would otherwise fail only when the model
is wrapped, far from its cause; a sharding keyword given to a data-parallel strategy is pointed to the
FSDP2 one. The strategies pass their base classes, so this module imports no Lightning namespace.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from lightning_dash.optim.config import OPTION_NAMES

#: Keywords of FSDP strategies (and of FSDP2's ``fully_shard``) that mean sharded training, refused by the
#: data-parallel strategies also where DDP takes them in another sense (``mixed_precision``, ``device_mesh``).
SHARDING_OPTIONS = frozenset(
    {
        "sharding_strategy",
        "auto_wrap_policy",
        "cpu_offload",
        "mixed_precision",
        "activation_checkpointing",
        "activation_checkpointing_policy",
        "state_dict_type",
        "device_mesh",
        "reshard_after_forward",
        "shard_modules",
        "data_parallel_size",
        "tensor_parallel_size",
        "save_distributed_checkpoint",
    }
)


def _parameters(functions: Iterable[Callable[..., Any]]) -> set[str]:
    return {name for function in functions for name in inspect.signature(function).parameters} - {"self"}


def _refuse_unknown(options: dict[str, Any], strategy: str, known: set[str]) -> None:
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"{strategy} got unknown option(s) {unknown}; it takes {sorted(known)} "
            f"and the DASH options {sorted(OPTION_NAMES)}"
        )


def check_data_parallel_options(
    options: dict[str, Any],
    strategy: str,
    takes: Iterable[Callable[..., Any]],
    sharded: Iterable[Callable[..., Any]],
    use_instead: str,
) -> None:
    """Refuse a sharding keyword (one of :data:`SHARDING_OPTIONS`, or one only the ``sharded`` strategies'
    constructors take), pointing to ``use_instead``, and then a keyword none of ``takes`` accepts. A value
    of None is "not given" (LightningCLI passes every argument so)."""
    known = _parameters(takes)
    sharding_names = SHARDING_OPTIONS | (_parameters(sharded) - known)
    sharding = sorted(name for name in sharding_names.intersection(options) if options[name] is not None)
    if sharding:
        raise ValueError(
            f"{strategy} is data parallel and does not shard; {sharding} are options of sharded training: "
            f"use {use_instead}"
        )
    _refuse_unknown(options, strategy, known)


def fsdp_options(options: dict[str, Any], strategy: str, base: Callable[..., Any]) -> dict[str, Any]:
    """``options`` for ``base`` (the strategy's ModelParallelStrategy) after refusing a keyword neither DASH
    nor ``base`` takes; ``data_parallel_size`` defaults to every process not in a tensor-parallel group."""
    _refuse_unknown(options, strategy, _parameters([base]) - {"parallelize_fn"})
    return {"data_parallel_size": "auto", "tensor_parallel_size": 1, **options}
