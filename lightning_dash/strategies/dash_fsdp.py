"""``Trainer(strategy="dash_fsdp")``: FSDP2-sharded models with DASH blocks owned across ranks."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dash.distributed.gradient_sync import CommStats
from lightning_dash.distributed.placements import check_sharded_placements
from lightning_dash.integration.checkpoint_files import (
    complete_checkpoint,
    is_distributed_checkpoint,
    staged_write,
)
from lightning_dash.integration.fsdp_sharding import (
    check_mesh_sizes,
    check_shard_modules,
    setup_sharded_environment,
    shard_module,
    shard_over_data_parallel,
)
from lightning_dash.integration.namespaces import FSDP_LAUNCHERS, register_each
from lightning_dash.integration.optimizer_swap import swap_optimizers
from lightning_dash.integration.options import ConversionOptions, accepts_dash_options
from lightning_dash.integration.sharded_checkpoint import checkpoint_state, load_model, load_optimizer, name_parameters
from lightning_dash.integration.traffic import fsdp_bytes_per_step
from lightning_dash.integration.trainer_options import check_start_method, fsdp_options
from lightning_dash.optim import DASH
from lightning_dash.optim.stacks import param_names


class _WholeWeightsLauncher(_MultiProcessingLauncher):
    """Spawned or forked ranks that hand the main process whole weights: the sharded
    DTensor parameters are gathered (collectively) before rank 0 saves them."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(trainer.lightning_module, options=options)
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(weights, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))


class DashFSDPStrategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) whose optimizer is DASH, each Shampoo block owned by one rank.

    A LightningModule that shards itself in ``configure_model`` is used as it is; an
    unchanged one is sharded here as it is written, ties kept: every child of each
    ``nn.ModuleList`` (or each instance of ``shard_modules``), then the module's callable
    children, then what remains at the module itself
    (:func:`~lightning_dash.integration.fsdp_sharding.shard_module`). The optimizer of
    ``configure_optimizers`` is converted as under ``strategy="dash"`` (its schedulers
    keep working). After FSDP2's reduce-scatter, each block's gradient rows travel to
    its owner (one ``all_to_all``) and the update rows come back (a second one), so the
    result equals single-process DASH on the global batch at any world size, and each
    rank keeps only its blocks' state. Checkpoints hold DASH's state keyed by parameter
    name and block and resume at any world size, and under ``strategy="dash"`` too.

    Args:
        shard_modules: module classes that become FSDP2 units of an unchanged module
            (default: the children of every ``nn.ModuleList``).
        start_method: ``"popen"`` (re-run the script per rank), ``"spawn"`` or ``"fork"``.
        **kwargs: passed on to :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
            (``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``, ...);
            ``tensor_parallel_size`` (default 1) needs a ``configure_model`` that applies tensor
            parallelism on ``device_mesh["tensor_parallel"]`` and ``fully_shard`` on
            ``device_mesh["data_parallel"]`` (docs/strategies.md). The keyword arguments below and
            DASH's options come first.

    Keyword Args:
        config (DashConfig | None): DASH options as a :class:`~lightning_dash.optim.DashConfig`; every
            option is also a keyword of this signature (generated from DashConfig), as for
            :class:`~lightning_dash.strategies.DashStrategy`.
        factor_decay (float | None): ``betas[1]`` of DASH.
        allow_custom_step (bool | None): convert a subclass of a supported optimizer that overrides ``step``.
        communication_dtype (torch.dtype | str): dtype of the update rows sent back to the ranks holding them.
        micro_group_mib (float | None): memory budget per rank, in MiB, for the whole blocks a step gathers
            at once; the blocks are exchanged and computed in micro-groups that fit it (None, the default:
            one round, the fewest collectives).
    """

    strategy_name = "dash_fsdp"

    @accepts_dash_options
    def __init__(
        self,
        *,
        shard_modules: Collection[type[nn.Module]] | None = None,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        conversion = ConversionOptions.from_init(kwargs)
        super().__init__(**fsdp_options(kwargs, type(self), ModelParallelStrategy.__init__))
        #: How the optimizer of ``configure_optimizers`` becomes DASH: the resolved overrides and conversion options.
        self.conversion = conversion
        self.shard_modules = check_shard_modules(shard_modules)
        self.start_method = check_start_method(start_method)
        #: FSDP2's gradient and parameter traffic per step (from the collectives' sizes) and
        #: the bytes DASH's block exchanges sent, for this rank.
        self.comm_stats = CommStats()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        names = [(name, {"start_method": start}) for name, start in FSDP_LAUNCHERS]
        register_each(strategy_registry, cls, names, "FSDP2")

    @override
    def _configure_launcher(self) -> None:
        check_mesh_sizes(self)  # the processes are known: refuse sizes that do not fit them before launching
        assert self.cluster_environment is not None
        if self.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _WholeWeightsLauncher(self, start_method=self.start_method)

    @override
    def setup_environment(self) -> None:
        setup_sharded_environment(self, super().setup_environment)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        shard_over_data_parallel(self.model, self.device_mesh, self.shard_modules, shard_module)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self.optimizers = swap_optimizers(self.optimizers, self.lr_scheduler_configs, self._convert, _MockOptimizer)

    def _convert(self, optimizer: Optimizer) -> DASH:
        dash = self.conversion.convert(optimizer, sharded_parameters=True, model=self.lightning_module)
        named = name_parameters(dash, self.lightning_module)
        params = [param for group in dash.param_groups for param in group["params"]]
        check_sharded_placements(params, param_names(dash.param_groups) if named else None)  # at setup, by name
        return dash

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        dash = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(dash, DASH):
            self.comm_stats.steps += 1
            traffic = fsdp_bytes_per_step(self.lightning_module, self.world_size)
            self.comm_stats.record(traffic, traffic)
            self.comm_stats.optimizer_bytes_sent = float(getattr(dash.distributor, "bytes_sent", 0))
        return result

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        dash = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(dash, DASH):
            return checkpoint_state(dash, distributed=self._save_distributed_checkpoint)
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """As ModelParallelStrategy, but written under a staging name and moved onto
        ``filepath`` once every rank has finished: a crash while writing leaves the
        previous checkpoint as it was (:mod:`~lightning_dash.integration.checkpoint_files`);
        a folder's files are stamped with the global step."""
        path = Path(self.broadcast(filepath))
        step = checkpoint.get("global_step")
        with staged_write(path, self.global_rank == 0, self.barrier, step=step) as staged:
            super().save_checkpoint(checkpoint, staged, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = complete_checkpoint(Path(self.broadcast(checkpoint_path)))
        assert self.lightning_module is not None
        rest = load_model(self.model, path, "state_dict", self.lightning_module.strict_loading, weights_only)
        for index, optimizer in enumerate(self.optimizers):
            dash = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if is_distributed_checkpoint(path):
                load_optimizer(dash, path, f"optimizer_{index}")
            else:
                dash.load_state_dict(rest["optimizer_states"][index])
        return rest

    @override
    def teardown(self) -> None:
        # Let every rank finish its last collective before any of them exits.
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        super().teardown()


def register_strategies(registry: Any) -> None:
    """Add ``"dash_fsdp"`` and its launcher variants to ``registry`` (see :mod:`.namespaces`)."""
    DashFSDPStrategy.register_strategies(registry)
