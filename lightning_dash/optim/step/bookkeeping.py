"""The host's side of DASH's steps: step counts, counters and the root-failure limit.

The device decides each step (:mod:`.device`) and the host reads the verdict one
step later (:mod:`.verdict`). :class:`StepBookkeeping`, a mixin of
:class:`~lightning_dash.optim.DASH`, applies it: it undoes the step counts of a skipped
step, counts skips and rejected roots, and raises :class:`RootComputationError` at the
next step once a block's failure streak reached ``max_consecutive_root_failures``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_dash.optim.stacks.layout import Layout
from lightning_dash.optim.step.failures import raise_on_streak
from lightning_dash.optim.step.refresh import FailureReport, committed_streaks
from lightning_dash.optim.step.verdict import StepVerdict, VerdictQueue


class StepBookkeeping:
    """Counters and step counts kept on the host from read-back step verdicts."""

    _counts: dict[str, int]
    _verdicts: VerdictQueue
    _streak_at_limit: int | None
    state: dict[Any, dict[str, Any]]

    # Each step's verdict reaches the host one step later; reading a counter collects it first.
    def _counter(name: str, doc: str) -> property:  # noqa: N805 (a property factory used in the class body)
        def read(self: StepBookkeeping) -> int:
            self._verdicts.collect()
            return self._counts[name]

        def write(self: StepBookkeeping, value: int) -> None:
            self._counts[name] = int(value)

        return property(read, write, doc=doc)

    root_failure_count = _counter(
        "root_failure_count",
        "Blocks whose new roots were rejected (non-finite, or a residual above "
        ":func:`~lightning_dash.optim.roots.solve.failure_residual`), over all ranks.",
    )
    nonfinite_grad_skips = _counter("nonfinite_grad_skips", "Steps skipped whole because some gradient was not finite.")
    nonfinite_update_skips = _counter(
        "nonfinite_update_skips", "Steps skipped whole because some computed update was not finite."
    )
    del _counter

    def _note_streak(self, longest: int) -> None:
        limit = self.max_consecutive_root_failures
        if limit is not None and longest >= limit:
            self._streak_at_limit = longest

    def _raise_on_streak(self, layout: Layout) -> None:
        """Raise :class:`RootComputationError` for a streak a read-back verdict reported."""
        longest, self._streak_at_limit = self._streak_at_limit, None
        if longest is not None:
            report = FailureReport([], committed_streaks(layout))
            limit = self.max_consecutive_root_failures
            raise_on_streak(report, layout.names, longest, limit, self.root_settings.method)

    def _read_verdict(self, layout: Layout, active: set[int], verdict: StepVerdict) -> None:
        """The host's side of a step, one step late: counters, step counts, the streak limit."""
        if verdict.grad_bad:
            self._counts["nonfinite_grad_skips"] += 1
        elif verdict.update_bad:
            self._counts["nonfinite_update_skips"] += 1
        if not verdict.applied:
            self._advance(layout, active, -1)
            return
        self._counts["root_failure_count"] += verdict.failed_roots
        self._note_streak(verdict.longest_streak)

    def _advance(self, layout: Layout, active: set[int], delta: int) -> None:
        """Move the step counts of the ``active`` parameters by ``delta``."""
        for index in active:
            layout.steps[index] += delta
        torch._foreach_add_([self.state[layout.params[i]]["step"] for i in sorted(active)], float(delta))
