"""Log DASH's optimizer-step time and health counters through Composer's logger."""

from __future__ import annotations

import time
from typing import Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger

from lightning_dash.optim import DASH
from lightning_dash.optim.validation import check_int

__all__ = ["DashMonitor"]


class DashMonitor(Callback):
    """Composer counterpart of :class:`lightning_dash.callbacks.DashMonitor`.

    Every ``log_interval`` batches it logs:

    - ``dash/optimizer_step_ms``: wall time from ``Event.AFTER_TRAIN_BATCH`` (the
      gradients are complete) to ``Event.BATCH_END``: the optimizer step plus
      Composer's loss reduction and scheduler step, with CUDA synchronised at both
      ends when the model is on a GPU;
    - ``dash/root_failures``, ``dash/nonfinite_grad_skips`` and ``dash/nonfinite_update_skips``:
      cumulative counters (roots rejected as non-finite or unconverged; steps skipped
      whole for a non-finite gradient or update);
    - ``dash/root_residual``: largest Newton residual of the batch's root computation
      (only on batches that computed roots with a residual);
    - ``dash/ownership_balance``: max/mean per-rank block cost (1.0 in one process).

    Composer's ``OptimizerMonitor`` keeps working next to it (it reads the gradients).

    Args:
        log_interval: log every this many batches.
    """

    def __init__(self, log_interval: int = 1) -> None:
        self.log_interval = check_int("log_interval", log_interval, low=1)
        self._started: Optional[float] = None

    @staticmethod
    def _dash(state: State) -> DASH:
        optimizer = state.optimizers[0] if state.optimizers else None
        if not isinstance(optimizer, DASH):
            raise RuntimeError(
                f"DashMonitor needs DASH as the trainer's optimizer (add algorithms=[Dash()]), "
                f"found {type(optimizer).__name__}"
            )
        return optimizer

    @staticmethod
    def _synchronize(state: State) -> None:
        if torch.cuda.is_available() and next(state.model.parameters()).is_cuda:
            torch.cuda.synchronize()

    def fit_start(self, state: State, logger: Logger) -> None:
        self._dash(state)
        self._started = None

    def after_train_batch(self, state: State, logger: Logger) -> None:
        if (state.timestamp.batch.value + 1) % self.log_interval != 0:
            return
        self._synchronize(state)
        self._started = time.perf_counter()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._started is None:
            return
        self._synchronize(state)
        elapsed_ms = (time.perf_counter() - self._started) * 1e3
        self._started = None
        optimizer = self._dash(state)
        metrics = {
            "dash/optimizer_step_ms": elapsed_ms,
            "dash/root_failures": float(optimizer.root_failure_count),
            "dash/nonfinite_grad_skips": float(optimizer.nonfinite_grad_skips),
            "dash/nonfinite_update_skips": float(optimizer.nonfinite_update_skips),
            "dash/ownership_balance": float(optimizer.ownership_balance),
        }
        if optimizer.last_root_residual is not None:
            metrics["dash/root_residual"] = float(optimizer.last_root_residual.item())
        logger.log_metrics(metrics)
