"""Inverse roots of DASH's Kronecker factors: the batched solvers, their spectral scaling, and which
one ``inverse_root_method="auto"`` picks (the maths: :mod:`.solve`)."""

from lightning_dash.optim.roots.choice import choose_inverse_root_method, explain_choice
from lightning_dash.optim.roots.common import (
    DEFAULT_TOLERANCE,
    INVERSE_ROOT_METHODS,
    MATMUL_DTYPES,
    MAX_ROOT_ERROR,
    RootResult,
    RootSettings,
    failure_residual,
)
from lightning_dash.optim.roots.solve import inverse_root, normalise, spectrum_floor
from lightning_dash.optim.roots.spectral import chebyshev_floor

__all__ = [
    "DEFAULT_TOLERANCE",
    "INVERSE_ROOT_METHODS",
    "MATMUL_DTYPES",
    "MAX_ROOT_ERROR",
    "RootResult",
    "RootSettings",
    "chebyshev_floor",
    "choose_inverse_root_method",
    "explain_choice",
    "failure_residual",
    "inverse_root",
    "normalise",
    "spectrum_floor",
]
