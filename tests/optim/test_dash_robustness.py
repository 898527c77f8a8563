"""Bad input is rejected clearly; bad numbers never reach parameters or state."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dash import DASH, RootComputationError
from lightning_dash.optim.roots import RootResult, inverse_root


def params(*shapes):
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(lr=-1e-3), "lr"),
        (dict(lr=math.nan), "lr"),
        (dict(lr=math.inf), r"lr must be in \[0.0, inf\), got inf"),
        (dict(weight_decay=math.inf), r"weight_decay must be in \[0.0, inf\), got inf"),
        (dict(epsilon=math.inf), r"epsilon must be in \(0.0, inf\), got inf"),
        (dict(grafting_epsilon=math.inf), r"grafting_epsilon must be in \(0.0, inf\), got inf"),
        (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
        (dict(betas=(0.9, 1.5)), r"betas\[1\]"),
        (dict(betas=(-0.1, 0.9)), r"betas\[0\]"),
        (dict(betas=0.9), "betas"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(block_size=0), "block_size"),
        (dict(precondition_frequency=0), "precondition_frequency"),
        (dict(start_preconditioning_step=0), "start_preconditioning_step"),
        (dict(inverse_root_method="cholesky"), "inverse_root_method"),
        (dict(matrix_scaling="trace"), "matrix_scaling"),
        (dict(matmul_dtype=torch.float64), "matmul_dtype"),
        (dict(grafting="lion"), "grafting"),
        (dict(grafting_beta2=1.0), "grafting_beta2"),
        (dict(grafting_epsilon=0.0), "grafting_epsilon"),
        (dict(root_iterations=0), "root_iterations"),
        (dict(max_consecutive_root_failures=0), "max_consecutive_root_failures"),
    ],
)
def test_invalid_hyperparameters_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DASH(params((4, 4)), **kwargs)


@pytest.mark.parametrize("kwargs,name", [(dict(block_size=2.5), "block_size"), (dict(nesterov="yes"), "nesterov")])
def test_wrong_types_name_the_argument(kwargs, name):
    with pytest.raises(TypeError, match=name):
        DASH(params((4, 4)), **kwargs)


def test_invalid_group_hyperparameter_is_rejected_and_not_added():
    opt = DASH(params((4, 4)))
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": params((3,)), "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_complex_integer_and_sparse_are_rejected():
    with pytest.raises(TypeError, match="complex"):
        DASH([torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="floating"):
        DASH([torch.zeros(3, 3, dtype=torch.int64)])
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = DASH(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradient_skips_the_whole_step(bad):
    weight, other, bias = params((6, 6), (6, 6), (6,))
    opt = DASH([weight, other, bias], lr=0.1, block_size=4)
    for p in (weight, other, bias):
        p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    before = [p.detach().clone() for p in (weight, other, bias)]
    weight.grad = torch.randn(6, 6)
    weight.grad[2, 3] = bad
    other.grad = torch.randn(6, 6)
    bias.grad = torch.full((6,), bad)
    opt.step()
    # A step is applied whole or not at all: the finite gradient of ``other`` moves nothing.
    assert opt.nonfinite_grad_skips == 1
    assert all(torch.equal(p, b) for p, b in zip((weight, other, bias), before))
    state = opt.state_dict()["state"]
    for index in (0, 1, 2):
        for key, value in saved["state"][index].items():
            assert torch.equal(value, state[index][key]), key
    assert all(torch.isfinite(v).all() for entry in state.values() for v in entry.values())


@pytest.mark.parametrize("method", ["eigh", "newton_db", "coupled_newton", "chebyshev"])
def test_zero_gradients_produce_no_nan(method):
    weight, bias = params((10, 7), (7,))
    opt = DASH([weight, bias], block_size=4, inverse_root_method=method, precondition_frequency=1)
    before = weight.detach().clone()
    for _ in range(3):
        weight.grad, bias.grad = torch.zeros_like(weight), torch.zeros_like(bias)
        opt.step()
    assert torch.equal(weight, before)
    assert all(torch.isfinite(v).all() for entry in opt.state_dict()["state"].values() for v in entry.values())


def failing_solver(fail_on_call: set[int]):
    """Wrap the real solver so that chosen calls return NaN for their first block."""
    real = inverse_root
    calls = {"count": 0}

    def solver(statistics, eps, settings, scale=None, min_eps=None):
        calls["count"] += 1
        result = real(statistics, eps, settings, scale, min_eps)
        if calls["count"] in fail_on_call:
            broken = result.root.clone()
            broken[0] = math.nan
            return RootResult(broken, result.residual)
        return result

    return solver


def test_failed_root_keeps_previous_root_and_counts():
    # One 8x8 parameter at block 8: one block, its L and R in one solver call per step.
    (weight,) = params((8, 8))
    opt = DASH([weight], lr=0.01, block_size=8, precondition_frequency=1)
    weight.grad = torch.randn(8, 8)
    opt.step()
    root_before = opt.state_dict()["state"][0]["left_root_0_0"]
    opt.roots.solver = failing_solver({1})
    weight.grad = torch.randn(8, 8)
    opt.step()
    state = opt.state_dict()["state"][0]
    assert opt.root_failure_count == 1
    assert torch.equal(state["left_root_0_0"], root_before)
    assert state["root_failures"][0, 0] == 1 and state["root_valid"][0, 0]
    assert torch.isfinite(weight).all()
    weight.grad = torch.randn(8, 8)
    opt.step()  # a success resets the streak
    assert opt.state_dict()["state"][0]["root_failures"][0, 0] == 0


def test_failure_without_previous_root_falls_back_to_grafting():
    (weight,) = params((8, 8))
    reference_weight = torch.nn.Parameter(weight.detach().clone())
    grad = torch.randn(8, 8)
    opt = DASH([weight], lr=0.01, block_size=8)
    opt.roots.solver = failing_solver({1})
    weight.grad = grad
    opt.step()
    # The expected step is Adam's: on step one, m_hat = g and v_hat = g^2.
    expected = reference_weight.detach() - 0.01 * grad / (grad.abs() + 1e-8)
    torch.testing.assert_close(weight.detach(), expected)


def test_consecutive_failures_raise_naming_the_parameter():
    model = torch.nn.Linear(8, 8)
    opt = DASH(list(model.named_parameters()), block_size=8, precondition_frequency=1, max_consecutive_root_failures=2)
    opt.roots.solver = failing_solver({1, 2})
    model.weight.grad, model.bias.grad = torch.randn(8, 8), torch.randn(8)
    opt.step()
    opt.step()  # the second failure in a row reaches the limit; the host reads it back at the next step
    with pytest.raises(RootComputationError, match="weight"):
        opt.step()
    assert torch.isfinite(model.weight).all()
