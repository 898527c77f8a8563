"""How DASH's float32 matrix products run: IEEE float32, or on TF32 tensor cores.

``matmul_precision`` covers every float32 matmul of a step: the factor statistics
(``G G^T``, ``G^T G``), the preconditioned direction (``L^(-1/p) M R^(-1/p)``) and the
Newton root iterations (when ``matmul_dtype`` is float32). Statistics, roots and
momentum are stored in float32 either way; only the operands of the products are
rounded to TF32's 10-bit mantissa, and the products accumulate in float32.

* ``"float32"``: IEEE float32 products (torch's default on CUDA).
* ``"tf32"``: one TF32 product (operands rounded to 11 significant bits, about 5e-4):
  the fastest, but a rounding that flips under a tiny perturbation of its input moves the
  result by a whole TF32 unit, so training amplifies a 1e-7 change of the gradients about
  100 times more than in float32 (``benchmarks/numerics/roundoff.py``).
* ``"tf32x3"``: each operand split into a TF32 head and a TF32 tail (``a = h + t``) and the
  product taken as ``h h' + h t' + t h'`` in three TF32 products: within a few float32 units of
  float32's accuracy, and float32's roundoff sensitivity (the split is exact, so it is
  continuous in the input); on paper 2.5x
  an H100's float32 rate, in practice limited by the split's elementwise passes.
* ``"auto"``: ``"float32"`` everywhere, as measured: on an H200 one TF32 product made the step
  2.4x faster than float32 but fails the roundoff bar (1.8e-3 of the movement against 1e-4), and
  tf32x3 passes it (1.8e-5) but its eager split passes made the step 1.7x slower than float32
  (docs/benchmarks/gpu.md, "Measured on one GPU").

On CUDA the step sets cuBLAS's float32 mode to what ``matmul_precision`` asks (TF32 or IEEE,
whatever the process's own setting) and puts that setting back afterwards. Elsewhere the
operands are rounded to TF32 before a float32 product (an emulation: the same numerics,
slower), so the GPU's arithmetic can be tested on a CPU. float64 statistics are never
rounded: the TF32 modes apply to float32 operands only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

AUTO = "auto"
FLOAT32 = "float32"
TF32 = "tf32"
TF32X3 = "tf32x3"
MATMUL_PRECISIONS = (AUTO, FLOAT32, TF32, TF32X3)
#: The precisions that run on TF32 tensor cores.
TENSOR_CORE_PRECISIONS = (TF32, TF32X3)

#: Explicit mantissa bits of TF32 (float32 has 23): its unit roundoff is ``2**-11``.
TF32_MANTISSA_BITS = 10
_DROPPED_BITS = 23 - TF32_MANTISSA_BITS
_HEAD_MASK = -(1 << _DROPPED_BITS)  # keeps the sign, the exponent and TF32's mantissa bits


def resolve(choice: str) -> str:
    """The precision ``choice`` stands for (``"auto"``: float32, the measured choice on every device so far)."""
    if choice not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {choice!r}")
    return FLOAT32 if choice == AUTO else choice


def round_to_tf32(tensor: Tensor) -> Tensor:
    """``tensor`` (float32) with each entry rounded to the nearest TF32 value (ties to even),
    as a float32 tensor; infinities and NaN are kept. A pure function of its input."""
    bits = tensor.contiguous().view(torch.int32)
    odd = (bits >> _DROPPED_BITS) & 1
    half = (1 << (_DROPPED_BITS - 1)) - 1
    rounded = ((bits + half + odd) & ~((1 << _DROPPED_BITS) - 1)).view(torch.float32)
    return torch.where(torch.isfinite(tensor), rounded, tensor)


def _tf32_operand(tensor: Tensor) -> Tensor:
    """What a TF32 product reads of ``tensor``: itself on CUDA (the tensor cores round), its
    TF32 rounding elsewhere."""
    return tensor if tensor.device.type == "cuda" else round_to_tf32(tensor)


def _split(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """``(head, tail)``: ``head`` is ``tensor`` cut to TF32's mantissa (one bitwise pass: cheaper
    than rounding on the GPU, where the split's passes cost more than its products), ``tail =
    tensor - head`` exactly, at most ``2**-10`` of ``tensor``."""
    head = torch.bitwise_and(tensor.contiguous().view(torch.int32), _HEAD_MASK).view(torch.float32)
    return head, tensor - head


def baddbmm(base: Tensor | None, left: Tensor, right: Tensor, matmul_precision: str) -> Tensor:
    """``base + left @ right`` per block (``base`` None: the product alone), the product run at
    ``matmul_precision`` (``"float32"``, ``"tf32"`` or ``"tf32x3"``; not ``"auto"``). Operands
    other than float32 (float64 stacks) take an IEEE product whatever the precision; on CUDA
    the call runs under :func:`cuda_matmuls`, which sets the tensor cores' mode."""
    if matmul_precision == FLOAT32 or left.dtype != torch.float32:
        return torch.bmm(left, right) if base is None else torch.baddbmm(base, left, right)
    if matmul_precision == TF32:
        left, right = _tf32_operand(left), _tf32_operand(right)
        return torch.bmm(left, right) if base is None else torch.baddbmm(base, left, right)
    if matmul_precision != TF32X3:
        raise ValueError(f"no product at matmul_precision {matmul_precision!r}")
    (left_head, left_tail), (right_head, right_tail) = _split(left), _split(right)
    small = torch.bmm(_tf32_operand(left_tail), right_head)  # heads are TF32 values already
    small = torch.baddbmm(small, left_head, _tf32_operand(right_tail))
    if base is not None:
        small = small + base
    return torch.baddbmm(small, left_head, right_head)


def bmm(left: Tensor, right: Tensor, matmul_precision: str) -> Tensor:
    """``left @ right`` per block at ``matmul_precision`` (see :func:`baddbmm`)."""
    return baddbmm(None, left, right, matmul_precision)


@contextmanager
def cuda_matmuls(tf32: bool) -> Iterator[None]:
    """Run CUDA float32 matmuls inside the block on TF32 tensor cores (``tf32``) or in IEEE
    float32, whatever the process's setting (Lightning suggests TF32 on tensor-core GPUs), and
    put that setting back afterwards, through the API it was set with."""
    if not torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9; reading the legacy flag could raise
        saved = matmul.fp32_precision
        matmul.fp32_precision = TF32 if tf32 else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = saved
        return
    saved_flag = matmul.allow_tf32
    matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        matmul.allow_tf32 = saved_flag
