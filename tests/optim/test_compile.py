"""``DASH(compile=True)``: the per-stack update and grafting compiled whole, equal to eager.

Compiled with ``torch.compile(fullgraph=True)``; the hyperparameters enter as tensors,
so learning-rate schedules, bias corrections and root refreshes reuse the graphs the
first step compiled. Dynamo's own counters say so exactly. A full graph also cannot
read a value back to the host (``item()`` or a data-dependent shape would break it), and
the host side of a compiled step is the eager one that ``test_step_shape.py`` counts.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from lightning_dash import DASH


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    # float64, so fused and unfused arithmetic agree to far below the tolerance
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4)).double()


def test_compiled_steps_equal_eager_without_graph_breaks_recompiles_or_host_waits():
    eager_net, compiled_net = model(), model()
    options = {"lr": 0.01, "precondition_frequency": 2, "block_size": 16, "weight_decay": 0.1}
    eager = DASH(eager_net.parameters(), **options)
    compiled = DASH(compiled_net.parameters(), compile=True, **options)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.8) for o in (eager, compiled)]
    counters.clear()
    graphs_after_first_step = None
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 8):
        x = torch.randn(8, 16, generator=generator, dtype=torch.float64)
        for net, optimizer in ((eager_net, eager), (compiled_net, compiled)):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            if step == 4:  # a non-finite gradient: the step is skipped on the device
                net[0].weight.grad[0, 0] = math.nan
        eager.step()
        compiled.step()
        for schedule in schedules:
            schedule.step()  # a new learning rate every step
        if step == 1:
            graphs_after_first_step = counters["stats"]["unique_graphs"]
    assert graphs_after_first_step > 0
    assert counters["stats"]["unique_graphs"] == graphs_after_first_step  # refreshes and new lrs reuse them
    assert not counters["graph_break"]
    assert eager.nonfinite_grad_skips == compiled.nonfinite_grad_skips == 1
    for a, b in zip(eager_net.parameters(), compiled_net.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_compiled_steps_equal_eager_at_extreme_gradient_scales():
    """The compiled kernels keep the eager path's safeguards (factors stored over a float64
    scale, ``hypot`` second moments, one-pass float64 block norms): at 1e-30 and 1e20 the
    float64 runs agree, and every parameter stays finite."""
    for scale in (1e-30, 1e20):
        eager_net, compiled_net = model(), model()
        eager = DASH(eager_net.parameters(), lr=0.01, precondition_frequency=2, block_size=16)
        compiled = DASH(compiled_net.parameters(), lr=0.01, precondition_frequency=2, block_size=16, compile=True)
        generator = torch.Generator().manual_seed(2)
        for _ in range(4):
            x = torch.randn(8, 16, generator=generator, dtype=torch.float64)
            for net, optimizer in ((eager_net, eager), (compiled_net, compiled)):
                optimizer.zero_grad()
                (scale * net(x).square().mean()).backward()
                optimizer.step()
        assert eager.nonfinite_grad_skips == compiled.nonfinite_grad_skips == 0
        for a, b in zip(eager_net.parameters(), compiled_net.parameters(), strict=True):
            assert torch.isfinite(b).all()
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_groups_with_different_hyperparameters_in_one_stack_equal_separate_optimizers(compile):
    """Two groups whose blocks share stacks (and a flat vector buffer) but not their lr and
    betas step exactly as two separate DASH optimizers would, in float64, also after one
    vector stops getting gradients (per-block and per-element values expanded on the device)."""
    torch.manual_seed(0)
    shapes = [(8, 8), (5,), (8, 8), (7,)]
    joint_params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    alone_params = [p.detach().clone().requires_grad_() for p in joint_params]
    first, second = {"lr": 0.01}, {"lr": 0.02, "betas": (0.8, 0.9)}
    options = {"precondition_frequency": 1, "block_size": 8}
    joint = DASH(
        [{"params": joint_params[:2], **first}, {"params": joint_params[2:], **second}], compile=compile, **options
    )
    alone = [DASH(alone_params[:2], **first, **options), DASH(alone_params[2:], **second, **options)]
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        for p, q in zip(joint_params, alone_params, strict=True):
            p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64)
            q.grad = p.grad.clone()
        if step == 2:
            joint_params[3].grad = alone_params[3].grad = None
        joint.step()
        for optimizer in alone:
            optimizer.step()
    for p, q in zip(joint_params, alone_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
