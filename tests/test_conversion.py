"""DASH.from_optimizer: the user's optimizer becomes DASH over the same groups."""

from __future__ import annotations

import pytest
import torch

from lightning_dash import DASH
from lightning_dash.optim.conversion import ADAM_LR_SCALE


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))


def test_adamw_maps_onto_adam_grafting_and_shares_groups():
    net = model()
    adamw = torch.optim.AdamW(
        [{"params": net[0].parameters(), "lr": 0.1}, {"params": net[1].parameters(), "weight_decay": 0.5}],
        lr=0.01,
        betas=(0.8, 0.99),
        eps=1e-6,
        weight_decay=0.1,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)
    dash = DASH.from_optimizer(adamw, block_size=4, precondition_frequency=3)
    assert dash.grafting == "adam" and dash.block_size == 4
    assert all(a is b for a, b in zip(dash.param_groups, adamw.param_groups))
    first, second = dash.param_groups
    assert first["lr"] == 0.1 and second["lr"] == 0.01
    assert first["betas"] == (0.8, 0.95) and first["grafting_beta2"] == 0.99 and first["grafting_epsilon"] == 1e-6
    assert first["weight_decay"] == 0.1 and second["weight_decay"] == 0.5
    assert first["precondition_frequency"] == second["precondition_frequency"] == 3
    scheduler.step()  # the scheduler still edits the shared dictionaries
    assert dash.param_groups[0]["lr"] == pytest.approx(0.05)


def test_first_step_from_adamw_with_blend_zero_is_adamws_step():
    """With the Shampoo direction blended out, plain momentum and no lr scale, the converted optimizer
    takes AdamW's step."""
    reference, converted = model(), model()
    grads = [torch.randn_like(p) for p in reference.parameters()]
    adamw = torch.optim.AdamW(reference.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    dash = DASH.from_optimizer(
        torch.optim.AdamW(converted.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
        shampoo_blend=0.0,
        nesterov=False,
        lr_scale=1.0,
    )
    for p, q, g in zip(reference.parameters(), converted.parameters(), grads):
        p.grad, q.grad = g.clone(), g.clone()
    adamw.step()
    dash.step()
    for p, q in zip(reference.parameters(), converted.parameters()):
        torch.testing.assert_close(p, q)


def test_from_adamw_scales_the_update_by_the_measured_lr_ratio_but_not_the_weight_decay():
    """AdamW's recipe carries over with ``lr_scale=ADAM_LR_SCALE``: W (1 - lr wd) - 8 lr d, which is
    AdamW's own step at lr 8 lr and weight decay wd / 8 (the same decay factor)."""
    assert ADAM_LR_SCALE == 8.0
    reference, converted = model(), model()
    lr, decay = 0.01, 0.1
    adamw = torch.optim.AdamW(
        reference.parameters(), lr=ADAM_LR_SCALE * lr, betas=(0.9, 0.999), weight_decay=decay / ADAM_LR_SCALE
    )
    source = torch.optim.AdamW(converted.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=decay)
    dash = DASH.from_optimizer(source, shampoo_blend=0.0, nesterov=False)
    assert dash.lr_scale == ADAM_LR_SCALE and dash.param_groups[0]["lr"] == lr  # schedulers still see AdamW's lr
    for _ in range(3):
        for p, q in zip(reference.parameters(), converted.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        adamw.step()
        dash.step()
    for p, q in zip(reference.parameters(), converted.parameters()):
        torch.testing.assert_close(p, q)


def test_lr_scale_of_a_conversion_is_overridable_and_only_adam_sources_take_it():
    net = model()
    assert DASH.from_optimizer(torch.optim.AdamW(net.parameters()), lr_scale=1.0).lr_scale == 1.0
    assert DASH.from_optimizer(torch.optim.Adam(net.parameters())).lr_scale == ADAM_LR_SCALE
    assert DASH.from_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)).lr_scale == 1.0
    assert not DASH.from_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)).nesterov
    assert DASH.from_optimizer(torch.optim.AdamW(net.parameters())).nesterov  # DASH's default


def test_sgd_with_momentum_and_nesterov():
    net = model()
    dash = DASH.from_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True))
    assert dash.grafting == "sgd" and dash.nesterov and dash.param_groups[0]["betas"][0] == 0.9


def test_composer_style_decoupled_weight_decay_is_rescaled():
    class DecoupledAdamW(torch.optim.AdamW):
        """Stand-in with Composer's name and initial_lr bookkeeping (decay = wd * lr / initial_lr)."""

        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)
            for group in self.param_groups:
                group["initial_lr"] = group["lr"]

    opt = DecoupledAdamW(model().parameters(), lr=0.01, weight_decay=1e-5)
    dash = DASH.from_optimizer(opt)
    # W <- W (1 - lr * wd_dash) must equal Composer's W <- W (1 - wd * lr / initial_lr).
    assert dash.param_groups[0]["weight_decay"] == pytest.approx(1e-5 / 0.01)


def test_dash_is_returned_unchanged_and_unsupported_optimizers_are_named():
    dash = DASH(model().parameters())
    assert DASH.from_optimizer(dash) is dash
    with pytest.raises(TypeError, match="LBFGS"):
        DASH.from_optimizer(torch.optim.LBFGS(model().parameters()))
    with pytest.raises(ValueError, match="maximize"):
        DASH.from_optimizer(torch.optim.Adam(model().parameters(), maximize=True))
    with pytest.raises(ValueError, match="block_size"):
        DASH.from_optimizer(torch.optim.Adam(model().parameters()), block_size=0)
