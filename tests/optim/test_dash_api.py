"""Behaviour a torch.optim user relies on: closures, groups, schedulers, grads."""

from __future__ import annotations

import pytest
import torch

from lightning_dash import DASH


def test_closure_runs_with_grad_enabled_and_its_loss_is_returned():
    model = torch.nn.Linear(4, 3)
    opt = DASH(model.parameters(), block_size=4)
    x = torch.randn(8, 4)

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert opt.state_dict()["state"][0]["step"].item() == 1


def test_grad_is_never_overwritten_and_none_grads_are_skipped():
    model = torch.nn.Linear(6, 5)
    opt = DASH(model.parameters(), block_size=4, lr=0.1)
    model.weight.grad = torch.randn(5, 6)
    grad_copy = model.weight.grad.clone()
    bias_before = model.bias.detach().clone()
    opt.step()
    assert torch.equal(model.weight.grad, grad_copy)
    assert torch.equal(model.bias, bias_before)
    state = opt.state_dict()["state"]
    assert state[0]["step"].item() == 1 and state[1]["step"].item() == 0


def test_per_group_learning_rate_weight_decay_and_betas():
    """Two identical parameters in groups with different settings match two separate optimizers."""
    generator = torch.Generator().manual_seed(0)
    init, grads = torch.randn(6, 6, generator=generator), [torch.randn(6, 6, generator=generator) for _ in range(3)]
    settings = [dict(lr=0.01, weight_decay=0.0, betas=(0.9, 0.95)), dict(lr=0.2, weight_decay=0.5, betas=(0.0, 1.0))]
    grouped = [torch.nn.Parameter(init.clone()) for _ in settings]
    opt = DASH([{"params": [p], **s} for p, s in zip(grouped, settings)], block_size=4, precondition_frequency=1)
    alone = [torch.nn.Parameter(init.clone()) for _ in settings]
    solo = [DASH([p], block_size=4, precondition_frequency=1, **s) for p, s in zip(alone, settings)]
    for g in grads:
        for p in grouped + alone:
            p.grad = g.clone()
        opt.step()
        for o in solo:
            o.step()
    for p, q in zip(grouped, alone):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(grouped[0], grouped[1])


def test_scheduler_drives_the_step_size():
    """With SGD grafting in the Frobenius norm and no momentum each step is exactly lr_scale * lr * g in norm
    per block (lr_scale: its default, 2)."""
    weight = torch.nn.Parameter(torch.zeros(4, 4))
    options = dict(grafting="sgd", grafting_norm="frobenius", block_size=4, epsilon=1e-6)
    opt = DASH([weight], lr=1.0, betas=(0.0, 0.95), **options)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    grad = torch.randn(4, 4)
    for expected_lr in (1.0, 0.5, 0.25):
        before = weight.detach().clone()
        weight.grad = grad
        opt.step()
        scheduler.step()
        torch.testing.assert_close((weight - before).norm(), 2.0 * expected_lr * grad.norm(), rtol=1e-5, atol=0)


def test_nesterov_changes_the_direction_but_not_the_first_step():
    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(5, 5, generator=generator) for _ in range(2)]
    runs = {}
    for nesterov in (False, True):
        weight = torch.nn.Parameter(torch.zeros(5, 5))
        opt = DASH([weight], lr=0.1, nesterov=nesterov, block_size=8)
        trajectory = []
        for g in grads:
            weight.grad = g
            opt.step()
            trajectory.append(weight.detach().clone())
        runs[nesterov] = trajectory
    # Bias-corrected, both momenta equal the gradient on step one.
    torch.testing.assert_close(runs[False][0], runs[True][0])
    assert not torch.allclose(runs[False][1], runs[True][1])


def test_defaults_are_visible_to_trainers():
    opt = DASH(torch.nn.Linear(3, 3).parameters(), lr=3e-4, betas=(0.9, 0.99), weight_decay=0.1)
    assert opt.defaults["lr"] == 3e-4 and opt.defaults["betas"] == (0.9, 0.99)
    assert opt.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize("matmul_dtype", ["bf16", torch.float16])
def test_low_precision_matmuls_train(matmul_dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = DASH(model.parameters(), lr=0.01, block_size=8, matmul_dtype=matmul_dtype, precondition_frequency=1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("value", ["bfloat16", "float16", "Float64", "", 0, 1.5, True, None, torch.bfloat16])
def test_an_eigh_dtype_other_than_float32_or_float64_is_refused_by_name(value):
    with pytest.raises(ValueError, match="eigh_dtype"):
        DASH(torch.nn.Linear(3, 3).parameters(), eigh_dtype=value)


@pytest.mark.parametrize("value", [torch.float32, torch.float64, "float32", "float64"])
def test_eigh_dtype_takes_a_name_or_a_torch_dtype(value):
    name = str(value).removeprefix("torch.")
    assert DASH(torch.nn.Linear(3, 3).parameters(), eigh_dtype=value).config.eigh_dtype == name


@pytest.mark.parametrize("value", ["Doubling", "double", "", 2, True, None])
def test_a_root_schedule_that_is_not_one_of_the_three_is_refused_by_name(value):
    with pytest.raises(ValueError, match="root_schedule"):
        DASH(torch.nn.Linear(3, 3).parameters(), root_schedule=value)
