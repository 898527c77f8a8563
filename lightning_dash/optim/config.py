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
    check_choice,
    check_int,
    check_matmul_dtype,
    check_number,
    check_params,
    did_you_mean,
    dtype_name,
)

MATRIX_SCALINGS = ("frobenius", "power_iteration")
#: ``inverse_root_method`` value that picks the solver per device and block size.
AUTO = "auto"

#: Relative damping of the factors (see ``epsilon``): with inverse square roots, the smallest that keeps a
#: 1e-7 relative gradient perturbation (another summation order) below 1e-4 of the parameters' movement
#: after 12 steps (``benchmarks/numerics/roundoff.py``: at most 2.4e-5 at 1e-3, 2.2e-4 at 1e-4), at no cost on the model
#: families (``benchmarks/races/families.py``; docs/benchmarks/families.md).
DEFAULT_EPSILON = 1e-3
#: The inverse-root orders :attr:`DashConfig.root_order` takes.
ROOT_ORDERS = (2, 4)


def _option(default: Any, doc: str, check: Callable[[str, Any], Any], per_group: bool = False) -> Any:
    return field(default=default, metadata={"doc": doc, "check": check, "per_group": per_group})


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else check(name, value)


def _positive(name: str, value: Any) -> float:
    return check_number(name, value, low=0.0, low_open=True)


def _step_count(meaning: str = "") -> Callable[[str, Any], int]:
    """A check that raises ValueError for every value that is not an integer >= 1 (a bool, a float,
    a string such as "auto", 0), the message naming the option and, if given, what it counts."""

    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1{meaning}, got {value!r}")
        return value

    return check


def _non_negative(name: str, value: Any) -> float:
    return check_number(name, value, low=0.0)


def _unit_open(name: str, value: Any) -> float:
    return check_number(name, value, low=0.0, high=1.0, high_open=True)


def _unit(name: str, value: Any) -> float:
    return check_number(name, value, low=0.0, high=1.0)


def _at_least(low: int) -> Callable[[str, Any], int]:
    return lambda name, value: check_int(name, value, low=low)


def _one_of(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    return lambda name, value: check_choice(name, value, choices)


def _root_order(name: str, value: Any) -> int:
    # The Newton solvers take p-th roots for p a power of two; 2 and 4 are the ones that make sense.
    if isinstance(value, bool) or value not in ROOT_ORDERS:
        raise ValueError(f"{name} must be one of {ROOT_ORDERS}, got {value!r}")
    return int(value)


def _matmul_dtype(name: str, value: Any) -> str:
    return dtype_name(check_matmul_dtype(value, name))


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


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

    lr: float = _option(1e-3, "learning rate", _non_negative, per_group=True)
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
        _positive,
        per_group=True,
    )
    relative_epsilon: bool = _option(
        True, "whether epsilon is relative to each factor's norm (scale-invariant) or absolute", check_bool
    )
    weight_decay: float = _option(0.0, "decoupled weight decay, W <- W (1 - lr wd)", _non_negative, per_group=True)
    lr_scale: float = _option(
        1.0,
        "multiplies the lr of the grafted Shampoo direction of preconditioned blocks only (not of 1-D or "
        "Adam-routed parameters, not the weight decay); 1: grafting already gives each block the grafting "
        "optimizer's step size, so that optimizer's tuned lr carries over (version 0.4 used 8 for Adam sources)",
        _positive,
    )
    block_size: int = _option(1024, "largest tile side; remainders form smaller tiles", _at_least(1))
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
        _step_count(" (steps between root refreshes)"),
        per_group=True,
    )
    start_preconditioning_step: int = _option(
        1,
        "first step that uses the Shampoo direction (earlier steps follow the grafting direction)",
        _at_least(1),
        per_group=True,
    )
    inverse_root_method: str = _option(
        "auto",
        "solver of the inverse roots: auto picks the fastest one at the required accuracy for the "
        "parameters' device and the block size, as measured (eigh on CPU, newton_db on CUDA); eigh treats the "
        "roundoff-level null space of a rank-deficient factor as null; the iterative solvers "
        "(coupled_newton, newton_db, chebyshev) need a larger epsilon",
        _one_of((AUTO, *INVERSE_ROOT_METHODS)),
    )
    root_order: int = _option(
        2,
        "p of the inverse p-th root taken of each Kronecker factor: 4, Shampoo's L^(-1/4) G R^(-1/4); 2, "
        "L^(-1/2) G R^(-1/2), the square root of the Kronecker-factored full-matrix preconditioner",
        _root_order,
    )
    matrix_scaling: str = _option(
        "power_iteration", "spectrum bound of the Newton and Chebyshev solvers", _one_of(MATRIX_SCALINGS)
    )
    matmul_dtype: str = _option(
        "float32",
        "dtype of the solver matmuls: float32, bfloat16 or float16 (a torch.dtype also works)",
        _matmul_dtype,
    )
    matmul_precision: str = _option(
        "auto",
        "how the float32 matmuls of a step run (factor statistics, the preconditioned direction, and the Newton "
        "roots when matmul_dtype is float32): float32 (IEEE); tf32 (one TF32 tensor-core product: fastest, ~100x "
        "float32's roundoff sensitivity); tf32x3 (three TF32 products of split operands: float32's accuracy on tensor "
        "cores, but slower than float32 while its split runs eager); auto (float32: measured the best safe choice on "
        "an H200). TF32 is emulated off CUDA; state stays float32",
        _one_of(MATMUL_PRECISIONS),
    )
    grafting: str = _option(
        "adam",
        "optimizer whose per-block update norm the Shampoo direction takes (none: raw Shampoo)",
        _one_of(GRAFTING_TYPES),
    )
    grafting_norm: str = _option(
        "spectral",
        "the norm in which each block's Shampoo direction takes the grafting direction's size: spectral (its "
        "largest singular value, estimated by 8 power iterations: a whitened step as large in every direction as "
        "the grafting step is in its largest); frobenius (the norm of all entries, the behaviour before 0.6)",
        _one_of(GRAFTING_NORMS),
    )
    grafting_beta2: float = _option(0.95, "second-moment decay of Adam/RMSprop grafting", _unit_open, per_group=True)
    grafting_epsilon: float = _option(1e-8, "epsilon of the grafting optimizer", _positive, per_group=True)
    shampoo_blend: float = _option(
        1.0,
        "weight of the Shampoo direction against the grafting direction (PreconditionerSchedule ramps it)",
        _unit,
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
        "from_start",
        "steps that recompute the roots, for start_preconditioning_step s and precondition_frequency f: "
        "from_start (s, s + f, s + 2f, ...); multiples (s, then every multiple of f: 1, f, 2f, ... as the DASH "
        "paper's code)",
        _one_of(ROOT_SCHEDULES),
    )
    decay_vectors: bool = _option(
        True,
        "whether weight_decay shrinks 1-D parameters too (False: matrices only, as the DASH paper's code)",
        check_bool,
    )
    root_iterations: int | None = _option(
        None,
        "iterations per pass of the Newton solvers; None: as many as the damping needs, planned on the host",
        _optional(_at_least(1)),
    )
    chebyshev_degree: int = _option(40, "degree of the Chebyshev interpolant", _at_least(2))
    max_consecutive_root_failures: int | None = _option(
        3,
        "raise RootComputationError once a block's root failed this many times in a row (None: never)",
        _optional(_at_least(1)),
    )
    async_preconditioning: bool = _option(
        False,
        "on CUDA, compute due roots on a side stream and use them from a later step (off CUDA: synchronous)",
        _flag,
    )
    compile: bool = _option(
        False,
        "compile each stack's statistics, momentum, grafting and update with torch.compile(fullgraph=True): "
        "fused elementwise work, hyperparameters as tensors so schedules never recompile (the first steps compile)",
        _flag,
    )
    max_staleness: int = _option(
        1, "latest step, counted from the computation's, at which asynchronous roots must be used", _step_count()
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
    "grafting_norm": "frobenius",
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
