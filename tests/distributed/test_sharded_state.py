"""Consolidating a sharded DASH in two gloo processes, in the states where its statistics
are not stacked: right after ``add_param_group`` and right after ``load_state_dict``.
The consolidated state must equal a single-process DASH fed the same gradients."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.spawning import START_METHOD

from lightning_dash import DASH
from lightning_dash.distributed import ProcessGroupDistributor
from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit

OPTIONS = dict(lr=0.01, block_size=8, precondition_frequency=2, epsilon=1e-4)


def _parameters() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(24, 16, generator=generator),
        torch.randn(16, 8, generator=generator),
        torch.randn(16, generator=generator),
    ]


def _late_parameter() -> torch.Tensor:
    return torch.randn(8, 12, generator=torch.Generator().manual_seed(1))


def _train(optimizer: DASH, params: list[torch.Tensor], steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def _single_process_state() -> dict:
    """The same sequence without sharding: train, add a group, save."""
    params = [p.requires_grad_() for p in _parameters()]
    optimizer = DASH(params[:2], **OPTIONS)
    optimizer.add_param_group({"params": [params[2]]})
    _train(optimizer, params, 3, seed=5)
    optimizer.add_param_group({"params": [_late_parameter().requires_grad_()]})
    return optimizer.state_dict()


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    settle_gloo_workers_at_exit()  # no abort at exit (see its module)
    try:
        states = {}
        params = [p.requires_grad_() for p in _parameters()]
        optimizer = DASH(params[:2], **OPTIONS)
        optimizer.add_param_group({"params": [params[2]]})
        optimizer.distributor = ProcessGroupDistributor()
        _train(optimizer, params, 3, seed=5)
        late = _late_parameter().requires_grad_()
        optimizer.add_param_group({"params": [late]})
        optimizer.consolidate_state_dict()
        states["after_add"] = optimizer.state_dict() if rank == 0 else None
        owned = optimizer.owned_blocks

        # Every rank loads the complete state (as Lightning and Composer do), then saves
        # again without a step in between.
        complete = [states["after_add"]]
        dist.broadcast_object_list(complete, src=0)
        copies = [p.detach().clone().requires_grad_() for p in [*params, late]]
        fresh = DASH(copies[:2], **OPTIONS)
        fresh.add_param_group({"params": [copies[2]]})
        fresh.add_param_group({"params": [copies[3]]})
        fresh.distributor = ProcessGroupDistributor()
        fresh.load_state_dict(complete[0])
        fresh.consolidate_state_dict()
        states["after_load"] = fresh.state_dict() if rank == 0 else None
        # Fabric's and Lightning's rule (consolidate on every rank, then state_dict() on rank 0
        # alone) with collective_state_dict set must not consolidate a second time.
        fresh.collective_state_dict = True
        fresh.consolidate_state_dict()
        states["rank_zero_rule"] = fresh.state_dict() if rank == 0 else None
        states["owned"] = owned
        torch.save(states, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _assert_same_state(ours: dict, expected: dict) -> None:
    # The sharded optimizer has stacked the group added last (no step yet); the
    # single-process one has not created its state at all.
    extra = ours["state"].keys() - expected["state"].keys()
    assert all(float(ours["state"][key]["step"]) == 0 for key in extra)
    assert expected["state"].keys() <= ours["state"].keys()
    for key, entry in expected["state"].items():
        assert ours["state"][key].keys() == entry.keys(), key
        for name, value in entry.items():
            torch.testing.assert_close(
                ours["state"][key][name],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, key=key, name=name: f"state[{key}][{name}]: {m}",
            )


@pytest.mark.multiprocess
def test_consolidation_after_add_param_group_and_after_load(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method=START_METHOD)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert ranks[0]["owned"] > 0 and ranks[1]["owned"] > 0  # both ranks really own blocks
    expected = _single_process_state()
    _assert_same_state(ranks[0]["after_add"], expected)
    _assert_same_state(ranks[0]["after_load"], expected)
    _assert_same_state(ranks[0]["rank_zero_rule"], expected)


def test_saved_step_count_is_a_copy() -> None:
    params = [p.requires_grad_() for p in _parameters()]
    optimizer = DASH(params, **OPTIONS)
    _train(optimizer, params, 2, seed=3)
    saved = optimizer.state_dict()
    _train(optimizer, params, 1, seed=4)
    assert all(float(entry["step"]) == 2 for entry in saved["state"].values())
