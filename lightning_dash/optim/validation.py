"""Argument checks shared by the optimizer and its trainer integrations.

Every check raises ``ValueError`` (or ``TypeError`` for wrong types) with the
argument's name in the message, so a bad configuration fails at construction
rather than as a NaN many steps later.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable

import torch

from lightning_dash.optim.grafting import GRAFTING_TYPES
from lightning_dash.optim.roots import INVERSE_ROOT_METHODS, MATMUL_DTYPES

MATRIX_SCALINGS = ("frobenius", "power_iteration")

_DTYPE_ALIASES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def check_number(name: str, value: Any, *, low: float, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """Check ``low <(=) value <(=) high`` for a real number and return it as float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high or value != value:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        upper = "inf" if high is None else high
        raise ValueError(f"{name} must be in {left}{low}, {upper}{right}, got {value!r}")
    return value


def check_int(name: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return int(value)


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_betas(name: str, betas: Any) -> tuple[float, float]:
    """``betas[0]`` in [0, 1) is the gradient momentum; ``betas[1]`` in [0, 1] the factor decay."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name} must be a pair (momentum, factor decay), got {betas!r}")
    first = check_number(f"{name}[0]", betas[0], low=0.0, high=1.0, high_open=True)
    second = check_number(f"{name}[1]", betas[1], low=0.0, high=1.0)
    return first, second


def check_matmul_dtype(value: Any, name: str = "matmul_dtype") -> torch.dtype:
    """Accept a torch dtype or its common name; only float32, bfloat16, float16."""
    dtype = _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"{name} must be one of float32, bfloat16, float16, got {value!r}")
    return dtype


def check_communication_dtype(value: Any) -> torch.dtype:
    """The dtype of all-gathered block updates: float32, bfloat16 or float16 (or their names)."""
    dtype = _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"communication_dtype must be one of float32, bfloat16, float16, got {value!r}")
    return dtype


def check_group(group: dict[str, Any]) -> None:
    """Check the per-group hyperparameters of a DASH parameter group."""
    check_number("lr", group["lr"], low=0.0)
    check_betas("betas", group["betas"])
    check_number("epsilon", group["epsilon"], low=0.0, low_open=True)
    check_number("weight_decay", group["weight_decay"], low=0.0)
    check_number("grafting_beta2", group["grafting_beta2"], low=0.0, high=1.0, high_open=True)
    check_number("grafting_epsilon", group["grafting_epsilon"], low=0.0, low_open=True)
    check_int("precondition_frequency", group["precondition_frequency"], low=1)
    check_int("start_preconditioning_step", group["start_preconditioning_step"], low=1)
    check_number("shampoo_blend", group["shampoo_blend"], low=0.0, high=1.0)
    for param in group["params"]:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"params must contain tensors, got {type(param).__name__}")
        if param.is_complex():
            raise TypeError("params: complex parameters are not supported by DASH")
        if not param.is_floating_point():
            raise TypeError(f"params: DASH needs floating-point parameters, got {param.dtype}")
        if param.is_sparse:
            raise ValueError("params: sparse parameters are not supported by DASH")


def check_optimizer_options(options: dict[str, Any]) -> dict[str, Any]:
    """Check the optimizer-wide options; returns them normalised (dtype objects, ints)."""
    return {
        "block_size": check_int("block_size", options["block_size"], low=1),
        "inverse_root_method": check_choice(
            "inverse_root_method", options["inverse_root_method"], INVERSE_ROOT_METHODS
        ),
        "matrix_scaling": check_choice("matrix_scaling", options["matrix_scaling"], MATRIX_SCALINGS),
        "matmul_dtype": check_matmul_dtype(options["matmul_dtype"]),
        "grafting": check_choice("grafting", options["grafting"], GRAFTING_TYPES),
        "nesterov": _check_bool("nesterov", options["nesterov"]),
        "bias_correction": _check_bool("bias_correction", options["bias_correction"]),
        "root_iterations": (
            None if options["root_iterations"] is None else check_int("root_iterations", options["root_iterations"], low=1)
        ),
        "relative_epsilon": _check_bool("relative_epsilon", options["relative_epsilon"]),
        "chebyshev_degree": check_int("chebyshev_degree", options["chebyshev_degree"], low=2),
        "max_consecutive_root_failures": (
            None
            if options["max_consecutive_root_failures"] is None
            else check_int("max_consecutive_root_failures", options["max_consecutive_root_failures"], low=1)
        ),
    }


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


#: Checks of the DASH options a trainer integration may override when it converts the
#: user's optimizer (the Lightning strategy and the Composer algorithm share them).
_OVERRIDE_CHECKS = {
    "block_size": lambda v: check_int("block_size", v, low=1),
    "precondition_frequency": lambda v: check_int("precondition_frequency", v, low=1),
    "start_preconditioning_step": lambda v: check_int("start_preconditioning_step", v, low=1),
    "root_iterations": lambda v: check_int("root_iterations", v, low=1),
    "inverse_root_method": lambda v: check_choice("inverse_root_method", v, INVERSE_ROOT_METHODS),
    "matrix_scaling": lambda v: check_choice("matrix_scaling", v, MATRIX_SCALINGS),
    "grafting": lambda v: check_choice("grafting", v, GRAFTING_TYPES),
    "matmul_dtype": check_matmul_dtype,
    "epsilon": lambda v: check_number("epsilon", v, low=0.0, low_open=True),
    "factor_decay": lambda v: check_number("factor_decay", v, low=0.0, high=1.0),
    "async_preconditioning": lambda v: check_async_preconditioning(v),
    "max_staleness": lambda v: check_max_staleness(v),
    "relative_epsilon": lambda v: _check_bool("relative_epsilon", v),
    "allow_custom_step": lambda v: _check_bool("allow_custom_step", v),
}


def check_conversion_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """Validate DASH options given to a trainer integration; None means "keep the value
    mapped from the user's optimizer" and is dropped. Unknown names raise ``TypeError``."""
    unknown = sorted(set(options) - set(_OVERRIDE_CHECKS))
    if unknown:
        raise TypeError(f"unknown DASH option(s) {unknown}; known: {sorted(_OVERRIDE_CHECKS)}")
    return {key: _OVERRIDE_CHECKS[key](value) for key, value in options.items() if value is not None}


def check_async_preconditioning(value: Any) -> bool:
    """``async_preconditioning`` must be a bool (ValueError otherwise, as the option's spec asks)."""
    if not isinstance(value, bool):
        raise ValueError(f"async_preconditioning must be True or False, got {value!r}")
    return value


def check_max_staleness(value: Any) -> int:
    """``max_staleness``: optimizer steps a computed root may wait before it must be used (int >= 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"max_staleness must be an integer >= 1, got {value!r}")
    return int(value)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_params(params: Iterable[Any]) -> None:
    """DASH updates real floating-point dense tensors only."""
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"params must contain tensors, got {type(param).__name__}")
        if param.is_complex():
            raise TypeError("params: complex parameters are not supported by DASH")
        if not param.is_floating_point():
            raise TypeError(f"params: DASH needs floating-point parameters, got {param.dtype}")
        if param.is_sparse:
            raise ValueError("params: sparse parameters are not supported by DASH")
