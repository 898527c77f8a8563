"""A valid, non-default value of every DASH option, and where a converted DASH shows it.

Shared by the tests of the trainer integrations (Lightning strategy, LightningCLI,
Composer algorithm): each passes every option and checks the converted optimizer
carries it, through DASH's public attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_dash import DASH
from lightning_dash.optim.config import GROUP_OPTIONS, OPTION_NAMES

#: Differs from DashConfig's default and from what an AdamW(lr=0.01) maps to.
NON_DEFAULT: dict[str, Any] = {
    "lr": 0.125,
    "betas": (0.5, 0.75),
    "epsilon": 1e-2,
    "relative_epsilon": False,
    "weight_decay": 0.25,
    "lr_scale": 3.0,
    "block_size": 7,
    "precondition": "hidden",
    "split_rows": (("layer", 2),),
    "precondition_frequency": 5,
    "start_preconditioning_step": 3,
    "inverse_root_method": "coupled_newton",
    "root_order": 4,
    "matrix_scaling": "frobenius",
    "eigh_dtype": "float32",
    "matmul_dtype": "bfloat16",
    "matmul_precision": "tf32",
    "grafting": "rmsprop",
    "grafting_norm": "spectral",
    "grafting_beta2": 0.5,
    "grafting_epsilon": 1e-5,
    "shampoo_blend": 0.5,
    "nesterov": False,
    "bias_correction": False,
    "factor_bias_correction": False,
    "root_schedule": "multiples",
    "decay_vectors": False,
    "root_iterations": 6,
    "chebyshev_degree": 12,
    "max_consecutive_root_failures": 7,
    "async_preconditioning": True,
    "max_staleness": 2,
    "compile": True,
}

#: How each optimizer-wide option reads back from a DASH optimizer's public attributes.
_OPTIMIZER_WIDE: dict[str, Callable[[DASH], Any]] = {
    "relative_epsilon": lambda dash: dash.root_settings.relative_epsilon,
    "block_size": lambda dash: dash.block_size,
    "lr_scale": lambda dash: dash.lr_scale,
    "precondition": lambda dash: dash.precondition,
    "split_rows": lambda dash: dash.split_rows,
    "inverse_root_method": lambda dash: dash.root_settings.method,
    "root_order": lambda dash: dash.root_settings.root_order,
    "matrix_scaling": lambda dash: dash.root_settings.scaling,
    "eigh_dtype": lambda dash: str(dash.root_settings.eigh_dtype).removeprefix("torch."),
    "matmul_dtype": lambda dash: str(dash.root_settings.matmul_dtype).removeprefix("torch."),
    "matmul_precision": lambda dash: dash.matmul_precision,
    "grafting": lambda dash: dash.grafting,
    "grafting_norm": lambda dash: dash.config.grafting_norm,
    "nesterov": lambda dash: dash.nesterov,
    "bias_correction": lambda dash: dash.bias_correction,
    "factor_bias_correction": lambda dash: dash.config.factor_bias_correction,
    "root_schedule": lambda dash: dash.config.root_schedule,
    "decay_vectors": lambda dash: dash.config.decay_vectors,
    "root_iterations": lambda dash: dash.root_settings.iterations,
    "chebyshev_degree": lambda dash: dash.root_settings.chebyshev_degree,
    "max_consecutive_root_failures": lambda dash: dash.max_consecutive_root_failures,
    "async_preconditioning": lambda dash: dash.async_preconditioning,
    "max_staleness": lambda dash: dash.max_staleness,
    "compile": lambda dash: dash.compile,
}

assert set(NON_DEFAULT) == set(OPTION_NAMES), "add the new option to NON_DEFAULT"
assert set(_OPTIMIZER_WIDE) == set(OPTION_NAMES) - set(GROUP_OPTIONS), "add the new option to _OPTIMIZER_WIDE"


def assert_carries(dash: DASH, name: str, value: Any) -> None:
    """``dash`` has option ``name`` at ``value``: in every parameter group for a per-group option."""
    if name in GROUP_OPTIONS:
        assert len(dash.param_groups) > 1
        assert [group[name] for group in dash.param_groups] == [value] * len(dash.param_groups), name
    else:
        assert _OPTIMIZER_WIDE[name](dash) == value, name


def user_optimizer() -> torch.optim.Optimizer:
    """AdamW over two parameter groups, as a model's ``configure_optimizers`` would build it."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
    return torch.optim.AdamW(
        [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.02}],
        lr=0.01,
        betas=(0.9, 0.99),
        weight_decay=0.01,
    )
