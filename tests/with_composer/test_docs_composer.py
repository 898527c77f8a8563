"""The documentation's Composer blocks run in the Composer environment: the complete example,
and the llm-foundry YAML built through the entry points llm-foundry reads."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
import yaml
from composer import Trainer
from composer.models import ComposerClassifier
from composer.optim import DecoupledAdamW
from helpers.doc_blocks import all_blocks, run_python
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dash import DASH
from lightning_dash.composer import Dash, DashComposerMonitor

BLOCKS = all_blocks()
COMPOSER_PYTHON = [block for block in BLOCKS if block.lang == "python" and block.marker == "composer"]
YAML = [block for block in BLOCKS if block.lang == "yaml"]
GROUPS = {"algorithms": "llmfoundry_algorithms", "callbacks": "llmfoundry_callbacks"}


def test_the_documentation_has_composer_blocks():
    assert COMPOSER_PYTHON and YAML and any("fsdp_config" in block.code for block in YAML)


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", COMPOSER_PYTHON, ids=lambda block: block.name)
def test_composer_block_runs(block, tmp_path):
    result = run_python(block, tmp_path)
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert result.stdout.split()[0] == "DASH"  # the example prints the optimizer class Composer stepped


def build(config: dict) -> list:
    """The algorithms and callbacks of an llm-foundry YAML, built through the entry points."""
    built = []
    for section, entries in config.items():
        if section not in GROUPS:
            continue
        registered = {point.name: point for point in entry_points(group=GROUPS[section])}
        for name, kwargs in entries.items():
            built.append(registered[name].load()(**kwargs))
    return built


@pytest.mark.parametrize("block", YAML, ids=lambda block: block.name)
def test_llm_foundry_yaml_builds_through_the_entry_points(block):
    built = build(yaml.safe_load(block.code))
    assert any(isinstance(item, Dash) for item in built)
    assert all(isinstance(item, (Dash, DashComposerMonitor)) for item in built)


def fsdp_trainer(config: dict) -> Trainer:
    """Composer's Trainer given what llm-foundry's train gives it for ``config``: the
    ``fsdp_config`` dict as ``parallelism_config["fsdp"]`` and the built algorithms."""
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    model = ComposerClassifier(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 2)), num_classes=2)
    return Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=64),
        max_duration="2ba",
        optimizers=DecoupledAdamW(model.parameters(), lr=1e-3),
        algorithms=build(config),
        parallelism_config={"fsdp": config["fsdp_config"], "tp": None},
        device="cpu",
        progress_bar=False,
    )


@pytest.mark.parametrize("block", [b for b in YAML if "fsdp_config" in b.code], ids=lambda block: block.name)
def test_llm_foundry_fsdp_config_trains_with_fsdp_version_2(block, monkeypatch):
    config = yaml.safe_load(block.code)
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    with pytest.raises(ValueError, match="Dash does not support FSDP1"):
        fsdp_trainer(config)
    monkeypatch.setenv("FSDP_VERSION", "2")
    trainer = fsdp_trainer(config)
    trainer.fit()
    dash = trainer.state.optimizers[0]
    assert isinstance(dash, DASH) and type(dash.distributor).__name__ == "ShardedDistributor"
    assert trainer.state.timestamp.batch.value == 2 and dash.state_bytes() > 0
    trainer.close()
