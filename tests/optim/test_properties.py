"""Property-based tests: random shapes, dtypes, solvers and gradient scales, with faults.

For every drawn case DASH trains a set of parameters from zero with ``lr = 1`` (so each
parameter is exactly the sum of its updates) beside the float64 reference
(``reference.ReferenceDash``), with NaN or inf injected into one gradient at chosen
steps. After every step all parameters are finite; whenever no root failure was
counted the parameters match the reference (which skips the faulty steps, as DASH must)
within the tolerance of the matmul dtype; and the counters equal the injected faults.
"""

from __future__ import annotations

import math

import torch
from helpers.reference import ReferenceDash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_dash import DASH

SHAPES = [(0, 5), (0,), (7,), (6, 5), (20, 12), (3, 4, 5), (4, 2, 3, 3), (9, 30)]
SOLVERS = ["eigh", "newton_db", "coupled_newton", "chebyshev"]

#: Relative agreement with the float64 formula, and the damping each case runs at: the
#: Newton solvers resolve eigenvalues above 8 units of matmul roundoff (bf16: 3% of the
#: scale), Chebyshev above its interpolation floor (degree 60: 0.3%).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
EPSILON = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
CHEBYSHEV_EPSILON = 1e-2


@st.composite
def cases(draw):
    solver = draw(st.sampled_from(SOLVERS))
    param_dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    matmul_dtype = torch.float32
    if solver != "eigh" and param_dtype == torch.float32:
        matmul_dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]))
    epsilon = EPSILON[matmul_dtype]
    if solver == "chebyshev":
        epsilon = max(epsilon, CHEBYSHEV_EPSILON)
    steps = draw(st.integers(min_value=2, max_value=5))
    return dict(
        shapes=draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=3)),
        solver=solver,
        scaling=draw(st.sampled_from(["power_iteration", "frobenius"])),
        param_dtype=param_dtype,
        matmul_dtype=matmul_dtype,
        epsilon=epsilon,
        block_size=draw(st.sampled_from([4, 8, 64])),
        log_scale=draw(st.floats(min_value=-30.0, max_value=20.0)),
        frequency=draw(st.sampled_from([1, 2])),
        root_order=draw(st.sampled_from([4, 2])),
        steps=steps,
        faults=draw(st.sets(st.integers(min_value=0, max_value=steps - 1), max_size=2)),
        fault_value=draw(st.sampled_from([math.nan, math.inf, -math.inf])),
        seed=draw(st.integers(min_value=0, max_value=2**16)),
    )


# derandomize: CI must not depend on which examples a run happens to draw (400 random
# examples passed when this was written; raise max_examples locally to explore further).
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_cases_stay_finite_match_float64_and_count_every_fault(case):
    generator = torch.Generator().manual_seed(case["seed"])
    scale = 10.0 ** case["log_scale"]
    dtype = case["param_dtype"]
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in case["shapes"]]
    options = dict(
        lr=1.0,
        epsilon=case["epsilon"],
        block_size=case["block_size"],
        precondition_frequency=case["frequency"],
        root_order=case["root_order"],
    )
    optimizer = DASH(
        params,
        inverse_root_method=case["solver"],
        matrix_scaling=case["scaling"],
        matmul_dtype=case["matmul_dtype"],
        chebyshev_degree=60,
        **options,
    )
    reference = ReferenceDash(**options)
    expected = [torch.zeros(shape, dtype=torch.float64) for shape in case["shapes"]]
    faulty = [shape for shape in case["shapes"] if math.prod(shape) > 0]
    for step in range(case["steps"]):
        grads = [scale * torch.randn(shape, generator=generator, dtype=torch.float64) for shape in case["shapes"]]
        inject = step in case["faults"] and faulty
        for param, grad in zip(params, grads):
            param.grad = grad.to(dtype)
        if inject:
            victim = next(p for p in params if p.numel() > 0)
            victim.grad.view(-1)[0] = case["fault_value"]
        optimizer.step()
        if not inject:
            reference.step(expected, grads)
        assert all(torch.isfinite(p).all() for p in params)
    injected = len(case["faults"]) if faulty else 0
    assert optimizer.nonfinite_grad_skips == injected
    assert optimizer.nonfinite_update_skips == 0
    assert optimizer.root_failure_count == 0
    for param, reference_param in zip(params, expected):
        assert param.dtype == dtype
        if param.numel() == 0 or reference_param.norm() == 0:
            continue
        error = float((param.detach().double() - reference_param).norm() / reference_param.norm())
        assert error < TOLERANCE[case["matmul_dtype"]], (case, error)
