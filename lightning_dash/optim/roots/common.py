"""What every inverse-root solver shares: settings, results, precision constants and
small batched-matrix helpers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dash.optim import precision

INVERSE_ROOT_METHODS = ("eigh", "coupled_newton", "newton_db", "chebyshev")
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: What a solver's matmuls round to: a dtype, or a TF32 precision of float32 operands
#: (:data:`~lightning_dash.optim.precision.TF32`, :data:`~lightning_dash.optim.precision.TF32X3`).
MatmulFormat = torch.dtype | str
TF32, TF32X3 = precision.TF32, precision.TF32X3

#: Unit roundoff of each matmul format.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    TF32: 2.0 ** -(precision.TF32_MANTISSA_BITS + 1),
    TF32X3: 2.0**-22,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}

#: The Newton solvers lift every eigenvalue of the scaled input to at least this many
#: units of roundoff of the matmul dtype. Each iteration perturbs near-null directions
#: by about one unit of roundoff and then amplifies them ~2.25x; without the lift a
#: rank-deficient factor drifts negative and diverges (seen in float32 at 20
#: iterations, in bfloat16 and float16 at 10). Four units already sufficed in tests.
NOISE_FLOOR_UNITS = 8.0

#: Residual ``max|I - product|`` under which a block counts as converged, per matmul dtype.
#: Each is a few units of roundoff of that dtype times the growth seen in practice.
DEFAULT_TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    TF32: 4e-3,
    TF32X3: 4e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 4e-3,
}


@dataclass(frozen=True)
class RootResult:
    """Roots of a stack and, for the Newton solvers, the last per-block residual."""

    root: Tensor
    residual: Tensor | None


@dataclass(frozen=True)
class RootSettings:
    """How inverse roots are computed; shared by every stack of one optimizer.

    It carries DASH's options of the same names (``inverse_root_method`` as ``method``,
    ``matrix_scaling`` as ``scaling``, ``root_iterations`` as ``iterations``), whose defaults
    live in :class:`~lightning_dash.optim.DashConfig` alone: build one with
    ``DashConfig(...).root_settings``. ``eigh_dtype`` is the dtype ``eigh`` decomposes float32
    statistics in (float64 statistics always in float64). ``tolerance`` (None: :data:`DEFAULT_TOLERANCE` of the
    matmul format) is the Newton solvers' convergence test. ``matmul_precision`` is how float32
    matmuls run (:mod:`lightning_dash.optim.precision`, resolved: never ``"auto"``); it does not
    apply to other dtypes.
    """

    method: str
    root_order: int
    scaling: str
    matmul_dtype: torch.dtype
    iterations: int | None
    chebyshev_degree: int
    relative_epsilon: bool
    tolerance: float | None = None
    matmul_precision: str = precision.FLOAT32
    eigh_dtype: torch.dtype = torch.float64

    @property
    def matmul_format(self) -> MatmulFormat:
        """What the solver's matmuls round their operands to: a TF32 precision for float32
        matmuls that run on tensor cores, else ``matmul_dtype``."""
        if self.matmul_dtype == torch.float32 and self.matmul_precision in precision.TENSOR_CORE_PRECISIONS:
            return self.matmul_precision
        return self.matmul_dtype

    def resolved_tolerance(self) -> float:
        return DEFAULT_TOLERANCE[self.matmul_format] if self.tolerance is None else self.tolerance


#: Largest relative error of any eigenvalue of a Newton root that is still accepted.
MAX_ROOT_ERROR = 0.1


def failure_residual(settings: RootSettings) -> float:
    """Residual above which a Newton root counts as failed.

    Both Newton solvers run the coupled iteration of ``A^(-1/p)`` (``p = settings.root_order``;
    Newton-DB with per-step scalings planned on the host) and report ``max|I - P|`` for the
    product ``P = X^p A``, whose eigenvalues ``w`` tend to 1; the root's eigenvalues are then
    off by the factor ``w^(1/p)``. A residual ``r`` thus allows an error of
    ``1 - (1 - r)^(1/p)``; the threshold ``1 - (1 - MAX_ROOT_ERROR)^p`` (0.34 for the fourth
    root, 0.19 for the square root) accepts at most :data:`MAX_ROOT_ERROR`. It is never below
    four times the convergence tolerance of the matmul dtype, the residual roundoff alone leaves.
    """
    theory = 1.0 - (1.0 - MAX_ROOT_ERROR) ** settings.root_order
    return max(theory, 4.0 * DEFAULT_TOLERANCE[settings.matmul_format])


def working_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype DASH computes and keeps state in for ``tensor``: float64 for float64, float32 for
    every other dtype (statistics of low-precision parameters stay float32)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def noise_floor(matmul_format: MatmulFormat) -> float:
    """Smallest relative eigenvalue the Newton solvers work with in ``matmul_format`` (``8 u``)."""
    return NOISE_FLOOR_UNITS * UNIT_ROUNDOFF[matmul_format]


def spectral_upper_bound(scaling: str) -> float:
    """Largest eigenvalue of ``A / s`` to plan for: 1 for the Frobenius bound; 1.5 for
    power iteration, whose estimate may fall somewhat below the true largest eigenvalue."""
    return 1.0 if scaling == "frobenius" else 1.5


def identity_like(matrices: Tensor) -> Tensor:
    n, size, _ = matrices.shape
    return torch.eye(size, dtype=matrices.dtype, device=matrices.device).expand(n, size, size)


def bmm(left: Tensor, right: Tensor, matmul_format: MatmulFormat) -> Tensor:
    """Batched matmul with operands in ``matmul_format`` (or in the operands' own dtype when
    that is wider, as for float64 stacks) and a result in the operands' dtype."""
    if isinstance(matmul_format, str):
        return precision.bmm(left, right, matmul_format)
    if matmul_format == left.dtype or left.dtype == torch.float64:
        return torch.bmm(left, right)
    return torch.bmm(left.to(matmul_format), right.to(matmul_format)).to(left.dtype)


def symmetrize(matrices: Tensor) -> Tensor:
    return 0.5 * (matrices + matrices.transpose(1, 2))


def add_diagonal(matrices: Tensor, values: Tensor) -> Tensor:
    out = matrices.clone()
    out.diagonal(dim1=1, dim2=2).add_(values.unsqueeze(1))
    return out


def freeze(active: Tensor, new: Tensor, old: Tensor) -> Tensor:
    return torch.where(active[:, None, None], new, old)
