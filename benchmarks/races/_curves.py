"""Evaluation curves: a run's validation loss at its evaluation steps, and when it first reached a target.

``convergence.py`` and ``peers.py`` score their runs so: steps (and seconds) to AdamW's final loss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One evaluation: optimizer steps done, training seconds so far, validation loss."""

    step: int
    wall_s: float
    val_loss: float


def first_reaching(curve: list[Point], target: float) -> Point | None:
    """The first evaluation after step 0 with validation loss at or below ``target``."""
    return next((point for point in curve if point.step > 0 and point.val_loss <= target), None)
