"""Checking a strategy's own keywords when it is built, with one rule for every front-end.

A keyword that neither DASH nor the strategy's base class takes would otherwise fail only when the model
is wrapped, far from its cause; a sharding keyword given to a data-parallel strategy is pointed to the
FSDP2 one. The strategies pass their base classes, so this module imports no Lightning namespace.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from lightning_dash.optim.config import OPTION_NAMES
from lightning_dash.optim.validation import check_choice, did_you_mean

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


#: How a strategy may start its processes. Not ``"forkserver"``: Lightning's launcher copies the module out of
#: shared memory only under ``"spawn"``, so under a fork server every CPU rank would step one shared copy of the
#: parameters (plain ``DDPStrategy(start_method="forkserver")`` trains wrong on CPU too).
START_METHODS = ("popen", "spawn", "fork")


def check_start_method(value: str) -> str:
    """``value`` if it is one of :data:`START_METHODS`, else ``ValueError`` naming ``start_method``."""
    return check_choice("start_method", value, START_METHODS)


def _parameters(functions: Iterable[Callable[..., Any]]) -> set[str]:
    return {
        name
        for function in functions
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    } - {"self"}


def refuse_unknown(options: dict[str, Any], front_end: type, known: Iterable[str] = ()) -> None:
    """``TypeError`` naming each keyword of ``options`` that neither ``front_end``'s constructor nor ``known``
    (its base's keywords) takes, with the closest name for each, then everything the front-end takes."""
    takes = (_parameters([front_end.__init__]) | set(known)) - set(OPTION_NAMES)
    unknown = sorted(set(options) - takes - set(OPTION_NAMES))
    if unknown:
        hint = did_you_mean(unknown, takes | set(OPTION_NAMES))
        raise TypeError(
            f"{front_end.__name__} got unknown option(s) {unknown}{hint} (it takes {sorted(takes)} "
            f"and the DASH options {sorted(OPTION_NAMES)})"
        )


def check_data_parallel_options(
    options: dict[str, Any],
    strategy: type,
    takes: Iterable[Callable[..., Any]],
    sharded: Iterable[Callable[..., Any]],
    use_instead: str,
) -> None:
    """Refuse a sharding keyword (one of :data:`SHARDING_OPTIONS`, or one only the ``sharded`` strategies'
    constructors take), pointing to ``use_instead``, then a keyword none of ``takes`` accepts, then a
    ``start_method`` outside :data:`START_METHODS`. A value of None is "not given" (LightningCLI passes
    every argument so)."""
    known = _parameters(takes)
    sharding_names = SHARDING_OPTIONS | (_parameters(sharded) - known)
    sharding = sorted(name for name in sharding_names.intersection(options) if options[name] is not None)
    if sharding:
        raise ValueError(
            f"{strategy.__name__} is data parallel and does not shard; {sharding} are options of sharded training: "
            f"use {use_instead}"
        )
    refuse_unknown(options, strategy, known)
    if options.get("start_method") is not None:
        check_start_method(options["start_method"])


def check_parallel_size(name: str, value: Any) -> int | str:
    """``value`` if it is an integer >= 1 or ``"auto"``, else ``ValueError`` naming the option ``name``."""
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise ValueError(f"{name} must be an integer >= 1 or 'auto', got {value!r}")


def fsdp_options(options: dict[str, Any], strategy: type, base: Callable[..., Any]) -> dict[str, Any]:
    """``options`` for ``base`` (the strategy's ModelParallelStrategy) after refusing a keyword neither DASH
    nor ``base`` takes, and a mesh size that is not an integer >= 1 or ``"auto"``; ``data_parallel_size``
    defaults to every process not in a tensor-parallel group."""
    refuse_unknown(options, strategy, _parameters([base]) - {"parallelize_fn"})
    options = {"data_parallel_size": "auto", "tensor_parallel_size": 1, **options}
    for name in ("data_parallel_size", "tensor_parallel_size"):
        options[name] = check_parallel_size(name, options[name])
    return options
