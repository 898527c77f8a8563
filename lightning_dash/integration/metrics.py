"""The metrics both DASH monitors log, under the same names.

Lightning's :class:`~lightning_dash.callbacks.DashMonitor` and Composer's
:class:`~lightning_dash.composer.DashComposerMonitor` measure the optimizer step
their own way and hand the time to :func:`dash_metrics`, so dashboards read the
same keys from either trainer.
"""

from __future__ import annotations

from lightning_dash.distributed.gradient_sync import CommStats
from lightning_dash.optim import DASH


def dash_settings(optimizer: DASH) -> dict[str, str]:
    """What DASH chose for this device, logged once as hyperparameters at fit start:
    ``dash/inverse_root_method`` is the solver in use (what ``"auto"`` picked)."""
    return {"dash/inverse_root_method": optimizer.inverse_root_method_in_use}


def dash_metrics(optimizer: DASH, step_ms: float, comm_stats: CommStats | None = None) -> dict[str, float]:
    """DASH's step time and health, as ``{"dash/<name>": value}``.

    - ``dash/optimizer_step_ms``: ``step_ms``, the optimizer step's wall time as the monitor measured it;
    - ``dash/root_failures``, ``dash/nonfinite_grad_skips``, ``dash/nonfinite_update_skips``:
      cumulative counters (roots rejected as non-finite or unconverged; steps skipped whole
      for a non-finite gradient or update);
    - ``dash/root_residual``: largest Newton residual of the latest step's roots, only when
      that step computed (or swapped in) roots with a residual; reading it synchronises
      the host with the device;
    - ``dash/ownership_balance``: max/mean per-rank block cost (1.0 in one process);
    - ``dash/state_bytes``: the optimizer state this rank holds (:meth:`DASH.state_bytes`);
    - ``dash/micro_groups``, ``dash/peak_gathered_bytes``, where parameters are sharded: the
      micro-groups a step exchanges blocks in, and the most bytes of whole blocks this rank
      holds at once (:class:`~lightning_dash.distributed.ShardedDistributor`);
    - ``dash/async_roots_hidden``, ``dash/async_roots_waited``, ``dash/async_wait_ms``, only
      with ``async_preconditioning``: root launches swapped in without waiting, launches
      waited for, and the time stalled in those waits (cumulative, this rank's);
    - ``dash/grad_sync_bytes_sent_per_step``, ``dash/grad_sync_bytes_received_per_step``: mean
      gradient-synchronisation traffic of this rank, when ``comm_stats`` has counted steps;
    - ``dash/optimizer_bytes_sent_per_step``: mean bytes this rank's block exchange sent (the
      updates' all-gather under DDP, the gradient and update rows under FSDP2), when counted.
    """
    metrics = {
        "dash/optimizer_step_ms": float(step_ms),
        "dash/root_failures": float(optimizer.root_failure_count),
        "dash/nonfinite_grad_skips": float(optimizer.nonfinite_grad_skips),
        "dash/nonfinite_update_skips": float(optimizer.nonfinite_update_skips),
        "dash/ownership_balance": float(optimizer.ownership_balance),
        "dash/state_bytes": float(optimizer.state_bytes()),
    }
    peak = getattr(optimizer.distributor, "peak_gathered_bytes", None)
    if peak is not None:
        metrics["dash/micro_groups"] = float(optimizer.distributor.micro_groups)
        metrics["dash/peak_gathered_bytes"] = float(peak)
    residual = optimizer.last_root_residual
    if residual is not None:
        metrics["dash/root_residual"] = float(residual.item())
    if optimizer.async_preconditioning:
        metrics["dash/async_roots_hidden"] = float(optimizer.async_roots_hidden)
        metrics["dash/async_roots_waited"] = float(optimizer.async_roots_waited)
        metrics["dash/async_wait_ms"] = float(optimizer.async_wait_ms)
    if comm_stats is not None and comm_stats.steps:
        traffic = comm_stats.as_dict()
        metrics["dash/grad_sync_bytes_sent_per_step"] = traffic["bytes_sent_per_step"]
        metrics["dash/grad_sync_bytes_received_per_step"] = traffic["bytes_received_per_step"]
        if comm_stats.optimizer_bytes_sent:
            metrics["dash/optimizer_bytes_sent_per_step"] = traffic["optimizer_bytes_sent_per_step"]
    return metrics
