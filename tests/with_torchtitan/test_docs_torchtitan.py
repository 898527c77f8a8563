"""The documentation's torchtitan blocks run where torchtitan is installed."""

from __future__ import annotations

import pytest
from helpers.doc_blocks import all_blocks, run_python

TITAN_PYTHON = [block for block in all_blocks() if block.lang == "python" and block.marker == "torchtitan"]


def test_the_documentation_has_torchtitan_blocks():
    assert TITAN_PYTHON


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", TITAN_PYTHON, ids=lambda block: block.name)
def test_torchtitan_block_runs(block, tmp_path):
    result = run_python(block, tmp_path)
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
