"""Log DASH's optimizer-step time and health counters through Composer's logger."""

from __future__ import annotations

import time
import warnings

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist
from typing_extensions import override

from lightning_dash.distributed.gradient_sync import CommStats, ring_allreduce_bytes
from lightning_dash.integration import dash_metrics, dash_settings
from lightning_dash.integration.traffic import fsdp_bytes_per_step
from lightning_dash.optim import DASH
from lightning_dash.optim.validation import check_int

__all__ = ["DashComposerMonitor", "DashMonitor"]


class DashComposerMonitor(Callback):
    """Composer counterpart of :class:`lightning_dash.callbacks.DashMonitor`, logging the same metrics.

    Every ``logging_interval`` batches it logs :func:`~lightning_dash.integration.dash_metrics`
    (``dash/optimizer_step_ms``, ``dash/root_failures``, ``dash/nonfinite_grad_skips``,
    ``dash/nonfinite_update_skips``, ``dash/ownership_balance``, ``dash/state_bytes``,
    ``dash/micro_groups`` and ``dash/peak_gathered_bytes`` under FSDP2,
    ``dash/root_residual`` when the step's roots have one, the ``dash/async_*`` counters with
    ``async_preconditioning``). ``dash/optimizer_step_ms`` is the wall time from
    ``Event.AFTER_TRAIN_BATCH`` (the gradients are complete) to ``Event.BATCH_END``: the
    optimizer step plus Composer's loss reduction and scheduler step, with CUDA synchronised
    at both ends when the model is on a GPU. With several processes it also logs the mean
    traffic per step of this rank: ``dash/grad_sync_bytes_sent_per_step`` (and
    ``..._received_...``), counted from the collectives' sizes (DDP's ring all-reduce of the
    gradients, or FSDP2's all-gathers and reduce-scatters), and
    ``dash/optimizer_bytes_sent_per_step``, DASH's own block exchange. Composer's
    ``OptimizerMonitor`` keeps working next to it (it reads the gradients).

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
        #: This rank's gradient-synchronisation and block-exchange traffic since ``fit_start``.
        self.comm_stats = CommStats()
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
        self.comm_stats = CommStats()
        self._started = None

    @override
    def after_train_batch(self, state: State, logger: Logger) -> None:
        if (state.timestamp.batch.value + 1) % self.logging_interval != 0:
            return
        self._synchronize(state)
        self._started = time.perf_counter()

    def _count_traffic(self, state: State, dash: DASH) -> None:
        world_size = dist.get_world_size()
        if world_size == 1:
            return
        if state.fsdp_config_version == 2:
            traffic = fsdp_bytes_per_step(state.model, world_size)
        else:
            gradients = sum(p.numel() * p.element_size() for p in state.model.parameters() if p.requires_grad)
            traffic = ring_allreduce_bytes(gradients, world_size)
        self.comm_stats.steps += 1
        self.comm_stats.record(traffic, traffic)
        self.comm_stats.optimizer_bytes_sent = float(getattr(dash.distributor, "bytes_sent", 0))

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        dash = self._dash(state)
        self._count_traffic(state, dash)
        if self._started is None:
            return
        self._synchronize(state)
        elapsed_ms = (time.perf_counter() - self._started) * 1e3
        self._started = None
        logger.log_metrics(dash_metrics(dash, elapsed_ms, self.comm_stats if self.comm_stats.steps else None))


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
