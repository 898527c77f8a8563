"""Log DASH's step time and health counters to the trainer's loggers."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dash.callbacks.grafting_schedule import _dash_optimizer
from lightning_dash.integration import dash_metrics, dash_settings
from lightning_dash.optim.validation import check_int
from lightning_dash.strategies import DashFSDPStrategy, DashStrategy


class DashMonitor(Callback):
    """Log the optimizer step's wall time and DASH's diagnostics every few optimizer steps.

    The metrics are those of :func:`~lightning_dash.integration.dash_metrics` (the same
    names Composer's :class:`~lightning_dash.composer.DashComposerMonitor` logs), written
    with ``logger.log_metrics`` to every logger of the trainer, at the step index
    Lightning uses for the batch's own metrics (nothing when there is no logger):

    - ``dash/optimizer_step_ms``: wall time from ``on_before_optimizer_step`` to
      ``on_train_batch_end`` (the optimizer step plus gradient clipping and step-wise
      LR schedulers), with CUDA synchronised at both ends when the module is on a GPU;
    - ``dash/root_failures``, ``dash/nonfinite_grad_skips``, ``dash/nonfinite_update_skips``,
      ``dash/ownership_balance``, ``dash/state_bytes``, and ``dash/root_residual`` when the
      step's roots have one;
    - ``dash/micro_groups`` and ``dash/peak_gathered_bytes`` under ``"dash_fsdp"``: the
      micro-groups a step exchanges blocks in and the most bytes of whole blocks held at once;
    - ``dash/async_roots_hidden``, ``dash/async_roots_waited``, ``dash/async_wait_ms`` with
      ``async_preconditioning``;
    - ``dash/grad_sync_bytes_sent_per_step`` and ``..._received_per_step``: the mean traffic
      of gradient synchronisation so far (DDP's all-reduce, or FSDP2's all-gathers and
      reduce-scatter), and ``dash/optimizer_bytes_sent_per_step``, the mean traffic of DASH's
      own block exchange, under :class:`~lightning_dash.DashStrategy` or
      :class:`~lightning_dash.DashFSDPStrategy` (which count them).

    Only logging steps synchronise the host with the device (the timing and the
    residual's ``.item()``); the other steps cost nothing.

    Args:
        logging_interval: log after every this many optimizer steps (``global_step``).
    """

    def __init__(self, logging_interval: int = 1) -> None:
        self.logging_interval = check_int("logging_interval", logging_interval, low=1)
        self._started: float | None = None
        self._step: int | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        settings = dash_settings(_dash_optimizer(trainer, self))
        if not trainer.loggers:
            rank_zero_warn("DashMonitor: the trainer has no logger, so nothing will be logged.")
        for logger in trainer.loggers:
            logger.log_hyperparams(settings)
        self._started = None

    @staticmethod
    def _synchronize(pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        upcoming = trainer.global_step + 1
        if not trainer.loggers or upcoming % self.logging_interval != 0:
            return
        self._synchronize(pl_module)
        self._step = upcoming
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._started is None:
            return
        self._synchronize(pl_module)
        elapsed_ms = (time.perf_counter() - self._started) * 1e3
        self._started = None
        if trainer.global_step != self._step:
            return  # the step was skipped (e.g. by a gradient scaler); nothing to report
        strategy = trainer.strategy
        comm_stats = strategy.comm_stats if isinstance(strategy, (DashStrategy, DashFSDPStrategy)) else None
        metrics = dash_metrics(_dash_optimizer(trainer, self), elapsed_ms, comm_stats)
        # The index Lightning gives this batch's own metrics (as LearningRateMonitor does).
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
