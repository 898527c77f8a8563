"""DASH as an optimizer of torchtitan's ``OptimizersContainer``, on its FSDP2 and tensor-parallel layouts.

torchtitan builds its optimizers from ``param_groups``: each ``ParamGroupConfig`` matches parameter
names by regex and names an optimizer (``Adam``, ``AdamW``, ``DistMuon``). This container adds
``"DASH"``. A DASH group's ``optimizer_kwargs`` are AdamW's (``lr``, ``betas``, ``eps``,
``weight_decay``) and map onto DASH as :meth:`DASH.from_optimizer <lightning_dash.optim.DASH.from_optimizer>`
maps an AdamW: AdamW's recipe carries over. DASH's own options, which hold for every DASH group of
the run, go in ``optimizer_factory_kwargs_by_name={"DASH": {...}}``, checked when the container is
built, so a wrong one stops the run before its first step, named.

Parameters that torchtitan sharded (DTensors: FSDP2, FSDP2 with tensor parallelism, HSDP) get a
:class:`~lightning_dash.distributed.ShardedDistributor`: each block is owned by one rank, which
gathers its gradient and sends its update back, so the result equals one process stepping the whole
parameters. Whole parameters over several processes get the data-parallel distributor.

The container's state dict is torchtitan's flat, name-keyed form (``state.<name>.<item>``,
``param_groups.<name>.<key>``) over DASH's world-size-free state (one key per block statistic), so
torchtitan's checkpointer saves each rank's blocks and resumes them on another mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.utils import (
    get_flat_optim_state_dict,
    init_optim_state,
    load_flat_optim_state_dict,
)

from lightning_dash.integration.options import ConversionOptions
from lightning_dash.optim import DASH

#: The name a ``ParamGroupConfig`` gives to have its parameters stepped by DASH.
DASH_NAME = "DASH"
#: torchtitan's implementation switches, which DASH does not take (it batches blocks itself).
IMPLEMENTATION_KEYS = ("fused", "foreach")
#: DASH's monitoring figures that :meth:`DashOptimizersContainer.metrics` reports.
MONITORED = ("preconditioned_blocks", "root_failure_count", "nonfinite_grad_skips", "nonfinite_update_skips")
#: Flat keys of DASH's optimizer-wide counters and options (``DASH.state_dict()["dash"]``).
DASH_PREFIX = "dash."


def build_dash(param_groups: list[dict[str, Any]], *, model: nn.Module | None = None, **options: Any) -> DASH:
    """DASH over torchtitan's param groups of one model part: AdamW's recipe in each group, DASH's
    ``options`` for all of them, and the distributor their layout needs (see the module docstring)."""
    conversion = ConversionOptions.build(None, **options)
    groups = [{key: value for key, value in group.items() if key not in IMPLEMENTATION_KEYS} for group in param_groups]
    adamw = torch.optim.AdamW(groups)
    sharded = any(isinstance(param, DTensor) for group in groups for param in group["params"])
    return conversion.convert(adamw, sharded_parameters=sharded, model=model)


class DashOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizers container with ``"DASH"`` among the optimizers a param group may name.

    Build it from its :class:`Config` as torchtitan builds its own container; the parameters a
    ``"DASH"`` group matches are stepped by DASH, the others by the optimizer their group names.
    Pipeline parallelism (several model parts on one rank) is refused when the container is built.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """torchtitan's container configuration; DASH's options go in
        ``optimizer_factory_kwargs_by_name["DASH"]``."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise ValueError(
                f"DashOptimizersContainer steps one model part per rank, got {len(model_parts)}: "
                "pipeline parallelism (parallelism.pipeline_parallel_degree > 1) is not supported with DASH"
            )
        self._model = model_parts[0]
        super().__init__(config, model_parts=model_parts)

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., Optimizer]:
        if name == DASH_NAME:
            model = self._model
            return lambda groups, **options: build_dash(groups, model=model, **options)
        return OptimizersContainer._resolve_optimizer_factory(name)

    def metrics(self) -> dict[str, float]:
        """DASH's monitoring figures, for torchtitan's metrics processor (``extra_metrics``): blocks whose
        roots are in use, rejected roots, and steps skipped for non-finite gradients or updates, summed
        over the DASH optimizers of this rank."""
        figures = {
            "preconditioned_blocks": 0,
            "root_failure_count": 0,
            "nonfinite_grad_skips": 0,
            "nonfinite_update_skips": 0,
        }
        for optimizer in self.optimizers:
            if isinstance(optimizer, DASH):
                for name in figures:
                    figures[name] += getattr(optimizer, name)
        return {f"dash/{name}": float(value) for name, value in figures.items()}

    def state_dict(self) -> dict[str, Any]:
        """The flat, name-keyed state of every optimizer; DASH's is this rank's share of its blocks."""
        flat: dict[str, Any] = {}
        for optimizer in self.optimizers:
            init_optim_state(optimizer)
            flat.update(
                flatten(optimizer.sharded_state_dict())
                if isinstance(optimizer, DASH)
                else get_flat_optim_state_dict(optimizer)
            )
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer in self.optimizers:
            init_optim_state(optimizer)
            if isinstance(optimizer, DASH):
                optimizer.load_state_dict(unflatten(optimizer, state_dict))
            else:
                load_flat_optim_state_dict(optimizer, state_dict)


def flatten(sharded: dict[str, Any]) -> dict[str, Any]:
    """DASH's name-keyed state dict in torchtitan's flat form, its counters under ``dash.``."""
    flat: dict[str, Any] = {}
    for name, entry in sharded["state"].items():
        for item, value in entry.items():
            flat[f"state.{name}.{item}"] = value
    for group in sharded["param_groups"]:
        for name in group["params"]:
            for key, value in group.items():
                if key not in ("params", "param_names"):
                    flat[f"param_groups.{name}.{key}"] = value
    for key, value in sharded.get("dash", {}).items():
        flat[f"{DASH_PREFIX}{key}"] = value
    return flat


def unflatten(optimizer: DASH, flat: dict[str, Any]) -> dict[str, Any]:
    """``optimizer``'s name-keyed state dict from a flat one: its parameters' entries, its groups'
    settings (from each group's first parameter) and its counters; other optimizers' keys are ignored."""
    template = optimizer.sharded_state_dict()
    names = {name for group in template["param_groups"] for name in group["params"]}
    state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("state."):
            name, item = key[len("state.") :].rsplit(".", 1)
            if name in names:
                state.setdefault(name, {})[item] = value
    groups = []
    for group in template["param_groups"]:
        first = group["params"][0]
        loaded = {key: flat.get(f"param_groups.{first}.{key}", value) for key, value in group.items()}
        groups.append({**loaded, "params": group["params"]})
    counters = {key[len(DASH_PREFIX) :]: value for key, value in flat.items() if key.startswith(DASH_PREFIX)}
    return {"state": state, "param_groups": groups, "dash": counters or template.get("dash", {})}
