"""Timing budgets: step-time windows (a run's per-step seconds cut into windows, each one's mean), and runs per budget.

A window holds whole root-refresh cycles of the Shampoos being timed, so roots stay amortised
within it, and taking the median (or the minimum) over windows drops the ones that another
process on a shared machine slowed down. ``convergence.py`` and ``peers.py`` time their runs so.
"""

from __future__ import annotations

import math
import statistics


def full_windows(step_s: list[float], window: int) -> list[list[float]]:
    """The full ``window``-step windows of ``step_s`` (the partial one when none is full)."""
    windows = [step_s[i : i + window] for i in range(0, len(step_s), window)]
    return [w for w in windows if len(w) == window] or windows


def window_ms(step_s: list[float], window: int) -> list[float]:
    """Mean step time of each of :func:`full_windows`, in ms; ``[nan]`` when there are no steps."""
    return [1e3 * sum(w) / len(w) for w in full_windows(step_s, window)] or [math.nan]


def robust_step_ms(step_s: list[float], window: int) -> float:
    """Median over :func:`full_windows` of the mean step time, in ms; nan when there are no steps."""
    full = full_windows(step_s, window)
    return 1e3 * statistics.median(sum(w) / len(w) for w in full) if full else math.nan


def fitting(budget_s: float, sample_s: float, low: int, high: int) -> int:
    """How many more runs of ``sample_s`` seconds fit in ``budget_s``, kept within ``[low, high]``."""
    return max(low, min(high, int(budget_s / max(sample_s, 1e-9))))
