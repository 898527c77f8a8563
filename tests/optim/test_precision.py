"""The matmul precision policy (``matmul_precision``): TF32 rounding, the split TF32x3 product,
torch's TF32 setting left as the user had it, and DASH's step at each precision.

References are independent of the module under test: TF32 rounding against ``math.frexp``
arithmetic, products against float64, steps against float64 DASH. The CUDA test (marked
``cuda``) checks that the tensor cores compute what the CPU emulation does.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_dash import DASH
from lightning_dash.optim import precision

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tf32_by_frexp(value: float) -> float:
    """``value`` rounded to 11 significant bits, ties to even (Python's ``round``), via frexp."""
    if value == 0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    return math.ldexp(round(mantissa * 2**11), exponent - 11)


def test_tf32_rounding_matches_eleven_significant_bits_with_ties_to_even():
    generator = torch.Generator().manual_seed(0)
    values = torch.cat(
        [
            torch.randn(2000, generator=generator) * torch.logspace(-30, 30, 2000),
            torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2**-11, 1 - 2**-13, 0.0, -0.0]),
        ]
    ).float()
    rounded = precision.round_to_tf32(values)
    expected = torch.tensor([tf32_by_frexp(v) for v in values.tolist()], dtype=torch.float32)
    assert torch.equal(rounded, expected)
    special = torch.tensor([math.inf, -math.inf, math.nan])
    assert torch.equal(precision.round_to_tf32(special)[:2], special[:2])
    assert torch.isnan(precision.round_to_tf32(special)[2])


@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e18])
def test_split_tf32_product_has_float32_accuracy_and_one_product_has_tf32s(scale):
    generator = torch.Generator().manual_seed(1)
    left = torch.randn(3, 64, 96, generator=generator) * scale
    right = torch.randn(3, 96, 48, generator=generator)
    exact = torch.bmm(left.double(), right.double())

    def error(product: torch.Tensor) -> float:
        return float((product.double() - exact).norm() / exact.norm())

    assert error(precision.bmm(left, right, "float32")) < 1e-6
    assert 5e-5 < error(precision.bmm(left, right, "tf32")) < 2e-3
    assert error(precision.bmm(left, right, "tf32x3")) < 2e-6
    base = torch.randn(3, 64, 48, generator=generator) * scale
    with_base = precision.baddbmm(base, left, right, "tf32x3")
    assert float((with_base.double() - exact - base.double()).norm() / exact.norm()) < 2e-6


def test_split_tf32_product_is_continuous_where_one_tf32_product_jumps():
    """A perturbation of 1e-7 moves the split product by about that much (the split is exact),
    while a single TF32 product jumps wherever an operand's rounding flips."""
    generator = torch.Generator().manual_seed(2)
    left, right = torch.randn(8, 128, 128, generator=generator), torch.randn(8, 128, 128, generator=generator)
    nudged = left * (1 + 1e-7 * torch.randn(left.shape, generator=generator))

    def change(mode: str) -> float:
        before, after = precision.bmm(left, right, mode), precision.bmm(nudged, right, mode)
        return float((after - before).norm() / before.norm())

    assert change("tf32x3") < 1e-6
    assert change("tf32") > 10 * change("tf32x3")


def test_float64_operands_are_never_rounded():
    generator = torch.Generator().manual_seed(3)
    left, right = torch.randn(2, 16, 16, generator=generator).double(), torch.randn(2, 16, 16).double()
    for mode in ("tf32", "tf32x3"):
        assert torch.equal(precision.bmm(left, right, mode), torch.bmm(left, right))


@pytest.mark.parametrize(
    "user_setting",
    [
        None,
        lambda: torch.set_float32_matmul_precision("high"),
        lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    ],
)
@pytest.mark.parametrize("tf32", [True, False])
def test_the_step_sets_cuda_matmuls_as_asked_and_puts_the_users_setting_back(user_setting, tf32, monkeypatch):
    """Inside the block cuBLAS runs what DASH asked (TF32, or IEEE float32 even where the user
    turned TF32 on); afterwards the setting reads back as the user left it, through the API the
    user set it with."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the flags exist on CPU builds too
    saved = torch.get_float32_matmul_precision()
    try:
        if user_setting is not None:
            user_setting()
        before = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
        with precision.cuda_matmuls(tf32):
            assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")
        assert (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32) == before
    finally:
        torch.set_float32_matmul_precision(saved)


def test_auto_stands_for_float32_and_the_others_for_themselves():
    assert precision.resolve("auto") == "float32"
    assert [precision.resolve(name) for name in ("float32", "tf32", "tf32x3")] == ["float32", "tf32", "tf32x3"]


@pytest.mark.parametrize("value", ["TF32", "bf16", None, 32])
def test_a_bad_matmul_precision_is_refused_by_name(value):
    with pytest.raises(ValueError, match="matmul_precision"):
        DASH([nn.Parameter(torch.zeros(4, 4))], matmul_precision=value)


def trained(dtype: torch.dtype, device: str = "cpu", steps: int = 6, **options) -> torch.Tensor:
    """The parameters of a small MLP after ``steps`` DASH steps (Newton roots, every 2 steps, at a damping
    of 1e-3: the iterative solvers' own, above the eigh default's, where float32 statistics' rounding would
    dominate every precision's error)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 5)).to(device=device, dtype=dtype)
    optimizer = DASH(
        model.parameters(),
        lr=1e-2,
        block_size=32,
        precondition_frequency=2,
        inverse_root_method="newton_db",
        epsilon=1e-3,
        **options,
    )
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 24, generator=generator).to(device=device, dtype=dtype)
        y = torch.randn(32, 5, generator=generator).to(device=device, dtype=dtype)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


def test_each_precision_steps_as_its_arithmetic_allows_against_float64():
    reference = trained(torch.float64)
    start = trained(torch.float64, steps=0)
    movement = (reference - start).norm()

    def error(**options) -> float:
        return float((trained(torch.float32, **options) - reference).norm() / movement)

    float32, split = error(matmul_precision="float32"), error(matmul_precision="tf32x3")
    single = error(matmul_precision="tf32")
    assert float32 < 1e-5
    assert split < 5e-5  # the truncated split and the dropped tail x tail term: a few float32 units
    # One TF32 product is far coarser: its roots also take TF32's damping floor (8 units, 3.9e-3).
    assert single > 100 * split
    assert torch.equal(
        trained(torch.float32, matmul_precision="auto"), trained(torch.float32, matmul_precision="float32")
    )
    assert torch.equal(trained(torch.float64, matmul_precision="tf32"), reference)


@pytest.mark.cuda
@CUDA
def test_cuda_tensor_cores_compute_what_the_emulation_does():
    """On CUDA the split product lands where float64 and the CPU emulation do, one TF32 product
    lands visibly elsewhere (the tensor cores ran), float32 stays IEEE under the user's TF32
    setting, and that setting is unchanged."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # the user's: TF32 everywhere
    before = torch.backends.cuda.matmul.fp32_precision
    reference = trained(torch.float64)
    movement = (reference - trained(torch.float64, steps=0)).norm()

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / movement)

    split = trained(torch.float32, device="cuda", matmul_precision="tf32x3")
    single = trained(torch.float32, device="cuda", matmul_precision="tf32")
    assert distance(split, reference) < 5e-5
    assert distance(split, trained(torch.float32, matmul_precision="tf32x3")) < 5e-5
    assert distance(single, reference) > 100 * distance(split, reference)
    assert distance(trained(torch.float32, device="cuda", matmul_precision="float32"), reference) < 1e-5
    assert torch.backends.cuda.matmul.fp32_precision == before
    torch.backends.cuda.matmul.fp32_precision = "none"
