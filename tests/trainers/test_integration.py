"""The trainer-independent layer both integrations use: option resolution, conversion, metrics."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from helpers.option_values import NON_DEFAULT, assert_carries, user_optimizer

from lightning_dash import DASH, DashConfig
from lightning_dash.distributed.gradient_sync import CommStats
from lightning_dash.integration import ConversionOptions, dash_metrics
from lightning_dash.optim.config import OPTION_NAMES


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_every_option_by_keyword_or_config_reaches_the_converted_optimizer(name):
    for conversion in (
        ConversionOptions.build(**{name: NON_DEFAULT[name]}),
        ConversionOptions.build(DashConfig(**{name: NON_DEFAULT[name]})),
    ):
        assert dict(conversion.overrides) == {name: NON_DEFAULT[name]}
        assert_carries(conversion.convert(user_optimizer()), name, NON_DEFAULT[name])


def test_overrides_are_the_changed_config_fields_then_the_given_keywords():
    config = DashConfig(block_size=64, precondition_frequency=10, grafting_beta2=0.5)  # frequency: the default
    conversion = ConversionOptions.build(config, block_size=32, epsilon=1e-4, grafting=None)
    assert dict(conversion.overrides) == {"block_size": 32, "grafting_beta2": 0.5, "epsilon": 1e-4}
    dash = conversion.convert(user_optimizer())
    # Not overridden: mapped from AdamW (grafting, weight decay, momentum) or DASH's default.
    assert dash.grafting == "adam" and dash.param_groups[0]["weight_decay"] == 0.01
    assert dash.param_groups[0]["betas"] == (0.9, 0.95) and dash.param_groups[1]["lr"] == 0.02
    assert dash.block_size == 32 and dash.param_groups[1]["grafting_beta2"] == 0.5


def test_a_config_can_set_an_option_to_none_and_values_are_normalised():
    conversion = ConversionOptions.build(
        DashConfig(max_consecutive_root_failures=None), matmul_dtype=torch.float16, betas=[0.8, 0.9]
    )
    assert dict(conversion.overrides) == {
        "max_consecutive_root_failures": None,
        "matmul_dtype": "float16",
        "betas": (0.8, 0.9),
    }
    assert conversion.convert(user_optimizer()).max_consecutive_root_failures is None


def test_conversion_options_apply_and_conflict_with_betas():
    conversion = ConversionOptions.build(factor_decay=0.5, communication_dtype="bf16")
    assert conversion.communication_dtype is torch.bfloat16
    assert conversion.convert(user_optimizer()).param_groups[1]["betas"] == (0.9, 0.5)
    with pytest.raises(ValueError, match="factor_decay"):
        ConversionOptions.build(factor_decay=0.5, betas=(0.9, 0.9))

    class CustomAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    parameters = user_optimizer().param_groups[0]["params"]
    with pytest.raises(ValueError, match="allow_custom_step"):
        ConversionOptions.build().convert(CustomAdamW(parameters))
    assert isinstance(ConversionOptions.build(allow_custom_step=True).convert(CustomAdamW(parameters)), DASH)


def test_a_dash_optimizer_is_kept_and_ignored_options_are_named():
    dash = DASH(user_optimizer().param_groups[0]["params"])
    assert ConversionOptions.build().convert(dash) is dash
    with pytest.warns(UserWarning, match=r"\['block_size'\]"):
        assert ConversionOptions.build(block_size=8).convert(dash) is dash
    assert dash.block_size == 1024


@pytest.mark.parametrize(
    ("arguments", "error", "name"),
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"lr": -1.0}, ValueError, "lr"),
        ({"betas": (0.9, 1.5)}, ValueError, "betas"),
        ({"grafting": "lion"}, ValueError, "grafting"),
        ({"precondition_frequency": 1.5}, ValueError, "precondition_frequency"),
        ({"nesterov": "yes"}, TypeError, "nesterov"),
        ({"max_staleness": 0}, ValueError, "max_staleness"),
        ({"factor_decay": 2.0}, ValueError, "factor_decay"),
        ({"allow_custom_step": "yes"}, TypeError, "allow_custom_step"),
        ({"communication_dtype": torch.int8}, ValueError, "communication_dtype"),
        ({"micro_group_mib": 0}, ValueError, "micro_group_mib"),
        ({"config": {"block_size": 8}}, TypeError, "config"),
        ({"blocksize": 8}, TypeError, r"blocksize.*known:.*'block_size'"),
    ],
)
def test_bad_arguments_name_the_option(arguments, error, name):
    with pytest.raises(error, match=name):
        ConversionOptions.build(**arguments)


def test_conversion_options_are_frozen_and_checked_when_constructed_directly():
    conversion = ConversionOptions({"block_size": 16}, micro_group_mib=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        conversion.factor_decay = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        conversion.overrides["block_size"] = 8  # type: ignore[index]
    with pytest.raises(ValueError, match="block_size"):
        ConversionOptions({"block_size": 0})
    # Spawned ranks receive them pickled.
    assert pickle.loads(pickle.dumps(conversion)) == conversion == copy.deepcopy(conversion)


def test_a_micro_group_budget_is_refused_where_parameters_are_whole():
    with pytest.raises(ValueError, match="micro_group_mib applies where parameters are sharded"):
        ConversionOptions.build(micro_group_mib=64).convert(user_optimizer())


def stepped(**options) -> DASH:
    optimizer = ConversionOptions.build(block_size=8, precondition_frequency=2, **options).convert(user_optimizer())
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def test_metrics_of_a_step_whose_newton_roots_have_a_residual():
    optimizer = stepped(inverse_root_method="newton_db")
    metrics = dash_metrics(optimizer, 2.5)
    residual = metrics.pop("dash/root_residual")
    assert 0.0 <= residual < 1.0
    assert metrics == {
        "dash/optimizer_step_ms": 2.5,
        "dash/root_failures": 0.0,
        "dash/nonfinite_grad_skips": 0.0,
        "dash/nonfinite_update_skips": 0.0,
        "dash/ownership_balance": 1.0,
        "dash/state_bytes": float(optimizer.state_bytes()),
    }
    assert metrics["dash/state_bytes"] > 0


def test_metrics_add_async_counters_and_gradient_traffic_only_when_present():
    optimizer = stepped(async_preconditioning=True)  # eigh roots: no residual
    stats = CommStats()
    assert set(dash_metrics(optimizer, 1.0, stats)) == {
        "dash/optimizer_step_ms",
        "dash/root_failures",
        "dash/nonfinite_grad_skips",
        "dash/nonfinite_update_skips",
        "dash/ownership_balance",
        "dash/state_bytes",
        "dash/async_roots_hidden",
        "dash/async_roots_waited",
        "dash/async_wait_ms",
    }
    stats.record(300.0, 100.0)
    stats.steps = 2
    metrics = dash_metrics(optimizer, 1.0, stats)
    assert metrics["dash/grad_sync_bytes_sent_per_step"] == 150.0
    assert metrics["dash/grad_sync_bytes_received_per_step"] == 50.0
