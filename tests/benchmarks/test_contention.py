"""The main job's check that its timed runs had the CPU (``lightning_dash.showcase.contention``):
real measurements of a phase that computes and of one that waits, and the verdict's arithmetic."""

from __future__ import annotations

import os
import time

import pytest

from lightning_dash.showcase.contention import STARVED_SHARE, CpuShare, contention_warning, measured


def phase(cpu_s: float, wall_s: float = 10.0, threads: int = 1) -> CpuShare:
    return CpuShare(wall_s=wall_s, cpu_s=cpu_s, threads=threads, load_before=0.0, load_after=0.0)


def test_a_phase_that_computes_uses_its_thread_and_one_that_waits_does_not():
    with measured(threads=1) as busy:
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:
            sum(range(1000))
    with measured(threads=1) as waiting:
        time.sleep(0.3)
    assert busy[0].wall_s >= 0.3 and waiting[0].wall_s >= 0.3
    assert waiting[0].share < 0.2 < busy[0].share <= 1.05
    assert contention_warning({"waiting": waiting[0]}) is not None


def test_the_share_is_cpu_time_over_what_the_threads_could_use():
    assert phase(cpu_s=5.0).share == pytest.approx(0.5)
    assert phase(cpu_s=16.0, threads=2).share == pytest.approx(0.8)
    cores = os.cpu_count() or 1
    # more threads than cores can use at most every core
    assert phase(cpu_s=10.0 * cores, threads=cores + 8).share == pytest.approx(1.0)


def test_the_verdict_names_a_starved_run_and_unequal_runs_and_passes_fair_ones():
    assert contention_warning({"adamw": phase(9.0), "dash": phase(9.5)}) is None
    starved = contention_warning({"adamw": phase(9.0), "dash": phase(10.0 * STARVED_SHARE - 1.0)})
    assert starved is not None and "dash" in starved and "adamw" not in starved.split("under")[1]
    unequal = contention_warning({"adamw": phase(9.8), "dash": phase(6.2)})
    assert unequal is not None and "unequal" in unequal
    assert contention_warning({}) is None
