"""DASH.from_optimizer: the user's optimizer becomes DASH over the same groups."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_dash import DASH, DashConfig


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


def test_from_adamw_steps_like_plain_dash_at_the_same_lr():
    """One lr meaning: DASH converted from AdamW takes the same steps as DASH built directly with the
    AdamW's lr and its mapped hyperparameters (grafting gives each block AdamW's step size, times the same
    default lr_scale either way)."""
    converted, direct = model(), model()
    lr, decay = 0.01, 0.1
    source = torch.optim.AdamW(converted.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-7, weight_decay=decay)
    from_adamw = DASH.from_optimizer(source)
    plain = DASH(
        direct.parameters(), lr=lr, betas=(0.9, 0.95), grafting_beta2=0.999, grafting_epsilon=1e-7, weight_decay=decay
    )
    assert from_adamw.lr_scale == plain.lr_scale == DashConfig().lr_scale and from_adamw.param_groups[0]["lr"] == lr
    torch.manual_seed(1)
    for _ in range(4):
        for p, q in zip(converted.parameters(), direct.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        from_adamw.step()
        plain.step()
    for p, q in zip(converted.parameters(), direct.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_lr_scale_multiplies_the_shampoo_direction_of_matrices_only():
    """``lr_scale=k`` moves every preconditioned block exactly k times as far and leaves 1-D
    parameters (which follow the grafting optimizer) exactly as at ``lr_scale=1``."""
    moves = {}
    for scale in (1.0, 3.0):
        net = model()
        dash = DASH.from_optimizer(torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.0), lr_scale=scale)
        before = [p.detach().clone() for p in net.parameters()]
        torch.manual_seed(2)
        for p in net.parameters():
            p.grad = torch.randn_like(p)
        dash.step()
        moves[scale] = [(p.detach() - b) for p, b in zip(net.parameters(), before)]
    for (name, param), one, three in zip(model().named_parameters(), moves[1.0], moves[3.0]):
        expected = 3.0 * one if param.dim() == 2 else one
        # atol: the moves are differences of float32 parameters of size ~0.5 (an ulp is 6e-8)
        torch.testing.assert_close(three, expected, rtol=1e-5, atol=2e-7, msg=name)
        assert one.abs().max() > 0


def test_lr_scale_of_a_conversion_is_overridable_and_no_source_scales_the_lr():
    net = model()
    assert DASH.from_optimizer(torch.optim.AdamW(net.parameters()), lr_scale=8.0).lr_scale == 8.0
    for source in (
        torch.optim.Adam(net.parameters()),
        torch.optim.AdamW(net.parameters()),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
        torch.optim.RMSprop(net.parameters()),
    ):
        assert DASH.from_optimizer(source).lr_scale == DashConfig().lr_scale
    assert not DASH.from_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)).nesterov
    assert DASH.from_optimizer(torch.optim.AdamW(net.parameters())).nesterov  # DASH's default


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_an_lr_scale_that_cannot_work_is_refused_by_name(value):
    with pytest.raises(ValueError, match="lr_scale"):
        DASH(model().parameters(), lr_scale=value)
    with pytest.raises(ValueError, match="lr_scale"):
        DASH.from_optimizer(torch.optim.AdamW(model().parameters()), lr_scale=value)


@pytest.mark.parametrize("value", [0, -2, 2.5, "auto", True, None])
def test_a_refresh_period_that_cannot_work_is_refused_by_name(value):
    with pytest.raises(ValueError, match="precondition_frequency"):
        DASH(model().parameters(), precondition_frequency=value)
    with pytest.raises(ValueError, match="precondition_frequency"):
        DASH([{"params": model().parameters(), "precondition_frequency": value}])


def test_sgd_with_momentum_and_nesterov():
    net = model()
    dash = DASH.from_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True))
    assert dash.grafting == "sgd" and dash.nesterov and dash.param_groups[0]["betas"][0] == 0.9


def test_the_conversion_logs_what_the_recipe_became(caplog):
    """A recipe converted silently would hide that SGD's step is now Shampoo's: one INFO line says so."""
    net = model()
    sgd = torch.optim.SGD(
        [{"params": net[0].parameters(), "lr": 0.1}, {"params": net[1].parameters()}],
        lr=0.01,
        momentum=0.9,
        weight_decay=5e-4,
    )
    with caplog.at_level(logging.INFO, logger="lightning_dash"):
        DASH.from_optimizer(sgd, block_size=4)
    (record,) = [r for r in caplog.records if r.name == "lightning_dash"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "DASH from SGD: grafting sgd, lr 0.1 / 0.01 per group (the recipe's), momentum 0.9, decoupled weight "
        "decay 0.0005; precondition auto, block_size 4, precondition_frequency 10, lr_scale 2"
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_dash"):
        dash = DASH.from_optimizer(torch.optim.AdamW(model().parameters(), lr=3e-3), precondition="hidden")
        assert DASH.from_optimizer(dash) is dash  # nothing converted, nothing logged
    (record,) = caplog.records
    assert record.getMessage().startswith("DASH from AdamW: grafting adam, lr 0.003 (the recipe's), momentum 0.9, ")
    assert "; precondition hidden, " in record.getMessage()


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
