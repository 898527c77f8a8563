"""The DASH update against independent float64 expectations."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import ReferenceDash, inverse_root

from lightning_dash import DASH, DashConfig
from lightning_dash.optim.step.schedule import roots_due


def controlled_matrix(rows: int, cols: int, low: float, high: float, seed: int) -> torch.Tensor:
    """A float64 matrix with singular values spread evenly in [low, high]."""
    generator = torch.Generator().manual_seed(seed)
    left, _ = torch.linalg.qr(torch.randn(rows, rows, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(cols, cols, generator=generator, dtype=torch.float64))
    k = min(rows, cols)
    return left[:, :k] @ torch.diag(torch.linspace(high, low, k, dtype=torch.float64)) @ right[:, :k].T


def one_raw_step(grad: torch.Tensor, **options) -> torch.Tensor:
    """The first DASH direction for ``grad`` from zero state with lr=1 and a zero weight
    (Shampoo's fourth roots unless ``root_order`` says otherwise)."""
    weight = torch.zeros(grad.shape, requires_grad=True)
    options.setdefault("root_order", 4)
    opt = DASH([weight], lr=1.0, betas=(0.0, 0.95), grafting="none", precondition_frequency=1, **options)
    weight.grad = grad.float()
    opt.step()
    return -weight.detach().double()


# Newton solvers: 10 iterations on a condition number of 9 converge to float32
# roundoff; the rectangular blocks add rank-deficient factors whose null space the
# gradient does not touch, so the residual error stays ~1e-5. bf16/fp16 matmuls carry
# their unit roundoff (4e-3 / 5e-4) times a growth of a few; Chebyshev's interpolant
# is built for 1e-3 relative accuracy.
DIRECTION_TOLERANCE = {
    ("eigh", torch.float32): 1e-4,
    ("newton_db", torch.float32): 1e-4,
    ("coupled_newton", torch.float32): 1e-4,
    ("chebyshev", torch.float32): 3e-3,
    ("newton_db", torch.bfloat16): 5e-2,
    ("coupled_newton", torch.bfloat16): 5e-2,
    ("chebyshev", torch.bfloat16): 5e-2,
    ("newton_db", torch.float16): 1e-2,
    ("coupled_newton", torch.float16): 1e-2,
    ("chebyshev", torch.float16): 1e-2,
}


@pytest.mark.parametrize("method,dtype", sorted(DIRECTION_TOLERANCE, key=str))
@pytest.mark.parametrize("scaling", ["power_iteration", "frobenius"])
@pytest.mark.parametrize("shape", [(24, 24), (20, 12), (9, 30)])
def test_raw_direction_is_left_and_right_inverse_fourth_roots(method, dtype, scaling, shape):
    grad = controlled_matrix(*shape, low=1.0, high=3.0, seed=sum(shape))
    # The Newton solvers damp by at least 8 units of matmul roundoff times the scale
    # (up to ||L||_F ~ 30 here): 0.12 for fp16 and 0.94 for bf16. Epsilon is chosen
    # above that so the exact expectation below is the one the solver targets.
    eps = {torch.float32: 0.05, torch.float16: 0.2, torch.bfloat16: 2.0}[dtype]
    direction = one_raw_step(
        grad,
        epsilon=eps,
        relative_epsilon=False,
        inverse_root_method=method,
        matrix_scaling=scaling,
        matmul_dtype=dtype,
        block_size=64,
    )
    expected = inverse_root(grad @ grad.T, eps) @ grad @ inverse_root(grad.T @ grad, eps)
    error = (direction - expected).norm() / expected.norm()
    assert error < DIRECTION_TOLERANCE[(method, dtype)]


@pytest.mark.parametrize("method", ["eigh", "newton_db", "coupled_newton", "chebyshev"])
@pytest.mark.parametrize("shape", [(24, 24), (20, 12), (9, 30)])
def test_root_order_2_takes_inverse_square_roots_of_both_factors(method, shape):
    grad = controlled_matrix(*shape, low=1.0, high=3.0, seed=sum(shape))
    eps = 0.05
    options = dict(epsilon=eps, relative_epsilon=False, inverse_root_method=method, block_size=64)
    direction = one_raw_step(grad, root_order=2, **options)
    expected = inverse_root(grad @ grad.T, eps, 2) @ grad @ inverse_root(grad.T @ grad, eps, 2)
    assert (direction - expected).norm() / expected.norm() < DIRECTION_TOLERANCE[(method, torch.float32)]
    # The fourth roots are a different direction (the test can tell them apart).
    fourth = inverse_root(grad @ grad.T, eps) @ grad @ inverse_root(grad.T @ grad, eps)
    assert (fourth / fourth.norm() - expected / expected.norm()).norm() > 0.05


@pytest.mark.parametrize("method,tolerance", [("eigh", 1e-4), ("newton_db", 3e-4), ("coupled_newton", 1e-4)])
def test_first_step_is_the_polar_factor(method, tolerance):
    # The 16x16 left factor has six null directions. G's float32 components there
    # (~1e-7 |G|) are amplified by the root's null-space gain; scaled Newton-Schulz
    # resolves that gain further than the other iterations, hence its wider margin.
    # An absolute epsilon of 1e-10 leaves those directions at the solvers' noise floor
    # (8 float32 roundoffs of the scale): Newton-DB needs 14 iterations per pass to
    # converge there (with 10 its residual would, rightly, count the root as failed).
    grad = controlled_matrix(16, 10, low=1.0, high=2.0, seed=5)
    direction = one_raw_step(
        grad,
        epsilon=1e-10,
        relative_epsilon=False,
        inverse_root_method=method,
        block_size=64,
        root_iterations=14 if method == "newton_db" else None,
    )
    u, _, vh = torch.linalg.svd(grad, full_matrices=False)
    polar = u @ vh
    assert (direction - polar).norm() / polar.norm() < tolerance


def run_against_reference(shapes, block_size, steps=4, **options):
    generator = torch.Generator().manual_seed(11)
    initial = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes] for _ in range(steps)]
    params = [torch.nn.Parameter(x.float().clone()) for x in initial]
    opt = DASH(params, block_size=block_size, inverse_root_method="eigh", **options)
    reference = ReferenceDash(block_size=block_size, **options)
    expected = [x.clone() for x in initial]
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.float()
        opt.step()
        reference.step(expected, step_grads)
    return params, expected


@pytest.mark.parametrize("block_size", [4, 8, 1024])
def test_full_update_matches_reference_on_odd_shapes(block_size):
    # At block 1024 the 1024x17 tile has a 1024x1024 left factor of rank <= 68 whose
    # float32 eigenvalues carry noise near 1e-4 * lambda_max ~ 0.1; epsilon must dominate
    # that noise for a float32 optimizer to agree with a float64 reference.
    shapes = [(1030, 17), (7, 5), (16, 3, 3, 3), (17,), (5, 7)]
    options = dict(lr=0.01, betas=(0.9, 0.95), epsilon=0.1, weight_decay=0.1, precondition_frequency=2)
    params, expected = run_against_reference(shapes, block_size, **options)
    for param, reference in zip(params, expected):
        torch.testing.assert_close(param.detach().double(), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_size", [4, 1024])
@pytest.mark.parametrize(
    "variant",
    [
        {"root_order": 4, "nesterov": False, "precondition_frequency": 10},  # the defaults before version 0.4
        {"lr_scale": 3.0},  # scales the update, not the weight decay
        {"grafting_norm": "spectral"},
        {"grafting_norm": "frobenius"},
    ],
    ids=["fourth_roots_plain_momentum", "lr_scale", "spectral_grafting", "frobenius_grafting"],
)
def test_full_update_with_non_default_variants_matches_reference(block_size, variant):
    shapes = [(1030, 17), (7, 5), (16, 3, 3, 3), (17,)]
    options = dict(lr=0.01, epsilon=0.1, weight_decay=0.1, **variant)
    params, expected = run_against_reference(shapes, block_size, **options)
    for param, reference in zip(params, expected):
        torch.testing.assert_close(param.detach().double(), reference, rtol=1e-4, atol=1e-5)


def test_grafting_before_start_step_and_raw_after():
    shapes = [(12, 8), (8,)]
    options = dict(lr=0.05, epsilon=1e-2, start_preconditioning_step=3, precondition_frequency=1, grafting="none")
    params, expected = run_against_reference(shapes, 1024, steps=5, **options)
    for param, reference in zip(params, expected):
        torch.testing.assert_close(param.detach().double(), reference, rtol=1e-4, atol=1e-5)


def test_stacking_equals_one_parameter_at_a_time():
    """Blocks from many parameters in one stack move exactly as if each were alone."""
    generator = torch.Generator().manual_seed(2)
    shapes = [(16, 16), (16, 16), (40, 16), (16, 40), (5, 16)]
    initial = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]
    options = dict(lr=0.01, block_size=16, precondition_frequency=1, epsilon=1e-4)
    together = [torch.nn.Parameter(x.clone()) for x in initial]
    alone = [torch.nn.Parameter(x.clone()) for x in initial]
    joint = DASH(together, **options)
    separate = [DASH([p], **options) for p in alone]
    for step_grads in grads:
        for p, q, g in zip(together, alone, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        joint.step()
        for opt in separate:
            opt.step()
    for p, q in zip(together, alone):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", ["frobenius", "spectral"])
@pytest.mark.parametrize("grafting", ["adagrad", "rmsprop", "sgd"])
def test_grafting_norm_matches_its_optimizer(grafting, norm):
    """Each block's step has the grafting optimizer's step's norm: Frobenius, or the largest singular
    value (2 x 2 blocks: the power iteration's estimate is exact to float32 roundoff). ``lr_scale=1``: the
    rule itself (the default of 2 multiplies it, as ``test_full_update_matches_reference_on_odd_shapes``
    holds against the reference)."""
    grad = controlled_matrix(6, 4, low=0.5, high=2.0, seed=1).float()
    weight = torch.nn.Parameter(torch.zeros(6, 4))
    opt = DASH(
        [weight],
        lr=1.0,
        betas=(0.0, 0.9),
        grafting=grafting,
        grafting_beta2=0.9,
        grafting_epsilon=1e-8,
        block_size=2,
        epsilon=1e-6,
        grafting_norm=norm,
        lr_scale=1.0,
    )
    weight.grad = grad
    opt.step()
    step = -weight.detach()
    if grafting == "adagrad":
        reference = grad / (grad.abs() + 1e-8)
    elif grafting == "rmsprop":
        reference = grad / ((0.1 * grad * grad).sqrt() + 1e-8)
    else:
        reference = grad
    ord = "fro" if norm == "frobenius" else 2
    for r in range(0, 6, 2):
        for c in range(0, 4, 2):
            expected = torch.linalg.matrix_norm(reference[r : r + 2, c : c + 2].double(), ord=ord)
            actual = torch.linalg.matrix_norm(step[r : r + 2, c : c + 2].double(), ord=ord)
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=0)


def float64_problem(seed: int, shapes: list[tuple[int, ...]], steps: int):
    """float64 starting weights and ``steps`` rounds of gradients for them."""
    generator = torch.Generator().manual_seed(seed)
    initial = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes] for _ in range(steps)]
    return initial, grads


def float64_run(initial, grads, **options) -> list[torch.Tensor]:
    """The parameters after DASH (``options``) stepped on ``grads`` from ``initial``."""
    params = [torch.nn.Parameter(x.clone()) for x in initial]
    optimizer = DASH(params, **options)
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    return params


def reference_run(initial, grads, **options) -> list[torch.Tensor]:
    """The float64 reference's parameters after ``grads`` from ``initial``."""
    reference, expected = ReferenceDash(**options), [x.clone() for x in initial]
    for step_grads in grads:
        reference.step(expected, step_grads)
    return expected


@pytest.mark.parametrize("relative_epsilon", [True, False])
def test_float64_parameters_take_the_float64_reference_steps_to_roundoff(relative_epsilon):
    """float64 parameters keep the damping in float64 too: a large epsilon (0.3) makes a float32
    epsilon visible (about 6e-9 of the movement), far above float64's roundoff."""
    initial, grads = float64_problem(3, [(8, 8), (8, 4)], 6)
    options = dict(lr=0.1, block_size=4, precondition_frequency=2, epsilon=0.3, relative_epsilon=relative_epsilon)
    params = float64_run(initial, grads, inverse_root_method="eigh", **options)
    expected = reference_run(initial, grads, **options)
    for param, want, start in zip(params, expected, initial):
        assert (param.detach() - want).norm() <= 1e-13 * (want - start).norm()


def test_the_paper_preset_takes_the_reference_steps_of_the_papers_algorithm():
    """``DashConfig.paper()`` in float64 against the float64 reference set to the paper's algorithm
    (fourth roots, absolute damping of the raw factors, roots at 1, f, 2f, ..., weight decay on
    matrices only, no Nesterov, grafting in the Frobenius norm); DASH's defaults, a different
    algorithm, land far from it."""
    initial, grads = float64_problem(5, [(8, 8), (8, 4), (8,)], 8)
    common = dict(lr=0.05, weight_decay=0.1, block_size=4, precondition_frequency=3)
    expected = reference_run(
        initial,
        grads,
        root_order=4,
        epsilon=2e-10,
        relative_epsilon=False,
        factor_bias_correction=False,
        root_schedule="multiples",
        decay_vectors=False,
        nesterov=False,
        grafting_norm="frobenius",
        lr_scale=1.0,
        **common,
    )
    runs = {
        "paper": float64_run(initial, grads, config=DashConfig.paper(**common)),
        "defaults": float64_run(initial, grads, config=DashConfig(**common)),
    }
    moved = [want - start for want, start in zip(expected, initial)]
    distances = {
        name: [float((p.detach() - want).norm() / move.norm()) for p, want, move in zip(params, expected, moved)]
        for name, params in runs.items()
    }
    assert max(distances["paper"]) <= 1e-12, distances
    assert min(distances["defaults"]) > 1e-2, distances


@pytest.mark.parametrize(
    "schedule, start, frequency, due",
    [
        ("from_start", 1, 10, [1, 11, 21]),
        ("multiples", 1, 10, [1, 10, 20]),
        ("multiples", 5, 5, [5, 10, 15, 20]),
        ("multiples", 3, 10, [3, 10, 20]),
        ("from_start", 3, 10, [3, 13]),
        ("doubling", 1, 10, [1, 2, 4, 8, 11, 21]),  # the factors hold 1, 2, 4, 8 gradients, then every 10
        ("doubling", 3, 10, [3, 4, 8, 13]),  # the factors hold a gradient per step from step 1
        ("doubling", 1, 2, [1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21]),
        ("doubling", 1, 1, list(range(1, 23))),
        ("doubling", 2, 32, [2, 4, 8, 16]),
    ],
)
def test_root_schedules_name_the_steps_that_refresh(schedule, start, frequency, due):
    group = {"start_preconditioning_step": start, "precondition_frequency": frequency}
    assert [t for t in range(1, 23) if roots_due(t, group, schedule)] == due
