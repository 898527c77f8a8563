"""The step's shape on a device, counted exactly on the CPU: host synchronisations and
kernel launches (see :mod:`lightning_dash.testing.op_counts`).

A step that waits for the device, or whose launches grow with the model's depth, is
slow on a GPU whatever its FLOPs; both are structural facts, so they are tested here
rather than timed.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.toy_models import gpt_params

from lightning_dash import DASH
from lightning_dash.optim.roots import INVERSE_ROOT_METHODS
from lightning_dash.testing.op_counts import count_ops


def set_grads(params: list[tuple[str, torch.nn.Parameter]], step: int, scale: float = 1e-3) -> None:
    generator = torch.Generator().manual_seed(step)
    for _, param in params:
        param.grad = scale * torch.randn(param.shape, generator=generator)


def counted_steps(optimizer: DASH, params, steps: int, fault_at: int | None = None) -> list:
    """Counts of steps 2..steps (step 1 builds the stacks from ``optimizer.state``)."""
    counts = []
    for step in range(1, steps + 1):
        set_grads(params, step)
        if step == fault_at:
            params[3][1].grad[0] = math.nan
        _, measured = count_ops(optimizer.step)
        if step > 1:
            counts.append(measured)
    return counts


@pytest.mark.parametrize("method", INVERSE_ROOT_METHODS)
def test_no_step_waits_for_the_device_refresh_steps_included(method):
    params = gpt_params(layers=2)
    optimizer = DASH(params, lr=1e-3, inverse_root_method=method, precondition_frequency=2, epsilon=1e-4)
    # steps 2 and 4 refresh the roots, 3 does not; step 3 has a NaN gradient (skipped on the device)
    counts = counted_steps(optimizer, params, steps=4, fault_at=3)
    assert [c.sync_count for c in counts] == [0, 0, 0], [dict(c.syncs) for c in counts]
    assert counts[0].launch_count > 0
    # the host learned every verdict when it read the counters
    assert optimizer.nonfinite_grad_skips == 1 and optimizer.nonfinite_update_skips == 0


def test_per_group_hyperparameters_and_partial_gradients_do_not_wait_either():
    params = gpt_params(layers=2)
    named = dict(params)
    matrices = [p for n, p in params if p.dim() == 2]
    vectors = [p for n, p in params if p.dim() == 1]
    optimizer = DASH(
        [{"params": matrices, "lr": 1e-3, "weight_decay": 0.1}, {"params": vectors, "lr": 3e-3, "betas": (0.8, 0.9)}],
        precondition_frequency=1,
    )
    counts = []
    for step in range(1, 5):
        set_grads(params, step)
        if step >= 3:
            named["h.1.mlp.c_fc.weight"].grad = None  # one parameter stops getting gradients
        _, measured = count_ops(optimizer.step)
        counts.append(measured)
    assert [c.sync_count for c in counts[1:]] == [0, 0, 0], [dict(c.syncs) for c in counts]


@pytest.mark.parametrize("frequency", [1, 1000], ids=["refresh", "no-refresh"])
def test_launches_do_not_grow_with_depth(frequency):
    def launches(layers: int) -> int:
        params = gpt_params(layers)
        optimizer = DASH(params, lr=1e-3, precondition_frequency=frequency, start_preconditioning_step=1)
        return counted_steps(optimizer, params, steps=2)[0].launch_count

    shallow, deep = launches(6), launches(24)
    assert deep <= 1.1 * shallow, (shallow, deep)


def test_the_counter_sees_host_reads_and_ignores_views():
    x = torch.randn(4, 4)

    def work() -> float:
        y = x.view(16)[:8]  # views: no launch
        z = y * 2  # one launch
        z.tolist()  # a host read
        return float(z.sum())  # a launch and a host read

    value, counts = count_ops(work)
    assert value == pytest.approx(float((x.view(16)[:8] * 2).sum()))
    assert counts.launch_count == 2 and counts.sync_count == 2
    assert set(counts.syncs) == {"tolist", "_local_scalar_dense"}
