"""Running a check in several gloo processes, one per rank, and how the tests start ranks."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

#: How the tests start their ranks, here and in the trainers' tests. A forked rank inherits the
#: modules its parent imported; a spawned one imports torch and Lightning again, and Lightning pulls
#: in torchmetrics and transformers: about 13 s of CPU per rank on the 2-core test machine, most of
#: a two-rank test's time. Spawning keeps its own tests, the ones that pass ``"spawn"`` by name (the
#: demo, the CLI, a sharded run, a Fabric run): they check that what a spawned rank unpickles works.
START_METHOD = "fork"


def _run(rank: int, world_size: int, init_file: str, check) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=90)
    )
    try:
        check(rank, world_size)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    # Every check passed and the group is gone: leave without interpreter finalisation, where a gloo
    # worker still releasing the last collective's tensors aborts the process ("terminate called
    # without an active exception"; lightning_dash.distributed.gloo_exit explains the race).
    os._exit(0)


def spawn(check, world_size: int, tmp_path) -> None:
    """Run ``check(rank, world_size)`` in ``world_size`` processes; an interrupted run (Ctrl-C,
    SIGTERM) ends them rather than leaving them to wait for their peers."""
    ranks = mp.start_processes(
        _run, args=(world_size, str(tmp_path / "init"), check), nprocs=world_size, join=False, start_method=START_METHOD
    )
    try:
        while not ranks.join():
            pass
    except BaseException:
        for process in ranks.processes:
            if process.is_alive():
                process.terminate()
        raise
