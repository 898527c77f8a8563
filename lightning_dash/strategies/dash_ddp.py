"""``Trainer(strategy="dash")``: data parallel with DASH blocks owned across ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit
from lightning_dash.distributed.gradient_sync import CommStats
from lightning_dash.distributed.placements import refuse_dtensor_parameters
from lightning_dash.integration.checkpoint_files import complete_checkpoint, is_distributed_checkpoint, local_path
from lightning_dash.integration.demo_gradient_sync import DemoGradientSync
from lightning_dash.integration.namespaces import register_each
from lightning_dash.integration.optimizer_swap import swap_optimizers
from lightning_dash.integration.options import ConversionOptions, accepts_dash_options
from lightning_dash.integration.sharded_checkpoint import read_whole
from lightning_dash.optim import DASH

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry

#: Registry name -> start method of its launcher, as Lightning's "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook".
_LAUNCHERS = (("dash", "popen"), ("dash_spawn", "spawn"), ("dash_fork", "fork"), ("dash_notebook", "fork"))
#: Registry name suffix -> DDP's ``find_unused_parameters``, as Lightning's "ddp_find_unused_parameters_true".
_UNUSED_PARAMETER_VARIANTS = (
    ("", {}),
    ("_find_unused_parameters_false", {"find_unused_parameters": False}),
    ("_find_unused_parameters_true", {"find_unused_parameters": True}),
)

#: What DDP takes (the strategy's and the wrapper's keywords), what only sharded strategies take, and where to go.
DDP_TAKES = (DDPStrategy.__init__, DistributedDataParallel.__init__)
SHARDED_STRATEGIES = (FSDPStrategy.__init__, ModelParallelStrategy.__init__)
USE_FSDP = 'strategy="dash_fsdp" or lightning_dash.DashFSDPStrategy(...) for FSDP with DASH'


class DashStrategy(DDPStrategy):
    """DDP whose optimizer is DASH, with each Shampoo block owned by one rank.

    The optimizer returned by ``configure_optimizers`` (AdamW, Adam, SGD, Composer's
    decoupled variants, ...) is converted with :meth:`DASH.from_optimizer` over the
    same parameter groups, so its learning-rate schedulers keep driving it.
    Gradients are all-reduced by DDP as usual; every rank then updates only the
    blocks it owns (greedy LPT over a FLOP cost model) and one all-gather shares
    the updates. Checkpoints hold the full, world-size-independent state.

    Args:
        gradient_sync: ``"allreduce"`` (DDP's averaging all-reduce, counted) or ``"demo"``
            (DDP's all-reduce is switched off; DeMo exchanges the top-k DCT components of
            each rank's local momentum and the decoded mean is what DASH sees as gradient;
            DASH's own gradient momentum ``betas[0]`` is then set to 0).
        demo_topk: DeMo's DCT coefficients kept per chunk.
        demo_chunk_size: DeMo's largest chunk side.
        demo_momentum: decay of DeMo's local momentum.
        **kwargs: the keyword arguments below, then DASH's options, then what
            :class:`~lightning.pytorch.strategies.DDPStrategy` takes; a sharding option
            (:data:`~lightning_dash.integration.trainer_options.SHARDING_OPTIONS`, e.g.
            ``sharding_strategy``) raises ``ValueError`` pointing to ``strategy="dash_fsdp"``.

    Keyword Args:
        config (DashConfig | None): DASH options as a :class:`~lightning_dash.optim.DashConfig`; its
            fields that differ from the defaults override the values mapped from the user's optimizer.
            Every option is also a keyword of this signature (generated from DashConfig); one that is
            not None overrides ``config`` and the value mapped from the user's optimizer
            (:mod:`lightning_dash.integration.options` states the rule). With
            ``async_preconditioning`` each rank computes its due roots on a side CUDA stream.
        factor_decay (float | None): ``betas[1]`` of DASH (decay of the Kronecker factors).
        allow_custom_step (bool | None): convert a subclass of a supported optimizer that overrides
            ``step`` (its own update rule is then lost; refused by default).
        communication_dtype (torch.dtype | str): dtype of the all-gathered updates (float32 default).
    """

    strategy_name = "dash"

    @accepts_dash_options
    def __init__(
        self,
        *,
        gradient_sync: str = "allreduce",
        demo_topk: int = 32,
        demo_chunk_size: int = 64,
        demo_momentum: float = 0.999,
        **kwargs: Any,
    ) -> None:
        conversion = ConversionOptions.for_data_parallel(kwargs, type(self), DDP_TAKES, SHARDED_STRATEGIES, USE_FSDP)
        super().__init__(**kwargs)
        #: How the optimizer of ``configure_optimizers`` becomes DASH: the resolved overrides and conversion options.
        self.conversion = conversion
        #: Bytes of gradient synchronisation and of DASH's block exchange, and optimizer steps, of this run.
        self.comm_stats = CommStats()
        #: Optimizer steps restored from a checkpoint (``comm_stats`` counts this run only).
        self.resumed_steps = 0
        #: The ``gradient_sync`` option at every moment of a run: DDP's hook, each step, checkpoints.
        self._gradient_sync = DemoGradientSync(
            self.comm_stats, gradient_sync, demo_topk, demo_chunk_size, demo_momentum
        )

    @property
    def gradient_sync(self) -> str:
        """``"allreduce"`` or ``"demo"``."""
        return self._gradient_sync.mode

    @property
    def demo_options(self) -> dict[str, Any]:
        """DeMo's ``topk``, ``chunk_size`` and ``momentum`` (used with ``gradient_sync="demo"``)."""
        return self._gradient_sync.options

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register "dash", "dash_spawn", "dash_fork" and "dash_notebook" and, as Lightning does for "ddp",
        each with ``_find_unused_parameters_true`` (for modules leaving parameters without gradients, as GANs
        do) and ``_false``; a name already registered is kept."""
        names = [
            (prefix + suffix, {"start_method": start_method, **params})
            for prefix, start_method in _LAUNCHERS
            for suffix, params in _UNUSED_PARAMETER_VARIANTS
        ]
        register_each(strategy_registry, cls, names, "DDP")

    @property
    def _one_process(self) -> bool:
        """A single process (one device, one node): no process group and no DDP wrapper, as
        Lightning's single-device strategy runs; DASH owns every block itself."""
        return self.num_nodes * self.num_processes == 1

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        settle_gloo_workers_at_exit()

    @override
    def setup_distributed(self) -> None:
        if not self._one_process:
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        refuse_dtensor_parameters(self.model, self.strategy_name)  # before DDP's broadcast fails on them
        if not self._one_process:
            super().setup(trainer)
            return
        # One process: the base Strategy's setup (what SingleDeviceStrategy runs), with nothing wrapped or broadcast.
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._gradient_sync.start()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        # DDP synchronises only the parameters that required grad when it was built.
        self._ddp_synchronised = {id(p) for p in self.model.parameters() if p.requires_grad}
        self._gradient_sync.attach(self.model, self.world_size)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_with_late_parameters() -> Any:
            result = closure()
            if not self._gradient_sync.synchronise(self.lightning_module.parameters()):
                self._average_unsynchronised_gradients()
            self.comm_stats.steps += 1
            return result

        result = super().optimizer_step(optimizer, closure_with_late_parameters, model, **kwargs)
        dash = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        self.comm_stats.optimizer_bytes_sent = float(getattr(getattr(dash, "distributor", None), "bytes_sent", 0))
        return result

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self._gradient_sync.save(checkpoint, self.global_rank, self.world_size)  # collective
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # A folder written by strategy="dash_fsdp": read whole, in Lightning's checkpoint layout.
        path = local_path(checkpoint_path)
        if path is not None:  # refused with the file named if incomplete; a crashed save's copy if needed
            path = complete_checkpoint(path)
        if path is None or not is_distributed_checkpoint(path):
            return super().load_checkpoint(checkpoint_path if path is None else path, weights_only=weights_only)
        checkpoint = read_whole(path, weights_only)
        count = sum(1 for key in checkpoint if key.startswith("optimizer_"))
        checkpoint["optimizer_states"] = [checkpoint.pop(f"optimizer_{index}") for index in range(count)]
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self.resumed_steps = int(checkpoint.get("global_step", 0))
        self._gradient_sync.load(checkpoint, self.global_rank, self.world_size)

    def _average_unsynchronised_gradients(self) -> None:
        """Average the gradients DDP does not know about (parameters unfrozen after
        wrapping, e.g. by ``BaseFinetuning``) so every rank steps with the same ones."""
        if self.world_size == 1 or self.lightning_module is None:
            return
        synchronised = getattr(self, "_ddp_synchronised", set())
        late = [p for p in self.lightning_module.parameters() if p.grad is not None and id(p) not in synchronised]
        if not late:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in late])
        dist.all_reduce(flat)
        flat /= self.world_size
        for param, part in zip(late, flat.split([p.numel() for p in late])):
            param.grad.copy_(part.view_as(param.grad))

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        # configure_optimizers returned None: Lightning said so and trains with a stand-in that steps nothing.
        self.optimizers = swap_optimizers(self.optimizers, self.lr_scheduler_configs, self._convert, _MockOptimizer)

    @override
    def teardown(self) -> None:
        # Let every rank finish its last collective before any of them exits: a gloo peer
        # leaving mid-exchange aborts the others.
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        super().teardown()

    def _convert(self, optimizer: Optimizer) -> DASH:
        return self._gradient_sync.adapt(self.conversion.convert(optimizer, model=self.lightning_module))


def register_strategies(registry: _StrategyRegistry) -> None:
    """Add this module's strategies to ``registry`` (the convention of :mod:`lightning_dash.integration.namespaces`)."""
    DashStrategy.register_strategies(registry)
