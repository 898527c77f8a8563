"""Log DASH's optimizer-step time and health counters through Composer's logger."""

from __future__ import annotations

import time
import warnings

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from typing_extensions import override

from lightning_dash.integration import dash_metrics, dash_settings
from lightning_dash.optim import DASH
from lightning_dash.optim.validation import check_int

__all__ = ["DashComposerMonitor", "DashMonitor"]


class DashComposerMonitor(Callback):
    """Composer counterpart of :class:`lightning_dash.callbacks.DashMonitor`, logging the same metrics.

    Every ``logging_interval`` batches it logs :func:`~lightning_dash.integration.dash_metrics`
    (``dash/optimizer_step_ms``, ``dash/root_failures``, ``dash/nonfinite_grad_skips``,
    ``dash/nonfinite_update_skips``, ``dash/ownership_balance``, ``dash/root_residual`` when
    the step's roots have one, the ``dash/async_*`` counters with ``async_preconditioning``).
    ``dash/optimizer_step_ms`` is the wall time from ``Event.AFTER_TRAIN_BATCH`` (the
    gradients are complete) to ``Event.BATCH_END``: the optimizer step plus Composer's loss
    reduction and scheduler step, with CUDA synchronised at both ends when the model is on
    a GPU. Composer's DDP all-reduce is not counted, so there are no ``dash/grad_sync_*``
    metrics. Composer's ``OptimizerMonitor`` keeps working next to it (it reads the gradients).

    Args:
        logging_interval: log every this many batches.
        log_interval: deprecated name of ``logging_interval``.
    """

    def __init__(self, logging_interval: int = 1, *, log_interval: int | None = None) -> None:
        if log_interval is not None:
            warnings.warn(
                f"{type(self).__name__}(log_interval=...) is deprecated: use logging_interval",
                DeprecationWarning,
                stacklevel=2,
            )
            if logging_interval not in (1, log_interval):
                raise ValueError("log_interval is the deprecated name of logging_interval: give only logging_interval")
            logging_interval = check_int("log_interval", log_interval, low=1)
        self.logging_interval = check_int("logging_interval", logging_interval, low=1)
        self._started: float | None = None

    def _dash(self, state: State) -> DASH:
        optimizer = state.optimizers[0] if state.optimizers else None
        if not isinstance(optimizer, DASH):
            raise TypeError(
                f"{type(self).__name__} needs DASH as the trainer's optimizer (add algorithms=[Dash()]), "
                f"found {type(optimizer).__name__}"
            )
        return optimizer

    @staticmethod
    def _synchronize(state: State) -> None:
        if torch.cuda.is_available() and next(state.model.parameters()).is_cuda:
            torch.cuda.synchronize()

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        logger.log_hyperparameters(dash_settings(self._dash(state)))
        self._started = None

    @override
    def after_train_batch(self, state: State, logger: Logger) -> None:
        if (state.timestamp.batch.value + 1) % self.logging_interval != 0:
            return
        self._synchronize(state)
        self._started = time.perf_counter()

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        if self._started is None:
            return
        self._synchronize(state)
        elapsed_ms = (time.perf_counter() - self._started) * 1e3
        self._started = None
        logger.log_metrics(dash_metrics(self._dash(state), elapsed_ms))


class DashMonitor(DashComposerMonitor):
    """Deprecated alias of :class:`DashComposerMonitor`, removed in the next release."""

    def __init__(self, logging_interval: int = 1, *, log_interval: int | None = None) -> None:
        warnings.warn(
            "lightning_dash.composer.DashMonitor is deprecated and will be removed in the next release: "
            "use DashComposerMonitor",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(logging_interval, log_interval=log_interval)
