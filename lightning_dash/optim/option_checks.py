"""What each DASH option accepts: the checks :class:`~lightning_dash.optim.config.DashConfig` runs on its
values, each raising ``ValueError`` (``TypeError`` for a wrong type) that names the option."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_dash.optim.validation import check_choice, check_int, check_matmul_dtype, check_number, dtype_name


def optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else check(name, value)


def positive(name: str, value: Any) -> float:
    return check_number(name, value, low=0.0, low_open=True)


def step_count(meaning: str = "") -> Callable[[str, Any], int]:
    """A check that raises ValueError for every value that is not an integer >= 1 (a bool, a float,
    a string such as "auto", 0), the message naming the option and, if given, what it counts."""

    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1{meaning}, got {value!r}")
        return value

    return check


def non_negative(name: str, value: Any) -> float:
    return check_number(name, value, low=0.0)


def unit_open(name: str, value: Any) -> float:
    return check_number(name, value, low=0.0, high=1.0, high_open=True)


def unit(name: str, value: Any) -> float:
    return check_number(name, value, low=0.0, high=1.0)


def at_least(low: int) -> Callable[[str, Any], int]:
    return lambda name, value: check_int(name, value, low=low)


def one_of(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    return lambda name, value: check_choice(name, value, choices)


#: The inverse-root orders :attr:`~lightning_dash.optim.config.DashConfig.root_order` takes.
ROOT_ORDERS = (2, 4)


def root_order(name: str, value: Any) -> int:
    # The Newton solvers take p-th roots for p a power of two; 2 and 4 are the ones that make sense.
    if isinstance(value, bool) or value not in ROOT_ORDERS:
        raise ValueError(f"{name} must be one of {ROOT_ORDERS}, got {value!r}")
    return int(value)


def matmul_dtype(name: str, value: Any) -> str:
    return dtype_name(check_matmul_dtype(value, name))


#: The dtypes :attr:`~lightning_dash.optim.config.DashConfig.eigh_dtype` takes.
EIGH_DTYPES = ("float32", "float64")


def eigh_dtype(name: str, value: Any) -> str:
    if isinstance(value, torch.dtype):
        value = dtype_name(value)
    return check_choice(name, value, EIGH_DTYPES)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value
