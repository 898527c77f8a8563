"""Argument checks shared by the optimizer and its trainer integrations.

Every check raises ``ValueError`` (or ``TypeError`` for wrong types) with the
argument's name in the message, so a bad configuration fails at construction
rather than as a NaN many steps later.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lightning_dash.optim.roots.common import MATMUL_DTYPES

_DTYPE_ALIASES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def did_you_mean(unknown: Sequence[str], known: Iterable[str]) -> str:
    """The closest of ``known`` to each of the ``unknown`` keywords where one is close
    (:func:`difflib.get_close_matches`), as an error message continues: ``"; did you mean 'block_size'?"``,
    ``"; did you mean 'block_size' for 'block_sise', 'lr' for 'lrr'?"``, or ``""`` where none is close."""
    known = sorted(known)
    close = {name: match[0] for name in unknown if (match := difflib.get_close_matches(name, known, n=1))}
    if len(unknown) == 1 and close:
        return f"; did you mean {close[unknown[0]]!r}?"
    if close:
        return "; did you mean " + ", ".join(f"{match!r} for {name!r}" for name, match in close.items()) + "?"
    return ""


def check_number(
    name: str, value: Any, *, low: float, high: float | None = None, low_open: bool = False, high_open: bool = False
) -> float:
    """Check ``low <(=) value <(=) high`` for a real number and return it as float; with no
    ``high`` the number must be finite (``inf`` is refused like any value out of range)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value == math.inf if high is None else (value >= high if high_open else value > high)
    if too_low or too_high or value != value:
        left = "(" if low_open else "["
        right = ")" if high_open or high is None else "]"
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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_iterable_params(params: Any) -> Iterable[Any]:
    """``params`` if it can be iterated (over tensors or parameter groups), else ``TypeError`` naming it."""
    if not isinstance(params, Iterable):
        raise TypeError(f"params must be an iterable of tensors or parameter groups, got {type(params).__name__}")
    return params


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
