"""Replacing the optimizers of ``configure_optimizers`` by DASH inside a Lightning strategy.

Both strategies convert every real optimizer (Lightning's stand-in for "no optimizer"
is left alone, so such a fit runs as Lightning runs it) and point the learning-rate
schedulers that drove the old optimizer at the new one, which shares its parameter
groups, so the schedules carry on unchanged. This module imports no Lightning
namespace: the strategies pass their namespace's stand-in class.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import wraps
from typing import Any

from torch.optim import Optimizer


def track_scheduler_calls(optimizer: Optimizer, source: Optimizer | None = None) -> None:
    """Mark ``optimizer.step`` the way torch's LR schedulers do, so a scheduler rebound
    to it does not warn that ``optimizer.step()`` was overridden; each step also marks
    ``source`` (the optimizer it was converted from) as stepped, for a scheduler still
    attached to that one."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owners = [weakref.ref(optimizer)] + ([weakref.ref(source)] if source is not None else [])
    function = type(optimizer).step

    @wraps(function)
    def step(*args: Any, **kwargs: Any) -> Any:
        target = owners[0]()
        for owner in owners:
            if (marked := owner()) is not None:
                marked._opt_called = True
        return function(target, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


def swap_optimizers(
    optimizers: list[Optimizer],
    scheduler_configs: list[Any],
    convert: Callable[[Optimizer], Optimizer],
    stand_in: type[Optimizer],
) -> list[Optimizer]:
    """``optimizers`` converted by ``convert`` (instances of ``stand_in``, Lightning's
    optimizer for a module without one, kept), with the schedulers of
    ``scheduler_configs`` rebound to the converted ones."""
    converted = [optimizer if isinstance(optimizer, stand_in) else convert(optimizer) for optimizer in optimizers]
    for config in scheduler_configs:
        scheduler = config.scheduler
        for old, new in zip(optimizers, converted):
            if getattr(scheduler, "optimizer", None) is old and new is not old:
                scheduler.optimizer = new
                track_scheduler_calls(new)
    return converted
