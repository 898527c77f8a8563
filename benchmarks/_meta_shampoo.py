"""Meta's Distributed Shampoo built with the settings of the DASH case it is timed against.

``distributed_shampoo.DistributedShampoo`` (facebookresearch/optimizers, installed from
``../shared/peers/torch-shampoo-*.tar.gz``; see ``../shared/peers/README.md``) is a peer for
``benchmarks/speed/step_time.py`` only: nothing in the package imports it, and this module imports
it only when an optimizer is built, so that the benchmarks load without it. Only its public
API is called (the names exported by ``distributed_shampoo``).

Matched with DASH, as its README recommends for a comparison with an Adam-grafted Shampoo:

* the same learning rate, ``betas`` (momentum of the gradient, decay of the Kronecker
  factors), no weight decay (decoupled), and bias correction (both default to it);
* ``max_preconditioner_dim`` = DASH's ``block_size``: both cut every matrix into tiles of at
  most that side;
* Adam grafting with the same ``beta2`` and ``epsilon`` (``AdamPreconditionerConfig``), the
  Shampoo direction rescaled per block to the Adam update's norm, as DASH does;
* its default root solver, an eigendecomposition (``torch.linalg.eigh``) of each factor,
  exponent -1/4 on each side of a matrix;
* the same ``precondition_frequency`` f. Its ``start_preconditioning_step`` must be at least f
  (it raises otherwise), so it is f: the smallest it accepts, 1 at f = 1 (roots from the first
  step, as DASH's default ``start_preconditioning_step=1``). Before that step it follows the
  Adam direction alone, which is cheaper: the benchmark warms both optimizers up for at
  least :func:`start_preconditioning_step` steps, so every timed window of f steps holds one
  root computation and f Shampoo steps for each;
* no Shampoo factors on one-dimensional parameters (``inverse_exponent_override={1: 0.0}``):
  DASH updates vectors (biases, LayerNorm weights) with the grafting optimizer alone, while
  Meta's default preconditions a vector of length n with an n x n factor and its own
  eigendecomposition (a 1024-long MLP bias would add a 1024 x 1024 ``eigh`` per refresh).
  With the override a vector keeps its momentum and Adam state, and its direction is the
  momentum rescaled to the Adam update's norm: elementwise work, as for DASH.

``epsilon`` is each optimizer's own recommended damping, not one number: DASH's is relative
to each factor's Frobenius norm (default 1e-6), Meta's absolute (1e-12, its default and its
README's recommendation). Neither changes an eigendecomposition's cost.

DASH's recipe (``root_order``, ``nesterov``; the race's ``meta-shampoo-dash-recipe``), in
Meta's public options:

* ``root_order=p``: the exponent -1/p on each factor of a matrix,
  ``inverse_exponent_override={2: 1/p}`` (Meta's value is the exponent's magnitude; its default
  for an order-k tensor is 1/(2k), -1/4 on a matrix, so ``p=4`` is its default). Only matrices:
  DASH preconditions nothing else.
* ``nesterov=True``: DASH's Nesterov direction is ``beta1 m_t + (1 - beta1) g_t`` with
  ``m_t = beta1 m_(t-1) + (1 - beta1) g_t``, bias-corrected by ``1 - beta1^(t+1)``. Meta's
  ``beta3`` is that look-ahead: its direction is ``beta3 m_(t-1) + (1 - beta3) g_t``, corrected
  by ``1 - beta3 beta1^(t-1)``, and ``beta3 = beta1^2`` makes both equal to DASH's (its
  docstring's "a version of NAdam"). Its ``ClassicMomentumConfig(use_nesterov=True)`` is another
  thing: SGD momentum on the preconditioned, grafted direction, a second momentum on top of the
  ``betas[0]`` average, which DASH does not have.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

import torch
from torch import Tensor

#: The module the package installs.
MODULE = "distributed_shampoo"
#: Meta's own recommendation (README) and default: an absolute damping.
META_EPSILON = 1e-12
#: Meta's default inverse root of a matrix's factors: ``L^(-1/4) G R^(-1/4)``.
META_ROOT_ORDER = 4
#: How Meta's eigenvalue-corrected Shampoo finds the factors' eigenvectors: its two presets.
EIGENBASIS_SOLVERS = ("eigh", "qr")


def available() -> bool:
    """Whether ``distributed_shampoo`` can be imported here."""
    return importlib.util.find_spec(MODULE) is not None


def version() -> str:
    """The installed distribution's version (the tarball's name carries the commit)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        return distribution_version("torch-shampoo")
    except PackageNotFoundError:
        return "unknown"


def exponent_override(root_order: int, precondition_vectors: bool = False) -> dict[int, float]:
    """Meta's ``inverse_exponent_override``: 1/``root_order`` on each factor of a matrix (key: the
    tensor's order), and 0 (no factor) on vectors unless ``precondition_vectors``."""
    if root_order < 1:
        raise ValueError(f"root_order must be a positive integer, got {root_order!r}")
    return {2: 1.0 / root_order} | ({} if precondition_vectors else {1: 0.0})


def beta3(beta1: float, nesterov: bool) -> float:
    """Meta's ``beta3``: ``beta1**2`` is DASH's Nesterov direction, ``beta1`` (its -1 default) plain
    momentum (see the module docstring)."""
    return beta1 * beta1 if nesterov else beta1


def start_preconditioning_step(frequency: int) -> int:
    """The first step that uses (and computes) the roots: the smallest Meta accepts, ``frequency``."""
    return frequency


def build_meta_shampoo(
    params: Iterable[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    block_size: int,
    precondition_frequency: int,
    grafting_beta2: float,
    grafting_epsilon: float,
    epsilon: float = META_EPSILON,
    precondition_vectors: bool = False,
    root_order: int = META_ROOT_ORDER,
    nesterov: bool = False,
) -> torch.optim.Optimizer:
    """``DistributedShampoo`` on ``params`` with the settings above (eigh roots, Adam grafting).

    ``precondition_vectors=True`` keeps Meta's default of a Shampoo factor on every
    one-dimensional parameter as well. ``root_order`` and ``nesterov`` as DASH's options of the
    same names (see the module docstring): the defaults are Meta's own choices.
    """
    from distributed_shampoo import (
        AdamPreconditionerConfig,
        RootInvShampooPreconditionerConfig,
    )

    # The default amortized computation of RootInvShampooPreconditionerConfig is its
    # eigendecomposition (DefaultEigenConfig); only the exponents are overridden.
    preconditioner = RootInvShampooPreconditionerConfig(
        inverse_exponent_override=exponent_override(root_order, precondition_vectors)
    )
    return distributed_shampoo(
        params,
        lr=lr,
        betas=betas,
        epsilon=epsilon,
        block_size=block_size,
        precondition_frequency=precondition_frequency,
        beta3=beta3(betas[0], nesterov),
        grafting_config=AdamPreconditionerConfig(beta2=grafting_beta2, epsilon=grafting_epsilon),
        preconditioner_config=preconditioner,
    )


def distributed_shampoo(
    params: Iterable[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    epsilon: float,
    block_size: int,
    precondition_frequency: int,
    **config: object,
) -> torch.optim.Optimizer:
    """``DistributedShampoo`` with what every builder here shares: decoupled weight decay (0; the race
    sets its own on the groups), blocks of ``block_size``, and preconditioning from the first step
    Meta accepts; ``config``: the rest of its options (preconditioner, grafting, ``beta3``)."""
    from distributed_shampoo import DistributedShampoo, WeightDecayType

    return DistributedShampoo(
        params,
        lr=lr,
        betas=betas,
        epsilon=epsilon,
        weight_decay=0.0,
        weight_decay_type=WeightDecayType.DECOUPLED,
        max_preconditioner_dim=block_size,
        precondition_frequency=precondition_frequency,
        start_preconditioning_step=start_preconditioning_step(precondition_frequency),
        **config,
    )


def build_meta_eigenvalue_corrected(
    params: Iterable[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    block_size: int,
    precondition_frequency: int,
    eigenbasis: str,
    epsilon: float = META_EPSILON,
) -> torch.optim.Optimizer:
    """Meta's eigenvalue-corrected Shampoo on ``params``, as its README's "replace AdamW" example
    builds it: Adam's second moment kept in the eigenbasis of each block's Kronecker factors,
    the eigenvectors recomputed every ``precondition_frequency`` steps, the eigenvalues every
    step, and no grafting (AdamW's lr, betas and weight decay carry over).

    ``eigenbasis``: ``"eigh"`` (``DefaultEigenvalueCorrectedShampooConfig``, a full decomposition)
    or ``"qr"`` (``DefaultSOAPConfig``, warm-started QR iterations). Vectors change no basis
    (``ignored_basis_change_dims={1: [0]}``): they follow Adam, as DASH's vectors do.
    """
    from distributed_shampoo import (
        EigenvalueCorrectedShampooPreconditionerConfig,
        EighEigendecompositionConfig,
        QREigendecompositionConfig,
    )

    if eigenbasis not in EIGENBASIS_SOLVERS:
        raise ValueError(f"eigenbasis must be one of {EIGENBASIS_SOLVERS}, got {eigenbasis!r}")
    solver = QREigendecompositionConfig() if eigenbasis == "qr" else EighEigendecompositionConfig()
    preconditioner = EigenvalueCorrectedShampooPreconditionerConfig(
        amortized_computation_config=solver, ignored_basis_change_dims={1: [0]}
    )
    return distributed_shampoo(
        params,
        lr=lr,
        betas=betas,
        epsilon=epsilon,
        block_size=block_size,
        precondition_frequency=precondition_frequency,
        preconditioner_config=preconditioner,
    )
