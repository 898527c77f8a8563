"""Every DASH option, written once: its default, its meaning and its check.

:class:`DashConfig` is the single list of options. The optimizer, the Lightning
strategy and the Composer algorithm all take their options from it (by keyword or
as ``config=``), the per-group checks of :mod:`lightning_dash.optim.validation` use
its checks, and the documentation's option table is generated from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_dash.optim import option_checks as accepts
from lightning_dash.optim.precision import MATMUL_PRECISIONS
from lightning_dash.optim.precision import resolve as resolve_matmul_precision
from lightning_dash.optim.roots import INVERSE_ROOT_METHODS, RootSettings
from lightning_dash.optim.routing import AUTO as AUTO_ROUTING
from lightning_dash.optim.routing import PreconditionRule, check_precondition, check_split_rows
from lightning_dash.optim.step.grafting import GRAFTING_NORMS, GRAFTING_TYPES
from lightning_dash.optim.step.schedule import ROOT_SCHEDULES
from lightning_dash.optim.validation import (
    check_betas,
    check_bool,
    check_matmul_dtype,
    check_params,
    did_you_mean,
)

MATRIX_SCALINGS = ("frobenius", "power_iteration")
#: ``inverse_root_method`` value that picks the solver per device and block size.
AUTO = "auto"

#: Relative damping of the factors (see ``epsilon``): chosen with the other defaults on the model-family
#: suite and the byte-level GPT race (docs/benchmarks/families.md). Smaller damping whitens more of each
#: factor's tail, which the race rewards (seed 0: 1.83 at 1e-5, 1.87 at 3e-5, 1.93 at 1e-4, 2.03 at 1e-3), and
#: magnifies roundoff: at 1e-5 two data-parallel ranks' averaged gradients moved a byte-level GRU by 3x what
#: they move torch's Muon on one seed of twelve; at 3e-5 by at most a fifth of it on every seed measured
#: (``benchmarks/numerics/roundoff.py``, with float64 decompositions).
DEFAULT_EPSILON = 3e-5


def _option(default: Any, doc: str, check: Callable[[str, Any], Any], per_group: bool = False) -> Any:
    return field(default=default, metadata={"doc": doc, "check": check, "per_group": per_group})


@dataclass(frozen=True)
class DashConfig:
    """The options of :class:`~lightning_dash.optim.DASH`, checked when built.

    Per-group options (``lr``, ``betas``, ``epsilon``, ``weight_decay``,
    ``grafting_beta2``, ``grafting_epsilon``, ``precondition_frequency``,
    ``start_preconditioning_step``, ``shampoo_blend``) are the defaults of every
    parameter group and may differ between groups; the others are optimizer-wide.
    A bad value raises ``ValueError`` (``TypeError`` for a wrong type) naming the
    option and what it accepts.
    """

    lr: float = _option(1e-3, "learning rate", accepts.non_negative, per_group=True)
    betas: tuple[float, float] = _option(
        (0.9, 0.95),
        "(momentum of the gradient, decay of the Kronecker factors); a momentum of 0 disables it, "
        "a decay of 1.0 accumulates AdaGrad-style sums",
        check_betas,
        per_group=True,
    )
    epsilon: float = _option(
        DEFAULT_EPSILON,
        "damping added to the bias-corrected factors before the roots: epsilon * ||L||_F * I "
        "(relative to the factor's Frobenius norm), or epsilon * I with relative_epsilon=False",
        accepts.positive,
        per_group=True,
    )
    relative_epsilon: bool = _option(
        True, "whether epsilon is relative to each factor's norm (scale-invariant) or absolute", check_bool
    )
    weight_decay: float = _option(
        0.0, "decoupled weight decay, W <- W (1 - lr wd)", accepts.non_negative, per_group=True
    )
    lr_scale: float = _option(
        2.0,
        "multiplies the lr of the grafted Shampoo direction of preconditioned blocks only (not of 1-D or "
        "Adam-routed parameters, not the weight decay, not a raw direction with grafting='none'); 2 (since 0.7) "
        "with Frobenius grafting: a whitened step as large in every direction as a noise-dominated Adam step is "
        "in its largest one, so Adam's tuned lr carries over (docs/options.md); 1: the grafting optimizer's "
        "Frobenius norm itself",
        accepts.positive,
    )
    block_size: int = _option(1024, "largest tile side; remainders form smaller tiles", accepts.at_least(1))
    precondition: PreconditionRule = _option(
        AUTO_ROUTING,
        "which parameters get Kronecker factors (the rest, and every 1-D parameter, follow the grafting optimizer "
        "alone): auto (hidden when DASH knows the model and it has no recurrent layer, else all_matrices); "
        "all_matrices; hidden (not the embeddings, the output layer or weights tied to them, as in Muon's recipe; "
        "needs the model: the strategies, Fabric and Composer pass it, in plain PyTorch pass model=); a set of "
        "parameter names; or a callable (name, param) -> bool",
        check_precondition,
    )
    split_rows: tuple[tuple[str, int], ...] = _option(
        (),
        "fused projections to precondition as equal row parts, e.g. {'qkv': 3}: a key matches whole dotted "
        "components of a parameter's name (3-D parameters that are not convolution weights are already one "
        "matrix per expert)",
        check_split_rows,
    )
    precondition_frequency: int = _option(
        10,
        "recompute the inverse roots every this many steps",
        accepts.step_count(" (steps between root refreshes)"),
        per_group=True,
    )
    start_preconditioning_step: int = _option(
        1,
        "first step that uses the Shampoo direction (earlier steps follow the grafting direction)",
        accepts.at_least(1),
        per_group=True,
    )
    inverse_root_method: str = _option(
        "auto",
        "solver of the inverse roots: auto picks the fastest one at the required accuracy for the "
        "parameters' device and the block size, as measured (eigh on CPU, newton_db on CUDA); eigh treats the "
        "roundoff-level null space of a rank-deficient factor as null; the iterative solvers "
        "(coupled_newton, newton_db, chebyshev) need a larger epsilon",
        accepts.one_of((AUTO, *INVERSE_ROOT_METHODS)),
    )
    root_order: int = _option(
        2,
        "p of the inverse p-th root taken of each Kronecker factor: 4, Shampoo's L^(-1/4) G R^(-1/4); 2, "
        "L^(-1/2) G R^(-1/2), the square root of the Kronecker-factored full-matrix preconditioner",
        accepts.root_order,
    )
    matrix_scaling: str = _option(
        "power_iteration", "spectrum bound of the Newton and Chebyshev solvers", accepts.one_of(MATRIX_SCALINGS)
    )
    eigh_dtype: str = _option(
        "float64",
        "dtype in which the eigh solver decomposes float32 factors: float64 (about 1.7x a float32 "
        "decomposition on a CPU; at the default damping it keeps two data-parallel ranks as close as torch's "
        "Muon keeps them) or float32 (faster; the tail's eigenvectors come out mixed, which training amplifies "
        "about 20x more at epsilon 1e-5); float64 factors are always decomposed in float64",
        accepts.eigh_dtype,
    )
    matmul_dtype: str = _option(
        "float32",
        "dtype of the solver matmuls: float32, bfloat16 or float16 (a torch.dtype also works)",
        accepts.matmul_dtype,
    )
    matmul_precision: str = _option(
        "auto",
        "how the float32 matmuls of a step run (factor statistics, the preconditioned direction, and the Newton "
        "roots when matmul_dtype is float32): float32 (IEEE); tf32 (one TF32 tensor-core product: fastest, ~100x "
        "float32's roundoff sensitivity); tf32x3 (three TF32 products of split operands: float32's accuracy on tensor "
        "cores, but slower than float32 while its split runs eager); auto (float32: measured the best safe choice on "
        "an H200). TF32 is emulated off CUDA; state stays float32",
        accepts.one_of(MATMUL_PRECISIONS),
    )
    grafting: str = _option(
        "adam",
        "optimizer whose per-block update norm the Shampoo direction takes (none: raw Shampoo)",
        accepts.one_of(GRAFTING_TYPES),
    )
    grafting_norm: str = _option(
        "frobenius",
        "the norm in which each block's Shampoo direction takes the grafting direction's size (times lr_scale): "
        "frobenius (the norm of all entries); spectral (its largest singular value, estimated by 8 power "
        "iterations; the default of 0.6, which made recurrent models explode at small damping)",
        accepts.one_of(GRAFTING_NORMS),
    )
    grafting_beta2: float = _option(
        0.95, "second-moment decay of Adam/RMSprop grafting", accepts.unit_open, per_group=True
    )
    grafting_epsilon: float = _option(1e-8, "epsilon of the grafting optimizer", accepts.positive, per_group=True)
    shampoo_blend: float = _option(
        1.0,
        "weight of the Shampoo direction against the grafting direction (PreconditionerSchedule ramps it)",
        accepts.unit,
        per_group=True,
    )
    nesterov: bool = _option(True, "use a Nesterov-style momentum in the direction", check_bool)
    bias_correction: bool = _option(
        True, "correct momentum, factors and Adam's second moment for their zero initialisation", check_bool
    )
    factor_bias_correction: bool = _option(
        True,
        "with bias_correction, divide the Kronecker factors by 1 - betas[1]^t before damping them (False: damp "
        "the raw averages, as the DASH paper's code does; grafting leaves the factors' scale to matter only "
        "against epsilon)",
        check_bool,
    )
    root_schedule: str = _option(
        "doubling",
        "steps that recompute the roots, for start_preconditioning_step s and precondition_frequency f: "
        "doubling (s, every power of two below s + f: each time the factors hold twice the gradients, then "
        "s + f, s + 2f, ...; 1, 2, 4, 8, 11, 21, ... by default); from_start (s, s + f, s + 2f, ...); multiples "
        "(s, then every multiple of f: 1, f, 2f, ... as the DASH paper's code)",
        accepts.one_of(ROOT_SCHEDULES),
    )
    decay_vectors: bool = _option(
        True,
        "whether weight_decay shrinks 1-D parameters too (False: matrices only, as the DASH paper's code)",
        check_bool,
    )
    root_iterations: int | None = _option(
        None,
        "iterations per pass of the Newton solvers; None: as many as the damping needs, planned on the host",
        accepts.optional(accepts.at_least(1)),
    )
    chebyshev_degree: int = _option(40, "degree of the Chebyshev interpolant", accepts.at_least(2))
    max_consecutive_root_failures: int | None = _option(
        3,
        "raise RootComputationError once a block's root failed this many times in a row (None: never)",
        accepts.optional(accepts.at_least(1)),
    )
    async_preconditioning: bool = _option(
        False,
        "on CUDA, compute due roots on a side stream and use them from a later step (off CUDA: synchronous)",
        accepts.flag,
    )
    compile: bool = _option(
        False,
        "compile each stack's statistics, momentum, grafting and update with torch.compile(fullgraph=True): "
        "fused elementwise work, hyperparameters as tensors so schedules never recompile (the first steps compile)",
        accepts.flag,
    )
    max_staleness: int = _option(
        1, "latest step, counted from the computation's, at which asynchronous roots must be used", accepts.step_count()
    )

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            object.__setattr__(self, spec.name, spec.metadata["check"](spec.name, getattr(self, spec.name)))

    @classmethod
    def build(cls, config: DashConfig | None = None, **options: Any) -> DashConfig:
        """``config`` (default: the defaults) with ``options`` replacing its values.

        Unknown option names raise ``TypeError`` listing the known ones, as does a ``config``
        that is not a DashConfig.
        """
        if config is not None and not isinstance(config, DashConfig):
            raise TypeError(f"config must be a DashConfig, got {type(config).__name__}")
        check_option_names(options)
        return dataclasses.replace(config or cls(), **options)

    @classmethod
    def paper(cls, **options: Any) -> DashConfig:
        """The DASH paper's algorithm as its authors' code computes it (their ``DashLayerwise`` with
        eigendecomposition roots), ``options`` replacing any of its values: inverse fourth roots of
        every matrix's factors, damped by an absolute 1e-10 that their eigendecomposition adds twice
        (``epsilon=2e-10``) before any bias correction, recomputed at steps 1, f, 2f, ...; Adam grafting
        and Adam on 1-D parameters; weight decay on matrices only; no Nesterov momentum."""
        return cls.build(cls(**PAPER), **options)

    @classmethod
    def close_to_one_process(cls, **options: Any) -> DashConfig:
        """Options for runs that must follow one another closely, ``options`` replacing any of them:
        version 0.6's defaults (spectral grafting, damping 1e-3, ``lr_scale`` 1, roots from the start step
        every f). Two data-parallel ranks' averaged gradients then move training by at most 1e-4 of its
        movement after 10 steps on the roundoff benchmark's networks, where today's defaults, chosen on
        quality, stay within what they move torch's Muon (``benchmarks/numerics/roundoff.py``); on the
        byte-level GPT race these options end higher (docs/options.md)."""
        return cls.build(cls(**CLOSE_TO_ONE_PROCESS), **options)

    def group_defaults(self) -> dict[str, Any]:
        """The per-group options, as the defaults of a torch optimizer's ``param_groups``."""
        return {name: getattr(self, name) for name in GROUP_OPTIONS}

    def changed(self) -> dict[str, Any]:
        """The options whose value differs from the default."""
        default = DashConfig()
        return {name: getattr(self, name) for name in OPTION_NAMES if getattr(self, name) != getattr(default, name)}

    @property
    def root_settings(self) -> RootSettings:
        """How the inverse roots are computed."""
        return RootSettings(
            method=self.inverse_root_method,
            root_order=self.root_order,
            scaling=self.matrix_scaling,
            matmul_dtype=check_matmul_dtype(self.matmul_dtype),
            iterations=self.root_iterations,
            chebyshev_degree=self.chebyshev_degree,
            relative_epsilon=self.relative_epsilon,
            matmul_precision=resolve_matmul_precision(self.matmul_precision),
            eigh_dtype=getattr(torch, self.eigh_dtype),
        )


#: What :meth:`DashConfig.paper` changes from the defaults.
PAPER: dict[str, Any] = {
    "root_order": 4,
    "inverse_root_method": "eigh",
    "epsilon": 2e-10,
    "relative_epsilon": False,
    "factor_bias_correction": False,
    "root_schedule": "multiples",
    "decay_vectors": False,
    "nesterov": False,
    "precondition": "all_matrices",
    "lr_scale": 1.0,
}

#: What :meth:`DashConfig.close_to_one_process` changes from the defaults.
CLOSE_TO_ONE_PROCESS: dict[str, Any] = {
    "grafting_norm": "spectral",
    "epsilon": 1e-3,
    "lr_scale": 1.0,
    "root_schedule": "from_start",
}

#: Every option's name, in declaration order.
OPTION_NAMES: tuple[str, ...] = tuple(spec.name for spec in dataclasses.fields(DashConfig))

#: Options kept per parameter group (everything else is optimizer-wide).
GROUP_OPTIONS: tuple[str, ...] = tuple(
    spec.name for spec in dataclasses.fields(DashConfig) if spec.metadata["per_group"]
)

_CHECKS = {spec.name: spec.metadata["check"] for spec in dataclasses.fields(DashConfig)}


def check_option_names(options: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` naming every key of ``options`` that is not a DASH option, with the
    closest option name for each and then every option name."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        named = f"option {unknown[0]!r}" if len(unknown) == 1 else f"options {unknown}"
        hint = did_you_mean(unknown, OPTION_NAMES)
        raise TypeError(f"unknown DASH {named}{hint} (known: {sorted(OPTION_NAMES)})")


def check_option(name: str, value: Any) -> Any:
    """Check one option's value (as :class:`DashConfig` would) and return it normalised."""
    check_option_names({name: value})
    return _CHECKS[name](name, value)


def check_group(group: dict[str, Any]) -> None:
    """Check a DASH parameter group: its per-group options and its parameters."""
    for name in GROUP_OPTIONS:
        _CHECKS[name](name, group[name])
    check_params(group["params"])
