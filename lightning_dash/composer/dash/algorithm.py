"""The ``Dash`` Composer algorithm: swap the trainer's optimizer for DASH at ``Event.INIT``."""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import ensure_tuple

from lightning_dash.distributed import shard_across_ranks
from lightning_dash.optim import DASH
from lightning_dash.optim.validation import check_communication_dtype, check_conversion_overrides

log = logging.getLogger(__name__)

__all__ = ["Dash"]


class Dash(Algorithm):
    """Train with DASH instead of the optimizer given to the Composer ``Trainer``.

    At ``Event.INIT`` (before Composer compiles its schedulers, wraps the model for
    DDP and loads a checkpoint) the single optimizer in ``state.optimizers`` —
    ``DecoupledAdamW``, ``DecoupledSGDW``, or a torch Adam/AdamW/SGD/Adagrad/RMSprop —
    is converted with :meth:`DASH.from_optimizer` over the same parameter groups,
    so learning rates, momenta and weight decay carry over and the schedulers bind
    to DASH. With several processes every rank owns a cost-balanced share of the
    blocks and one all-gather shares the updates (the same
    :class:`~lightning_dash.distributed.ProcessGroupDistributor` the Lightning
    strategy uses). Checkpoints go through Composer's own save/load, which calls
    ``state_dict()`` on every rank; DASH then consolidates the blocks of all ranks by
    itself, so a checkpoint resumes on any number of processes.

    Options are plain keyword arguments so llm-foundry YAML can pass them
    (``algorithms: {dash: {block_size: 1024}}``); None keeps the value mapped from
    the original optimizer or DASH's default.

    Args:
        block_size: largest tile side of the Kronecker blocks.
        precondition_frequency: recompute the inverse roots every this many steps.
        start_preconditioning_step: first step that uses the Shampoo direction.
        inverse_root_method: "eigh", "coupled_newton", "newton_db" or "chebyshev".
        matrix_scaling: "frobenius" or "power_iteration".
        matmul_dtype: dtype of the solver matmuls ("float32", "bfloat16", "float16").
        grafting: "adam", "adagrad", "rmsprop", "sgd" or "none" (None: follow the
            original optimizer, e.g. Adam for ``DecoupledAdamW``).
        epsilon: damping of the factors before the roots.
        root_iterations: iterations of the Newton solvers.
        relative_epsilon: whether ``epsilon`` is relative to each factor's norm (DASH's default).
        allow_custom_step: convert a subclass of a supported optimizer that overrides
            ``step`` (its own update rule is then lost; refused by default).
        factor_decay: decay of the Kronecker factors (``betas[1]`` of DASH).
        async_preconditioning, max_staleness: on CUDA, compute the roots on a side
            stream and use them at most ``max_staleness`` steps later (see DASH).
        communication_dtype: dtype of the all-gathered block updates across ranks.

    Example:
        >>> from composer import Trainer
        >>> from lightning_dash.composer import Dash
        >>> trainer = Trainer(model=model, algorithms=[Dash(block_size=1024)], ...)  # doctest: +SKIP
    """

    def __init__(
        self,
        block_size: Optional[int] = None,
        precondition_frequency: Optional[int] = None,
        start_preconditioning_step: Optional[int] = None,
        inverse_root_method: Optional[str] = None,
        matrix_scaling: Optional[str] = None,
        matmul_dtype: Optional[Union[torch.dtype, str]] = None,
        grafting: Optional[str] = None,
        epsilon: Optional[float] = None,
        root_iterations: Optional[int] = None,
        factor_decay: Optional[float] = None,
        async_preconditioning: Optional[bool] = None,
        max_staleness: Optional[int] = None,
        relative_epsilon: Optional[bool] = None,
        allow_custom_step: Optional[bool] = None,
        communication_dtype: Union[torch.dtype, str] = torch.float32,
    ) -> None:
        self.options = check_conversion_overrides(dict(
            block_size=block_size,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            inverse_root_method=inverse_root_method,
            matrix_scaling=matrix_scaling,
            matmul_dtype=matmul_dtype,
            grafting=grafting,
            epsilon=epsilon,
            root_iterations=root_iterations,
            factor_decay=factor_decay,
            async_preconditioning=async_preconditioning,
            max_staleness=max_staleness,
            relative_epsilon=relative_epsilon,
            allow_custom_step=allow_custom_step,
        ))
        self.communication_dtype = check_communication_dtype(communication_dtype)
        #: The DASH optimizer this algorithm installed (None before ``Event.INIT``).
        self.optimizer: Optional[DASH] = None

    def __repr__(self) -> str:
        shown = {**self.options, "communication_dtype": self.communication_dtype}
        return f"Dash({', '.join(f'{key}={value!r}' for key, value in shown.items())})"

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        optimizers = ensure_tuple(state.optimizers)
        if len(optimizers) != 1:
            raise ValueError(f"Dash needs exactly one optimizer in the trainer, found {len(optimizers)}")
        dash = DASH.from_optimizer(optimizers[0], **self.options)
        sharded = shard_across_ranks(dash, self.communication_dtype)
        # Composer saves through torch.distributed.checkpoint, which calls state_dict()
        # on every rank: let DASH gather the blocks of all ranks inside that call.
        dash.collective_state_dict = True
        state.optimizers = dash
        self.optimizer = dash
        log.info("Dash: replaced %s by DASH%s", type(optimizers[0]).__name__,
                 f" (blocks owned across {dash.distributor.world_size} ranks)" if sharded else "")

    def state_dict(self) -> dict[str, Any]:
        """Composer stores this beside the optimizer. torch.distributed.checkpoint keeps
        only DASH's per-parameter state and groups, so DASH's optimizer-wide counters and
        grafting type travel here (Composer loads algorithms before optimizers)."""
        packed = super().state_dict()
        if self.optimizer is not None:
            packed["dash"] = {
                "root_failure_count": self.optimizer.root_failure_count,
                "nonfinite_grad_skips": self.optimizer.nonfinite_grad_skips,
                "nonfinite_update_skips": self.optimizer.nonfinite_update_skips,
                "grafting": self.optimizer.grafting,
            }
        return packed

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("dash")
        if saved is None or self.optimizer is None:
            return
        self.optimizer.root_failure_count = int(saved["root_failure_count"])
        self.optimizer.nonfinite_grad_skips = int(saved["nonfinite_grad_skips"])
        self.optimizer.nonfinite_update_skips = int(saved.get("nonfinite_update_skips", 0))
        self.optimizer.grafting = saved["grafting"]
