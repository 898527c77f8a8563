"""``Fabric(strategy="dash")``: data parallel with DASH blocks owned across ranks."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit
from lightning_dash.fabric.optimizers import SchedulerFollowsConversion, convert, whole_state
from lightning_dash.integration.checkpoint_files import complete_checkpoint, is_distributed_checkpoint, local_path
from lightning_dash.integration.options import ConversionOptions, accepts_dash_options, take_dash_options
from lightning_dash.integration.sharded_checkpoint import read_whole
from lightning_dash.optim import DASH, DashConfig
from lightning_dash.optim.config import OPTION_NAMES

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry

#: Our registry names and their settings: Fabric's own "ddp" names with "dash" for "ddp".
REGISTRY_NAMES = (
    ("dash", {"start_method": "popen"}),
    ("dash_spawn", {"start_method": "spawn"}),
    ("dash_fork", {"start_method": "fork"}),
    ("dash_notebook", {"start_method": "fork"}),
    ("dash_find_unused_parameters_true", {"find_unused_parameters": True, "start_method": "popen"}),
)


def _check_ddp_options(options: dict[str, Any]) -> None:
    """Refuse, when the strategy is built rather than when the model is wrapped, a keyword that neither
    DDPStrategy nor DistributedDataParallel takes; one of the sharded strategies points to "dash_fsdp"."""
    known = set(inspect.signature(DDPStrategy.__init__).parameters)
    known |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    unknown = sorted(set(options) - known)
    sharding = set(inspect.signature(FSDPStrategy.__init__).parameters)
    sharding |= set(inspect.signature(ModelParallelStrategy.__init__).parameters) | {"shard_modules"}
    if sharding.intersection(unknown):
        raise ValueError(
            f"DashFabricStrategy is data parallel and does not shard; {sorted(sharding.intersection(unknown))} are "
            'options of sharded training: use Fabric(strategy="dash_fsdp") or DashFabricFSDPStrategy(...)'
        )
    if unknown:
        raise TypeError(f"DashFabricStrategy got unknown option(s) {unknown}; DASH options: {sorted(OPTION_NAMES)}")


class DashFabricStrategy(SchedulerFollowsConversion, DDPStrategy):
    """Fabric's DDP whose optimizers are DASH, with each Shampoo block owned by one rank.

    The optimizers given to ``fabric.setup(model, optimizer, ...)`` or
    ``fabric.setup_optimizers`` (AdamW, Adam, SGD, ...) are converted with
    :meth:`DASH.from_optimizer` over the same parameter groups, so a learning-rate
    scheduler attached to them keeps working (one given to ``fabric.setup`` is pointed
    at the DASH); a DASH is used as it is. Gradients are all-reduced by DDP; every rank
    updates the blocks it owns and one all-gather shares the updates.

    ``fabric.save`` consolidates each DASH once on every rank and writes the whole,
    world-size-free state from rank 0 (also with ``collective_state_dict=True``);
    ``fabric.load`` reads it at any world size, and also reads a distributed checkpoint
    folder written by ``strategy="dash_fsdp"``.

    Args:
        config: DASH options as a :class:`~lightning_dash.optim.DashConfig`; its fields that
            differ from the defaults override the values mapped from the user's optimizer. Every
            option is also a keyword of this signature (generated from DashConfig); one that is
            not None overrides ``config`` and the mapped value.
        factor_decay: ``betas[1]`` of DASH (decay of the Kronecker factors).
        allow_custom_step: convert a subclass of a supported optimizer that overrides ``step``.
        communication_dtype: dtype of the all-gathered updates (float32 default).
        **kwargs: passed on to :class:`~lightning.fabric.strategies.DDPStrategy` (``start_method``,
            ``timeout``, ...) and DistributedDataParallel (``find_unused_parameters``, ...).
    """

    @accepts_dash_options
    def __init__(
        self,
        *,
        config: DashConfig | None = None,
        factor_decay: float | None = None,
        allow_custom_step: bool | None = None,
        communication_dtype: torch.dtype | str = torch.float32,
        **kwargs: Any,
    ) -> None:
        options = take_dash_options(kwargs)
        _check_ddp_options(kwargs)
        super().__init__(**kwargs)
        #: How the user's optimizers become DASH: the resolved overrides and conversion options.
        self.conversion = ConversionOptions.build(
            config,
            factor_decay=factor_decay,
            allow_custom_step=allow_custom_step,
            communication_dtype=communication_dtype,
            **options,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register :data:`REGISTRY_NAMES`; a name already registered is kept."""
        for name, settings in REGISTRY_NAMES:
            if name not in strategy_registry:
                description = f"DDP with DASH (block-owned Shampoo), {settings['start_method']} launcher"
                strategy_registry.register(name, cls, description=description, **settings)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        settle_gloo_workers_at_exit()

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return convert(self.conversion, optimizer, modules=self.trained_modules)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, DASH):
            return whole_state(optimizer)
        return super().get_optimizer_state(optimizer)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        folder = local_path(path)
        if folder is not None:  # refused with the file named if incomplete; a crashed save's copy if needed
            folder = complete_checkpoint(folder)
        if folder is None or not is_distributed_checkpoint(folder):
            return super().load_checkpoint(
                path if folder is None else folder, state, strict=strict, weights_only=weights_only
            )
        # Written by strategy="dash_fsdp": read whole (the shards joined), then restored as Fabric restores a file.
        checkpoint = read_whole(folder, weights_only)
        if not state:
            return checkpoint
        if isinstance(state, Module):
            self.load_module_state_dict(state, checkpoint, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            state.load_state_dict(checkpoint)
            return {}
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
        for name, obj in list(state.items()):
            if name not in checkpoint:
                continue
            if isinstance(obj, Module):
                self.load_module_state_dict(obj, checkpoint.pop(name), strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(name))
            else:
                state[name] = checkpoint.pop(name)
        return checkpoint


def register_strategies(registry: _StrategyRegistry) -> None:
    """Add this module's strategies to ``registry`` (the convention of :mod:`lightning_dash.strategies.namespaces`)."""
    DashFabricStrategy.register_strategies(registry)
