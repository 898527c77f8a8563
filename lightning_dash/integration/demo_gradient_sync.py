"""DeMo gradient synchronisation as a DDP strategy runs it: the options, the hook, each step and the checkpoint.

:class:`DemoGradientSync` is everything ``DashStrategy`` does for its ``gradient_sync`` option, in the
order a run meets it; the strategy calls one method from each hook. It imports no Lightning (the strategy
modules are loaded again, renamed, for the standalone ``pytorch_lightning`` package; see
:mod:`lightning_dash.integration.namespaces`), so it works on a plain DDP module and parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_dash.distributed.demo_synchronizer import DemoSynchronizer
from lightning_dash.distributed.gradient_sync import CommStats, counting_allreduce_hook, local_gradient_hook
from lightning_dash.optim.validation import check_choice, check_int, check_number

if TYPE_CHECKING:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lightning_dash.optim import DASH

#: The checkpoint key under which rank 0 stores every rank's DeMo state, in rank order.
CHECKPOINT_KEY = "demo_synchronizer_states"


class DemoGradientSync:
    """How a DDP strategy's gradients travel: DDP's all-reduce (counted) or DeMo.

    With ``gradient_sync="allreduce"`` the only work is counting DDP's all-reduce bytes in ``stats``.
    With ``"demo"``, DDP's all-reduce is switched off, and after each backward pass DeMo exchanges the
    top-k DCT components of every rank's local momentum; the decoded mean replaces the gradients, and
    DASH's own gradient momentum (``betas[0]``) is set to 0. The strategy calls, in a run's order:

    * :meth:`attach` when DDP has wrapped the model (or :meth:`start` in one process, with no wrapper);
    * :meth:`adapt` on the converted DASH optimizer;
    * :meth:`synchronise` after the backward pass of every step;
    * :meth:`save` and :meth:`load` with the trainer's checkpoint dictionary.

    The options are the strategy's, whose signature holds their defaults.

    Args:
        stats: where the gradient-synchronisation bytes are counted.
        gradient_sync: ``"allreduce"`` or ``"demo"``.
        demo_topk: DeMo's DCT coefficients kept per chunk.
        demo_chunk_size: DeMo's largest chunk side.
        demo_momentum: decay of DeMo's local momentum, in [0, 1).
    """

    def __init__(
        self, stats: CommStats, gradient_sync: str, demo_topk: int, demo_chunk_size: int, demo_momentum: float
    ) -> None:
        #: ``"allreduce"`` or ``"demo"``.
        self.mode = check_choice("gradient_sync", gradient_sync, ("allreduce", "demo"))
        #: The keywords of :class:`DemoSynchronizer`: ``topk``, ``chunk_size`` and ``momentum``.
        self.options = {
            "topk": check_int("demo_topk", demo_topk, low=1),
            "chunk_size": check_int("demo_chunk_size", demo_chunk_size, low=1),
            "momentum": check_number("demo_momentum", demo_momentum, low=0.0, high=1.0, high_open=True),
        }
        self.stats = stats
        #: This rank's DeMo momenta while a DeMo run trains (None before :meth:`start` and without DeMo).
        self.synchronizer: DemoSynchronizer | None = None

    @property
    def active(self) -> bool:
        """Whether DeMo synchronises this run's gradients (started, with ``gradient_sync="demo"``)."""
        return self.synchronizer is not None

    def start(self) -> None:
        """Begin training: with DeMo, fresh momenta for this rank."""
        if self.mode == "demo":
            self.synchronizer = DemoSynchronizer(**self.options)

    def attach(self, ddp_model: DistributedDataParallel, world_size: int) -> None:
        """Begin training on ``ddp_model``: with DeMo, DDP's all-reduce becomes a no-op that keeps each rank's
        gradient; otherwise, with several ranks, DDP's all-reduce is counted in ``stats``."""
        self.start()
        if self.active:
            ddp_model.register_comm_hook(self.stats, local_gradient_hook)
        elif world_size > 1:
            ddp_model.register_comm_hook(self.stats, counting_allreduce_hook)

    def adapt(self, dash: DASH) -> DASH:
        """Under DeMo, DASH steps on the decoded direction directly: its ``betas[0]`` is set to 0."""
        if self.mode == "demo":
            # DeMo's error-feedback accumulator already is the momentum of the signal DASH
            # receives; a second momentum on top of it slows training (measured in
            # benchmarks/distributed/demo_sync.py), so DASH steps on the decoded direction directly.
            for group in dash.param_groups:
                group["betas"] = (0.0, group["betas"][1])
        return dash

    def synchronise(self, parameters: Iterable[nn.Parameter]) -> bool:
        """With DeMo running, replace every local gradient of ``parameters`` (all the module's, in order: the
        position is DeMo's key) by the decoded mean of the ranks' fast components and return True; else False."""
        if self.synchronizer is None:
            return False
        keyed = [(i, p) for i, p in enumerate(parameters) if p.grad is not None]
        keys, params = [i for i, _ in keyed], [p for _, p in keyed]
        synchronised = self.synchronizer.synchronize([p.grad for p in params], keys)
        for param, value in zip(params, synchronised):
            param.grad.copy_(value)
        self.stats.record(self.synchronizer.last_bytes_sent, self.synchronizer.last_bytes_received)
        return True

    def save(self, checkpoint: dict[str, Any], global_rank: int, world_size: int) -> None:
        """Every rank's DeMo momentum differs: rank 0 stores all of them under ``CHECKPOINT_KEY``.
        Collective: every rank calls it."""
        if self.synchronizer is None:
            return
        local = self.synchronizer.state_dict()
        if world_size > 1:
            gathered: list[Any] | None = [None] * world_size if global_rank == 0 else None
            dist.gather_object(local, gathered, dst=0)
        else:
            gathered = [local]
        if global_rank == 0:
            checkpoint[CHECKPOINT_KEY] = gathered

    def load(self, checkpoint: dict[str, Any], global_rank: int, world_size: int) -> None:
        """Restore this rank's DeMo momentum from ``checkpoint``, saved on the same world size."""
        states = checkpoint.get(CHECKPOINT_KEY)
        if self.synchronizer is None or states is None:
            return
        if len(states) != world_size:
            raise ValueError(
                f"the checkpoint holds DeMo momenta of {len(states)} ranks but this run has {world_size}; "
                "resume DeMo runs on the same world size"
            )
        self.synchronizer.load_state_dict(states[global_rank])
