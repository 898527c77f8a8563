"""Whether a timed run had the CPU to itself, measured rather than assumed.

Wall time compares optimizers only when each run got the cores it asked for. A run that
shares them with another job (a test suite, a second training) stretches by however much
the other job takes, and can reverse a wall-time comparison while leaving the per-step
results untouched. :class:`CpuShare` measures, over one timed phase, the CPU time the
process used against what its threads could have used (wall time x threads, at most the
machine's cores), and the load average around it; :func:`contention_warning` says when the
wall-time results should not be trusted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Below this share of its threads' possible CPU time a phase was starved: the main job's quick mode
#: used 0.98 (AdamW) and 0.99 (DASH) alone on this project's 2-core VM, and 0.49 and 0.65 beside two
#: busy loops (2026-11-26).
STARVED_SHARE = 0.6
#: Two phases whose shares differ by more than this factor were not timed under equal conditions.
UNEQUAL_RATIO = 1.5


@dataclass(frozen=True)
class CpuShare:
    """One timed phase: wall and process CPU seconds, threads, and the 1-minute load average
    before and after it."""

    wall_s: float
    cpu_s: float
    threads: int
    load_before: float
    load_after: float

    @property
    def share(self) -> float:
        """CPU time used / CPU time its threads could have used (1.0: never waited for a core)."""
        usable = min(self.threads, os.cpu_count() or self.threads)
        return self.cpu_s / (self.wall_s * usable) if self.wall_s > 0 else 1.0


@contextmanager
def measured(threads: int) -> Iterator[list[CpuShare]]:
    """Measure the ``with`` body; the :class:`CpuShare` is appended to the yielded list on exit."""
    result: list[CpuShare] = []
    load_before = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield result
    finally:
        result.append(
            CpuShare(time.perf_counter() - wall, time.process_time() - cpu, threads, load_before, os.getloadavg()[0])
        )


def contention_warning(phases: dict[str, CpuShare]) -> str | None:
    """A sentence saying why the phases' wall times are unreliable, or None when they look fair:
    a phase that got under :data:`STARVED_SHARE` of its threads' CPU time, or two phases whose
    shares differ by more than :data:`UNEQUAL_RATIO`."""
    if not phases:
        return None
    shares = {name: phase.share for name, phase in phases.items()}
    described = ", ".join(f"{name} {share:.2f}" for name, share in shares.items())
    starved = [name for name, share in shares.items() if share < STARVED_SHARE]
    if starved:
        return (
            f"other processes took CPU time from this run (CPU share of its threads: {described}; "
            f"under {STARVED_SHARE} for {', '.join(starved)}): wall times are unreliable, compare steps"
        )
    if max(shares.values()) > UNEQUAL_RATIO * min(shares.values()):
        return f"the runs got unequal CPU time (CPU share of their threads: {described}): compare steps, not wall times"
    return None
