"""The host's side of DASH's steps: step counts, counters and the root-failure limit.

The device decides each step (:mod:`.device`) and the host reads the verdict one
step later (:mod:`.verdict`). :class:`StepBookkeeping`, held by
:class:`~lightning_dash.optim.DASH`, applies it: it undoes the step counts of a skipped
step, counts skips and rejected roots, and raises :class:`RootComputationError` at the
next step once a block's failure streak reached ``max_consecutive_root_failures``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.stacks.layout import Layout
from lightning_dash.optim.step.failures import raise_on_streak
from lightning_dash.optim.step.refresh import FailureReport, committed_streaks
from lightning_dash.optim.step.verdict import StepVerdict, VerdictQueue

#: The counters kept on the host (and carried by a state dict).
COUNTERS = ("root_failure_count", "nonfinite_grad_skips", "nonfinite_update_skips")


def advance_steps(state: dict[Any, dict[str, Any]], layout: Layout, active: set[int], delta: int) -> None:
    """Move the step counts of the ``active`` parameters by ``delta`` (in the layout and in ``state``)."""
    for index in active:
        layout.steps[index] += delta
    torch._foreach_add_([state[layout.params[i]]["step"] for i in sorted(active)], float(delta))


class StepBookkeeping:
    """Counters and step counts kept on the host from read-back step verdicts.

    Args:
        limit: ``max_consecutive_root_failures`` (None: no limit).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        #: The steps' verdicts on their way to the host.
        self.verdicts = VerdictQueue()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._streak_at_limit: int | None = None  # a failure streak the next step raises on

    def count(self, name: str) -> int:
        """A counter of :data:`COUNTERS`, with every verdict that reached the host counted."""
        self.verdicts.collect()
        return self._counts[name]

    def set_count(self, name: str, value: int) -> None:
        self._counts[name] = int(value)

    def add_failures(self, failed: int, longest: int) -> None:
        """Count rejected roots and note the longest failure streak."""
        self._counts["root_failure_count"] += failed
        if self.limit is not None and longest >= self.limit:
            self._streak_at_limit = longest

    def raise_on_streak(self, layout: Layout, method: Callable[[], str]) -> None:
        """Raise :class:`RootComputationError` for a streak a read-back verdict reported (``method``
        names the solver in the message; it is asked only then, not on every step)."""
        longest, self._streak_at_limit = self._streak_at_limit, None
        if longest is not None:
            report = FailureReport([], committed_streaks(layout))
            raise_on_streak(report, layout.names, longest, self.limit, method())

    def post(self, verdict: Tensor, state: dict[Any, dict[str, Any]], layout: Layout, active: set[int]) -> None:
        """Queue a step's device verdict; the host reads it one step later (:meth:`read`)."""
        self.verdicts.post(verdict, lambda read: self.read(read, state, layout, active))

    def read(self, verdict: StepVerdict, state: dict[Any, dict[str, Any]], layout: Layout, active: set[int]) -> None:
        """The host's side of a step, one step late: counters, step counts, the streak limit."""
        if verdict.grad_bad:
            self._counts["nonfinite_grad_skips"] += 1
        elif verdict.update_bad:
            self._counts["nonfinite_update_skips"] += 1
        if not verdict.applied:
            advance_steps(state, layout, active, -1)
            return
        self.add_failures(verdict.failed_roots, verdict.longest_streak)
