"""``Fabric(strategy="dash_fsdp")``: FSDP2-sharded models with DASH blocks owned across ranks."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dash.distributed.placements import check_sharded_placements
from lightning_dash.fabric.optimizers import (
    FabricDashOptimizers,
    LoadTarget,
    ParameterNames,
    convert,
    parameter_names,
    replace_parameters,
    whole_state,
)
from lightning_dash.integration.checkpoint_files import (
    METADATA_FILE,
    complete_checkpoint,
    is_distributed_checkpoint,
    staged_write,
)
from lightning_dash.integration.fsdp_sharding import (
    check_mesh_sizes,
    check_shard_modules,
    is_sharded,
    setup_sharded_environment,
    shard_model,
    shard_over_data_parallel,
)
from lightning_dash.integration.namespaces import FSDP_LAUNCHERS, register_each
from lightning_dash.integration.options import ConversionOptions, accepts_dash_options
from lightning_dash.integration.sharded_checkpoint import checkpoint_state, load_model, load_optimizer, name_parameters
from lightning_dash.integration.trainer_options import check_start_method, fsdp_options
from lightning_dash.optim import DASH
from lightning_dash.optim.stacks import param_names

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry

#: Our registry names and their launchers.
REGISTRY_NAMES = tuple((name, {"start_method": start}) for name, start in FSDP_LAUNCHERS)


class ParallelizeForDash:
    """The strategy's ``parallelize_fn``: the user's (if any), then :func:`shard_model` over
    the data-parallel mesh when nothing is sharded yet. A class, so that spawned ranks
    unpickle it."""

    def __init__(
        self,
        parallelize_fn: Callable[[Module, DeviceMesh], Module] | None = None,
        shard_modules: Collection[type[Module]] | None = None,
    ) -> None:
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(
                f"parallelize_fn must be a callable (module, device_mesh) -> module or None, got {parallelize_fn!r}"
            )
        self.parallelize_fn = parallelize_fn
        self.shard_modules = check_shard_modules(shard_modules)

    def __call__(self, module: Module, device_mesh: DeviceMesh) -> Module:
        if self.parallelize_fn is not None:
            module = self.parallelize_fn(module, device_mesh)
        if isinstance(module, Module):
            shard_over_data_parallel(module, device_mesh, self.shard_modules, shard_model)
        return module


def _sharded_module(state: dict[str, Any]) -> tuple[str, Module]:
    """The one sharded model in a checkpoint's ``state``, and its key."""
    found = [(key, obj) for key, obj in state.items() if isinstance(obj, Module) and is_sharded(obj)]
    if len(found) != 1:
        raise ValueError(
            f"a checkpoint of strategy 'dash_fsdp' holds exactly one model set up by Fabric (found {len(found)}): "
            "pass it in the state, e.g. {'model': model, 'optimizer': optimizer, ...}"
        )
    return found[0]


class DashFabricFSDPStrategy(FabricDashOptimizers, ModelParallelStrategy):
    """Fabric's FSDP2 strategy (``ModelParallelStrategy``) whose optimizers are DASH,
    each Shampoo block owned by one rank.

    ``fabric.setup_module(model)`` (or ``fabric.setup(model, ...)``) shards the model over
    the data-parallel mesh (all ranks): ``parallelize_fn`` if given, else every child of
    each ``nn.ModuleList`` (or each instance of ``shard_modules``) and then the root. The
    optimizers (``fabric.setup(model, optimizer)`` or ``fabric.setup_optimizers``) are
    converted as under ``strategy="dash"``. An optimizer created before the model was set
    up holds the parameters FSDP2 replaced: they are swapped, by name, for the sharded
    ones (Fabric's own ``ModelParallelStrategy`` leaves them, and the optimizer then
    updates tensors the model no longer uses). The result equals single-process DASH on
    the global batch at any world size.

    ``fabric.save`` writes a distributed checkpoint folder (default; each rank its
    parameter shards and its DASH blocks) or, with ``save_distributed_checkpoint=False``,
    one file with the whole model and DASH state; either holds DASH's state keyed by
    parameter name and block, so ``fabric.load`` resumes it at any world size, and under
    ``strategy="dash"`` too.

    Args:
        parallelize_fn: shards (or otherwise parallelises) the model, given it and the
            device mesh, as for Fabric's ``ModelParallelStrategy``; by default the model is
            sharded as described above.
        **kwargs: the keyword arguments below and DASH's options, then what Fabric's
            ``ModelParallelStrategy`` takes (``save_distributed_checkpoint``, ``process_group_backend``,
            ``timeout``); ``tensor_parallel_size`` (default 1) needs a ``parallelize_fn`` that applies
            tensor parallelism, and ``data_parallel_size`` defaults to the rest of the world size.

    Keyword Args:
        config (DashConfig | None): DASH options as a :class:`~lightning_dash.optim.DashConfig`; every
            option is also a keyword of this signature (generated from DashConfig). This and the keywords
            ``factor_decay``, ``allow_custom_step``, ``communication_dtype``, ``micro_group_mib``,
            ``shard_modules`` and ``start_method`` mean what they mean for Lightning's
            :class:`~lightning_dash.strategies.DashFSDPStrategy`.
    """

    @accepts_dash_options
    def __init__(
        self,
        parallelize_fn: Callable[[Module, DeviceMesh], Module] | None = None,
        *,
        shard_modules: Collection[type[Module]] | None = None,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        conversion = ConversionOptions.from_init(kwargs)
        super().__init__(
            parallelize_fn=ParallelizeForDash(parallelize_fn, shard_modules),
            **fsdp_options(kwargs, type(self), ModelParallelStrategy.__init__),
        )
        #: How the user's optimizers become DASH: the resolved overrides and conversion options.
        self.conversion = conversion
        self.start_method = check_start_method(start_method)
        #: Each module set up, with the names its parameters had before sharding.
        self._set_up: list[tuple[ParameterNames, Module]] = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"dash_fsdp"`` and its launcher variants; a name already registered is kept."""
        register_each(strategy_registry, cls, REGISTRY_NAMES, "FSDP2")

    @override
    def setup_environment(self) -> None:
        setup_sharded_environment(self, super().setup_environment)

    @override
    def _configure_launcher(self) -> None:
        check_mesh_sizes(self)  # the processes are known: refuse sizes that do not fit them before launching
        if self.start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.start_method)

    @override
    def setup_module(self, module: Module) -> Module:
        before = parameter_names(module)
        module = super().setup_module(module)
        self._set_up.append((before, module))
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        for before, module in self._set_up:
            replace_parameters(optimizer, before, module)
        named = next((module for _, module in reversed(self._set_up) if name_parameters(optimizer, module)), None)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        names = param_names(optimizer.param_groups) if named is not None else None
        check_sharded_placements(params, names)
        return convert(self.conversion, optimizer, sharded_parameters=True, modules=self.trained_modules)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """As Fabric's ``ModelParallelStrategy``, with each DASH's state in its world-size-free
        form: this rank's share in a distributed checkpoint, the whole of it in a single file."""
        if not any(isinstance(obj, DASH) for obj in state.values()):
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        distributed = self._save_distributed_checkpoint
        if filter is not None and distributed:
            raise NotImplementedError("filtered distributed checkpoints cannot be loaded, so they are not saved")
        path = Path(self.broadcast(path))
        _sharded_module(state)  # exactly one model, as Fabric requires
        options = StateDictOptions(full_state_dict=not distributed, cpu_offload=True)
        contents: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():  # the same order on every rank: some of these are collective
            if isinstance(obj, Module):
                converted, target = get_model_state_dict(obj, options=options), contents
            elif isinstance(obj, DASH):
                converted, target = checkpoint_state(obj, True) if distributed else whole_state(obj), contents
            elif isinstance(obj, Optimizer):
                raise TypeError(
                    f"state[{key!r}] is a {type(obj).__name__} that was not set up by Fabric: strategy 'dash_fsdp' "
                    "saves the DASH optimizers it set up"
                )
            else:
                converted, target = obj.state_dict() if isinstance(obj, _Stateful) else obj, metadata
            _apply_filter(key, filter or {}, converted, target)
        # written whole under a staging name, then moved onto path: a crash leaves the old one
        with staged_write(path, self.global_rank == 0, self.barrier) as staged:
            if distributed:
                staged.mkdir(parents=True, exist_ok=True)
                dcp.save(contents, checkpoint_id=staged)
                if self.global_rank == 0:
                    torch.save(metadata, staged / METADATA_FILE)
            elif self.global_rank == 0:
                torch.save({**contents, **metadata}, staged)

    @override
    def load_checkpoint(
        self, path: _PATH, state: LoadTarget = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """As Fabric's ``ModelParallelStrategy``, with DASH's state read for the current world
        size: from a distributed checkpoint each rank reads only its blocks."""
        if not isinstance(state, dict) or not any(isinstance(obj, DASH) for obj in state.values()):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        path = complete_checkpoint(Path(self.broadcast(path)))
        key, module = _sharded_module(state)
        rest = load_model(module, path, key, strict, weights_only)
        optimizers = {name: obj for name, obj in state.items() if isinstance(obj, Optimizer)}
        for name, optimizer in optimizers.items():
            if not isinstance(optimizer, DASH):
                raise TypeError(f"state[{name!r}] is a {type(optimizer).__name__} that was not set up by Fabric")
            if is_distributed_checkpoint(path):
                load_optimizer(optimizer, path, name)
            elif name in rest:
                optimizer.load_state_dict(rest.pop(name))
            elif strict:
                raise KeyError(f"the checkpoint at {path} holds no optimizer state under {name!r}")
        requested = state.keys() - {key} - optimizers.keys()
        _validate_keys_for_strict_loading(requested, rest.keys(), strict=strict)
        _move_state_into(source=rest, destination=state, keys=requested)
        return rest


def register_strategies(registry: _StrategyRegistry) -> None:
    """Add this module's strategies to ``registry`` (the convention of :mod:`lightning_dash.integration.namespaces`)."""
    DashFabricFSDPStrategy.register_strategies(registry)
