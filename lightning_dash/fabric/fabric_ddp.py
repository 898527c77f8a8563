"""``Fabric(strategy="dash")``: data parallel with DASH blocks owned across ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit
from lightning_dash.distributed.placements import refuse_dtensor_parameters
from lightning_dash.fabric.optimizers import FabricDashOptimizers, LoadTarget, convert
from lightning_dash.integration.checkpoint_files import complete_checkpoint, is_distributed_checkpoint, local_path
from lightning_dash.integration.namespaces import register_each
from lightning_dash.integration.options import ConversionOptions, accepts_dash_options
from lightning_dash.integration.sharded_checkpoint import read_whole

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


#: What DDP takes (the strategy's and the wrapper's keywords), what only sharded strategies take, and where to go.
DDP_TAKES = (DDPStrategy.__init__, DistributedDataParallel.__init__)
SHARDED_STRATEGIES = (FSDPStrategy.__init__, ModelParallelStrategy.__init__)
USE_FSDP = 'Fabric(strategy="dash_fsdp") or DashFabricFSDPStrategy(...)'


class DashFabricStrategy(FabricDashOptimizers, DDPStrategy):
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
        **kwargs: the keyword arguments below and DASH's options, then what
            :class:`~lightning.fabric.strategies.DDPStrategy` (``start_method``, ``timeout``, ...) and
            DistributedDataParallel (``find_unused_parameters``, ...) take.

    Keyword Args:
        config (DashConfig | None): DASH options as a :class:`~lightning_dash.optim.DashConfig`; its
            fields that differ from the defaults override the values mapped from the user's optimizer.
            Every option is also a keyword of this signature (generated from DashConfig); one that is
            not None overrides ``config`` and the mapped value.
        factor_decay (float | None): ``betas[1]`` of DASH (decay of the Kronecker factors).
        allow_custom_step (bool | None): convert a subclass of a supported optimizer that overrides ``step``.
        communication_dtype (torch.dtype | str): dtype of the all-gathered updates (float32 default).
    """

    @accepts_dash_options
    def __init__(
        self,
        **kwargs: Any,
    ) -> None:
        conversion = ConversionOptions.for_data_parallel(kwargs, type(self), DDP_TAKES, SHARDED_STRATEGIES, USE_FSDP)
        super().__init__(**kwargs)
        #: How the user's optimizers become DASH: the resolved overrides and conversion options.
        self.conversion = conversion

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        settle_gloo_workers_at_exit()

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        refuse_dtensor_parameters(module, "dash")  # before DDP's broadcast fails on them
        return super().setup_module(module)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return convert(self.conversion, optimizer, modules=self.trained_modules)

    @override
    def load_checkpoint(
        self, path: _PATH, state: LoadTarget = None, strict: bool = True, weights_only: bool | None = None
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

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register :data:`REGISTRY_NAMES`; a name already registered is kept."""
        register_each(strategy_registry, cls, REGISTRY_NAMES, "DDP")


def register_strategies(registry: _StrategyRegistry) -> None:
    """Add this module's strategies to ``registry`` (the convention of :mod:`lightning_dash.integration.namespaces`)."""
    DashFabricStrategy.register_strategies(registry)
