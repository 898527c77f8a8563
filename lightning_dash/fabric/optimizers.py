"""What both Fabric strategies do with the user's optimizers, without importing Lightning.

The strategy modules are copied, renamed, for the standalone ``lightning_fabric`` package
(:mod:`lightning_dash.integration.namespaces`); this module is not renamed, so it imports
no Lightning namespace.

* :func:`convert` turns the optimizer given to ``fabric.setup`` into DASH over the same
  parameter-group dictionaries, so a learning-rate scheduler attached to the old
  optimizer keeps editing the learning rates DASH reads (``DASH.load_state_dict`` keeps
  those dictionaries).
* :func:`whole_state` consolidates a DASH state collectively, once, whether or not
  ``collective_state_dict`` is set.
* :func:`parameter_names` and :func:`replace_parameters` let an optimizer built before
  FSDP2's ``fully_shard`` (which puts new DTensor parameters in the module) step the
  sharded parameters.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_dash.integration.optimizer_swap import track_scheduler_calls
from lightning_dash.integration.options import ConversionOptions
from lightning_dash.optim import DASH

#: What ``fabric.load`` restores into: a module, an optimizer, or a dict of them and other objects.
LoadTarget = nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None
#: A module's parameters by identity, each with a weak reference (an id alone may be reused) and its name.
ParameterNames = dict[int, tuple[weakref.ref, str]]


def convert(
    conversion: ConversionOptions,
    optimizer: Optimizer,
    *,
    sharded_parameters: bool = False,
    modules: list[nn.Module] | None = None,
) -> DASH:
    """``optimizer`` as DASH with its blocks owned across the ranks (a DASH is kept as it is),
    sharing its parameter-group dictionaries (also after a checkpoint is loaded), so a
    scheduler attached to ``optimizer`` keeps driving it, without warnings. The latest of
    ``modules`` that holds every parameter of ``optimizer`` is the model DASH is told
    about (for ``precondition="hidden"``)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    model = next((m for m in reversed(modules or []) if params <= {id(p) for p in m.parameters()}), None)
    dash = conversion.convert(optimizer, sharded_parameters=sharded_parameters, model=model)
    if dash is not optimizer:
        track_scheduler_calls(dash, source=optimizer)
    return dash


class FabricDashOptimizers:
    """Fabric strategy mixin (put it before the Fabric base class): the scheduler given to
    ``fabric.setup(model, optimizer, scheduler=...)`` is pointed at the DASH its optimizer
    became, the modules set up are remembered (:attr:`trained_modules`) so that DASH
    knows the model its parameters belong to, and a DASH's state is saved whole
    (:func:`whole_state`)."""

    @property
    def trained_modules(self) -> list[nn.Module]:
        """The modules given to ``setup_module`` so far (unwrapped), oldest first."""
        return self.__dict__.setdefault("_trained_modules", [])

    def setup_module(self, module: nn.Module) -> nn.Module:
        self.trained_modules.append(module)
        return super().setup_module(module)  # type: ignore[misc]

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        module, converted, scheduler = super().setup_module_and_optimizers(  # type: ignore[misc]
            module, optimizers, scheduler
        )
        for old, new in zip(optimizers, converted):
            if new is not old and getattr(scheduler, "optimizer", None) is old:
                scheduler.optimizer = new
        return module, converted, scheduler

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, DASH):
            return whole_state(optimizer)
        return super().get_optimizer_state(optimizer)  # type: ignore[misc]


def whole_state(optimizer: DASH) -> dict[str, Any]:
    """``optimizer``'s whole state dict on its rank 0, ``{}`` on the other ranks. Collective.

    Fabric's own rule ("``consolidate_state_dict()`` on every rank, then ``state_dict()``
    on rank 0") hangs with ``collective_state_dict=True``: ``state_dict()`` then
    consolidates by itself, so rank 0 waits alone in a second gather. Here every rank
    consolidates exactly once either way."""
    first = optimizer.distributor.rank == 0
    if optimizer.collective_state_dict:
        state = optimizer.state_dict()  # consolidates, on every rank
    else:
        optimizer.consolidate_state_dict()
        state = optimizer.state_dict() if first else {}
    return state if first else {}


def parameter_names(module: nn.Module) -> ParameterNames:
    """``module``'s parameters by identity, with their names (the first one of a tied parameter)."""
    return {id(param): (weakref.ref(param), name) for name, param in module.named_parameters()}


def replace_parameters(optimizer: Optimizer, before: ParameterNames, module: nn.Module) -> int:
    """Put in ``optimizer``'s groups, in place of each parameter that ``module`` held under
    a name (``before``, taken before sharding), the parameter ``module`` holds under that
    name now; returns how many were replaced. An optimizer with state for a replaced
    parameter (it stepped before the model was set up) is refused: that state is not sharded."""
    current = dict(module.named_parameters(remove_duplicate=False))
    replaced = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for index, param in enumerate(params):
            reference, name = before.get(id(param), (None, ""))
            if reference is None or reference() is not param or current.get(name, param) is param:
                continue
            if optimizer.state.get(param):
                raise ValueError(
                    f"the optimizer holds state for {name!r}, a parameter that sharding replaced: set up the "
                    "model and optimizer before the optimizer steps"
                )
            params[index] = current[name]
            replaced += 1
    return replaced
