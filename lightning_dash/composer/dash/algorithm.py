"""The ``Dash`` Composer algorithm: swap the trainer's optimizer for DASH at ``Event.INIT``."""

from __future__ import annotations

import logging
from typing import Any

from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import ensure_tuple

from lightning_dash.integration.options import ConversionOptions, accepts_dash_options
from lightning_dash.optim import DASH, DashConfig
from lightning_dash.optim.config import check_option_names

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
    (``algorithms: {dash: {block_size: 1024}}``), or a
    :class:`~lightning_dash.optim.DashConfig` from Python.

    Args:
        config: DASH options as a :class:`~lightning_dash.optim.DashConfig`; its fields that
            differ from the defaults override the values mapped from the original optimizer.
        **options: every :class:`~lightning_dash.optim.DashConfig` option by keyword (they
            appear in this signature, generated from DashConfig); one that is not None
            overrides ``config`` and the value mapped from the original optimizer, e.g. Adam
            grafting for ``DecoupledAdamW``
            (:mod:`lightning_dash.integration.options` states the rule).
        factor_decay: decay of the Kronecker factors (``betas[1]`` of DASH).
        allow_custom_step: convert a subclass of a supported optimizer that overrides
            ``step`` (its own update rule is then lost; refused by default).
        communication_dtype: dtype of the all-gathered block updates across ranks.

    Example:
        >>> from composer import Trainer
        >>> from lightning_dash.composer import Dash
        >>> trainer = Trainer(model=model, algorithms=[Dash(block_size=1024)], ...)  # doctest: +SKIP
    """

    @accepts_dash_options
    def __init__(
        self,
        config: DashConfig | None = None,
        **options: Any,
    ) -> None:
        #: How the trainer's optimizer becomes DASH: the resolved overrides and conversion options.
        self.conversion = ConversionOptions.from_init(options, config)
        check_option_names(options)  # a name left over is no DASH option
        #: The DASH optimizer this algorithm installed (None before ``Event.INIT``).
        self.optimizer: DASH | None = None

    def __repr__(self) -> str:
        conversion = self.conversion
        shown = {**conversion.overrides, "communication_dtype": conversion.communication_dtype}
        if conversion.factor_decay is not None:
            shown["factor_decay"] = conversion.factor_decay
        if conversion.allow_custom_step:
            shown["allow_custom_step"] = True
        return f"Dash({', '.join(f'{key}={value!r}' for key, value in shown.items())})"

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        optimizers = ensure_tuple(state.optimizers)
        if len(optimizers) != 1:
            raise ValueError(f"Dash needs exactly one optimizer in the trainer, found {len(optimizers)}")
        dash = self.conversion.convert(optimizers[0], model=state.model)
        # Composer saves through torch.distributed.checkpoint, which calls state_dict()
        # on every rank: let DASH gather the blocks of all ranks inside that call.
        dash.collective_state_dict = True
        state.optimizers = dash
        self.optimizer = dash
        log.info(
            "Dash: replaced %s by DASH%s",
            type(optimizers[0]).__name__,
            "" if dash.distributor is None else f" (blocks owned across {dash.distributor.world_size} ranks)",
        )

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
