"""When a block recomputes its inverse roots (the ``root_schedule`` option)."""

from __future__ import annotations

from typing import Any

#: ``"from_start"``: at the start step s and every f steps after it (s, s + f, s + 2f, ...);
#: ``"multiples"``: at s and at every multiple of f after it (1, f, 2f, ... for s = 1), as the DASH
#: paper's code schedules them.
ROOT_SCHEDULES = ("from_start", "multiples")


def roots_due(step: int, group: dict[str, Any], schedule: str) -> bool:
    """Whether a block of ``group`` at its ``step`` recomputes its roots under ``schedule``."""
    start, frequency = group["start_preconditioning_step"], group["precondition_frequency"]
    if step < start:
        return False
    if schedule == "multiples":
        return step == start or step % frequency == 0
    return (step - start) % frequency == 0
