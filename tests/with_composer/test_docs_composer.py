"""The documentation's Composer blocks run in the Composer environment: the complete example,
and the llm-foundry YAML built through the entry points llm-foundry reads."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import yaml
from helpers.doc_blocks import all_blocks, run_python

from lightning_dash.composer import Dash, DashComposerMonitor

BLOCKS = all_blocks()
COMPOSER_PYTHON = [block for block in BLOCKS if block.lang == "python" and block.marker == "composer"]
YAML = [block for block in BLOCKS if block.lang == "yaml"]
GROUPS = {"algorithms": "llmfoundry_algorithms", "callbacks": "llmfoundry_callbacks"}


def test_the_documentation_has_composer_blocks():
    assert COMPOSER_PYTHON and YAML


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", COMPOSER_PYTHON, ids=lambda block: block.name)
def test_composer_block_runs(block, tmp_path):
    result = run_python(block, tmp_path)
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert result.stdout.split()[0] == "DASH"  # the example prints the optimizer class Composer stepped


@pytest.mark.parametrize("block", YAML, ids=lambda block: block.name)
def test_llm_foundry_yaml_builds_through_the_entry_points(block):
    built = []
    for section, entries in yaml.safe_load(block.code).items():
        registered = {point.name: point for point in entry_points(group=GROUPS[section])}
        for name, kwargs in entries.items():
            built.append(registered[name].load()(**kwargs))
    assert any(isinstance(item, Dash) for item in built)
    assert all(isinstance(item, (Dash, DashComposerMonitor)) for item in built)
