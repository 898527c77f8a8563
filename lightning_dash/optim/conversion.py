"""Turning an existing first-order optimizer into DASH, keeping its parameter groups.

Trainers build the optimizer a model's code asks for (AdamW, SGD, Composer's
decoupled variants, ...) and attach learning-rate schedulers to its
``param_groups``. :func:`dash_group_settings` maps each group's hyperparameters
onto DASH's, and :meth:`DASH.from_optimizer` builds DASH over the *same* group
dictionaries, so every scheduler that edits ``group["lr"]`` keeps driving it, and logs
what the recipe became (:func:`conversion_summary`).
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import torch

from lightning_dash.optim.config import GROUP_OPTIONS, DashConfig, check_option, check_option_names
from lightning_dash.optim.validation import check_bool, check_number

#: Decay of the Kronecker factors when the source optimizer has none (DASH's default).
DEFAULT_FACTOR_DECAY = 0.95


def _adam_like(group: dict[str, Any], decoupled: bool, factor_decay: float) -> dict[str, Any]:
    beta1, beta2 = group["betas"]
    return {
        "betas": (float(beta1), factor_decay),
        "grafting_beta2": float(beta2),
        "grafting_epsilon": float(group.get("eps", 1e-8)),
        "weight_decay": _decoupled_weight_decay(group, decoupled),
    }


def _decoupled_weight_decay(group: dict[str, Any], composer_style: bool) -> float:
    """DASH applies ``W <- W (1 - lr wd)``; Composer's decoupled optimizers apply
    ``W <- W (1 - wd lr / initial_lr)``, which is the same with ``wd / initial_lr``."""
    decay = float(group.get("weight_decay", 0.0))
    if composer_style and decay:
        return decay / float(group.get("initial_lr", group["lr"]))
    return decay


#: Classes whose own ``step`` DASH reproduces: the supported torch optimizers and
#: Composer's decoupled variants (matched by name: Composer need not be installed).
_SUPPORTED_BASES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop)
_SUPPORTED_NAMES = ("DecoupledAdamW", "DecoupledSGDW")


def check_no_custom_step(optimizer: torch.optim.Optimizer, allow_custom_step: bool) -> None:
    """Refuse to convert a subclass of a supported optimizer that defines its own ``step``:
    its update rule would silently be replaced by DASH's (``allow_custom_step=True``
    converts it anyway, mapping only its hyperparameters)."""
    cls = type(optimizer)
    if allow_custom_step or cls in _SUPPORTED_BASES or cls.__name__ in _SUPPORTED_NAMES:
        return
    base = next((b for b in cls.__mro__ if b in _SUPPORTED_BASES or b.__name__ in _SUPPORTED_NAMES), None)
    if base is not None and cls.step is not base.step:
        raise ValueError(
            f"cannot convert {cls.__name__} to DASH: it overrides {base.__name__}.step, and its update "
            "rule would be lost; pass allow_custom_step=True to convert it anyway (only its "
            "hyperparameters carry over)"
        )


def dash_group_settings(
    optimizer: torch.optim.Optimizer, factor_decay: float = DEFAULT_FACTOR_DECAY, allow_custom_step: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-group DASH settings equivalent to ``optimizer``'s, and optimizer-wide options
    (``grafting``; ``nesterov`` for SGD).

    The lr is kept as it is: grafting gives every preconditioned block the step size of the
    source optimizer's own update, so its tuned lr and schedule carry over (measured on the
    model-family suite, ``benchmarks/races/families.py``).
    Adam/AdamW (and Composer's ``DecoupledAdamW``) graft Adam with their second-moment
    decay and epsilon; SGD (and ``DecoupledSGDW``) grafts SGD with its momentum;
    Adagrad and RMSprop graft themselves. Adam's L2 ``weight_decay`` becomes decoupled
    weight decay. Unsupported classes or options raise ``TypeError``/``ValueError``, and
    so does a subclass with its own ``step`` unless ``allow_custom_step``.
    """
    check_no_custom_step(optimizer, allow_custom_step)
    name = type(optimizer).__name__
    composer_style = name.startswith("Decoupled")
    settings: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        if group.get("maximize", False):
            raise ValueError(f"{name} with maximize=True cannot be converted to DASH")
        if group.get("amsgrad", False):
            raise ValueError(f"{name} with amsgrad=True cannot be converted to DASH")
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            grafting, values = "adam", _adam_like(group, composer_style, factor_decay)
        elif isinstance(optimizer, torch.optim.SGD):
            if group.get("dampening", 0.0):
                raise ValueError(f"{name} with dampening != 0 cannot be converted to DASH")
            grafting = "sgd"
            values = {
                "betas": (float(group.get("momentum", 0.0)), factor_decay),
                "weight_decay": _decoupled_weight_decay(group, composer_style),
            }
        elif isinstance(optimizer, torch.optim.Adagrad):
            grafting = "adagrad"
            values = {
                "betas": (0.0, 1.0),
                "grafting_epsilon": float(group.get("eps", 1e-10)),
                "weight_decay": float(group.get("weight_decay", 0.0)),
            }
        elif isinstance(optimizer, torch.optim.RMSprop):
            grafting = "rmsprop"
            values = {
                "betas": (float(group.get("momentum", 0.0)), factor_decay),
                "grafting_beta2": float(group.get("alpha", 0.99)),
                "grafting_epsilon": float(group.get("eps", 1e-8)),
                "weight_decay": float(group.get("weight_decay", 0.0)),
            }
        else:
            raise TypeError(
                f"cannot convert {name} to DASH: supported are Adam, AdamW, SGD, Adagrad, RMSprop "
                "and Composer's DecoupledAdamW/DecoupledSGDW"
            )
        settings.append(values)
    if grafting == "sgd":
        nesterov = any(bool(group.get("nesterov", False)) for group in optimizer.param_groups)
        return settings, {"grafting": grafting, "nesterov": nesterov}
    return settings, {"grafting": grafting}


def check_conversion_options(factor_decay: Any, allow_custom_step: Any) -> tuple[float, bool]:
    """The conversion options checked: ``factor_decay`` (``betas[1]``) in [0, 1], ``allow_custom_step`` a bool."""
    return check_number("factor_decay", factor_decay, low=0.0, high=1.0), check_bool(
        "allow_custom_step", allow_custom_step
    )


def converted_groups(
    optimizer: torch.optim.Optimizer, overrides: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``optimizer``'s own group dictionaries, updated to DASH settings, and DASH's
    optimizer-wide options (see ``DASH.from_optimizer``).

    ``overrides`` holds DASH options (per-group ones are written into every group) and
    the conversion options ``factor_decay`` (``betas[1]``) and ``allow_custom_step``.
    """
    overrides = dict(overrides)
    factor_decay, allow_custom_step = check_conversion_options(
        overrides.pop("factor_decay", DEFAULT_FACTOR_DECAY), overrides.pop("allow_custom_step", False)
    )
    group_settings, options = dash_group_settings(optimizer, factor_decay, allow_custom_step)
    check_option_names(overrides)
    per_group = {key: check_option(key, overrides.pop(key)) for key in list(overrides) if key in GROUP_OPTIONS}
    for group, settings in zip(optimizer.param_groups, group_settings):
        group.update(settings)
        group.update(per_group)
    return optimizer.param_groups, {**options, **overrides}


def _per_group(groups: list[dict[str, Any]], read: Any) -> str:
    """One group setting as text: its value, or each group's where they differ."""
    values = list(dict.fromkeys(f"{read(group):g}" for group in groups))
    return values[0] if len(values) == 1 else f"{' / '.join(values)} per group"


_log = logging.getLogger("lightning_dash")
Converted = TypeVar("Converted")


def announced(dash: Converted, source: torch.optim.Optimizer) -> Converted:
    """``dash`` (a DASH converted from ``source``), after logging at INFO level what the recipe became."""
    _log.info(conversion_summary(type(source).__name__, dash.config, dash.param_groups))
    return dash


def conversion_summary(source: str, config: DashConfig, groups: list[dict[str, Any]]) -> str:
    """One line saying what ``source`` (the converted optimizer's class name) became: the
    grafting, the recipe's lr, momentum and weight decay as DASH applies them, and the
    options that decide which blocks Shampoo preconditions and how often."""
    precondition = config.precondition if isinstance(config.precondition, str) else "custom"
    nesterov = ", nesterov" if config.nesterov else ""
    return (
        f"DASH from {source}: grafting {config.grafting}, lr {_per_group(groups, lambda g: g['lr'])} (the recipe's), "
        f"momentum {_per_group(groups, lambda g: g['betas'][0])}{nesterov}, decoupled weight decay "
        f"{_per_group(groups, lambda g: g['weight_decay'])}; precondition {precondition}, "
        f"block_size {config.block_size}, precondition_frequency "
        f"{_per_group(groups, lambda g: g['precondition_frequency'])}, lr_scale {config.lr_scale:g}"
    )
