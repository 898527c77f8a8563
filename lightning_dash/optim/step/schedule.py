"""When a block recomputes its inverse roots (the ``root_schedule`` option)."""

from __future__ import annotations

from typing import Any

#: ``"doubling"``: at the start step s, at every step t < s + f whose count of gradients in the factors (t
#: itself) is a power of two (1, 2, 4, 8 for s = 1 and f = 10), and every f steps from s (s + f, s + 2f, ...);
#: ``"from_start"``: at s and every f steps after it (s, s + f, s + 2f, ...); ``"multiples"``: at s and at
#: every multiple of f after it (1, f, 2f, ... for s = 1), as the DASH paper's code schedules them.
ROOT_SCHEDULES = ("doubling", "from_start", "multiples")


def roots_due(step: int, group: dict[str, Any], schedule: str) -> bool:
    """Whether a block of ``group`` at its ``step`` recomputes its roots under ``schedule``.

    Why ``"doubling"``: a factor built from a handful of gradients spans only their directions, and its
    root, damped by a small ``epsilon``, magnifies every direction outside them by up to
    ``epsilon^(-1/2)``; kept for ``f`` steps, it turns the new gradients of those steps into noise. Refreshing
    each time the number of gradients in the factors (one per step, from the first step whatever ``s``)
    doubles keeps every root within a factor of two of its factors' age, for ``log2(f)`` extra refreshes
    per run.
    """
    start, frequency = group["start_preconditioning_step"], group["precondition_frequency"]
    if step < start:
        return False
    if schedule == "multiples":
        return step == start or step % frequency == 0
    # the factors hold ``step`` gradients (they advance from the first step on)
    if schedule == "doubling" and step - start < frequency and step & (step - 1) == 0:
        return True
    return (step - start) % frequency == 0
