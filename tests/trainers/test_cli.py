"""LightningCLI sets every DASH option of ``DashStrategy``, from a YAML config or from flags.

Needs ``jsonargparse[signatures]`` (Lightning's CLI dependency, in the ``dev`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.option_values import NON_DEFAULT, assert_carries, user_optimizer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_dash import DashStrategy
from lightning_dash.optim.config import OPTION_NAMES


@pytest.fixture(autouse=True)
def program_name_only(monkeypatch):
    """LightningCLI reads ``args``; pytest's own command line must not look like CLI arguments."""
    monkeypatch.setattr(sys, "argv", ["train.py"])


def strategy_from_cli(args: list[str]) -> DashStrategy:
    """The strategy of the Trainer a real LightningCLI builds from ``args`` (nothing is run)."""
    cli = LightningCLI(
        BoringModel,
        run=False,
        args=args,
        save_config_callback=None,
        trainer_defaults={"accelerator": "cpu", "devices": 1, "logger": False},
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DashStrategy)
    return strategy


def yaml_file(path: Path, init_args: dict[str, Any]) -> list[str]:
    """``--config`` of a YAML file choosing DashStrategy with ``init_args``."""
    strategy = {"class_path": "lightning_dash.DashStrategy", "init_args": init_args}
    path.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    return ["--config", str(path)]


def yaml_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("place", ["config", "keyword"])
def test_yaml_sets_every_option_under_config_or_as_keyword(tmp_path, name, place):
    option = {name: yaml_value(NON_DEFAULT[name])}
    strategy = strategy_from_cli(yaml_file(tmp_path / "cli.yaml", {"config": option} if place == "config" else option))
    assert dict(strategy.conversion.overrides) == {name: NON_DEFAULT[name]}
    assert_carries(strategy.conversion.convert(user_optimizer()), name, NON_DEFAULT[name])


def test_flags_set_every_option_and_config_can_set_none(tmp_path):
    keyword_flags = [
        f"--trainer.strategy.{name}={value if isinstance(value, str) else json.dumps(value)}"
        for name, value in NON_DEFAULT.items()
        if name != "max_consecutive_root_failures"
    ]
    args = [
        "--trainer.strategy=lightning_dash.DashStrategy",
        *keyword_flags,
        # A dotted flag cannot give a nested option null (jsonargparse 4.53 passes it on as the
        # string "None"); the whole config as one value can.
        '--trainer.strategy.config={"max_consecutive_root_failures": null, "block_size": 64}',
        "--trainer.strategy.start_method=spawn",
    ]
    strategy = strategy_from_cli(args)
    expected = {**NON_DEFAULT, "max_consecutive_root_failures": None}
    assert dict(strategy.conversion.overrides) == expected  # block_size: the keyword wins over config
    dash = strategy.conversion.convert(user_optimizer())
    for name, value in expected.items():
        assert_carries(dash, name, value)


def test_a_bad_value_is_refused_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match="chebyshev_degree must be >= 2"):
        strategy_from_cli(yaml_file(tmp_path / "bad.yaml", {"config": {"chebyshev_degree": 1}}))
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        strategy_from_cli(yaml_file(tmp_path / "bad.yaml", {"block_size": 0}))
