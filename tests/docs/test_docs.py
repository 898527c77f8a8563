"""The README and the documentation stay true: every code block runs (or its commands check out),
the generated option table and signature match the code, and the README stays short."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re

import pytest
import torch
import yaml
from helpers.doc_blocks import DOC_FILES, MARKERS, ROOT, all_blocks, check_command, commands, run_python

from lightning_dash import DASH, DashConfig

BLOCKS = all_blocks()
PYTHON = [block for block in BLOCKS if block.lang == "python"]
SHELL = [block for block in BLOCKS if block.lang == "bash"]
KNOWN_LANGS = {"python", "bash", "yaml", "text"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("docs_generated", ROOT / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_block_has_a_known_language_and_marker():
    assert len(PYTHON) >= 10 and SHELL
    for block in BLOCKS:
        assert block.lang in KNOWN_LANGS, f"{block.name}: no test runs {block.lang!r} blocks"
        assert block.marker is None or block.marker in MARKERS, f"{block.name}: unknown marker {block.marker!r}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", PYTHON, ids=lambda block: block.name)
def test_python_block_runs(block, tmp_path):
    if block.marker == "composer":
        pytest.skip("needs Composer: runs in the Composer lane (tests/with_composer/test_docs_composer.py)")
    if block.marker == "torchtitan":
        pytest.skip("needs torchtitan: runs in the torchtitan lane (tests/with_torchtitan/test_docs_torchtitan.py)")
    if block.marker == "gpu" and not torch.cuda.is_available():
        pytest.skip("marked <!-- docs-test: gpu -->: needs a CUDA device")
    result = run_python(block, tmp_path)
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.mark.parametrize("block", SHELL, ids=lambda block: block.name)
def test_shell_commands_check_out(block):
    for command in commands(block):
        check_command(command)


def test_command_checks_can_fail():
    with pytest.raises(AssertionError, match="make"):
        check_command("make no-such-target")
    with pytest.raises(AssertionError, match="extra"):
        check_command('pip install ".[no_such_extra]"')
    with pytest.raises(AssertionError, match="not on PyPI"):
        check_command('pip install "lightning-dash[lightning]"')
    assert check_command('pip install ".[lightning,composer]"')
    with pytest.raises(AssertionError, match="--no-such-flag"):
        check_command(".venv/bin/python examples/train_char_gpt.py --no-such-flag 3")
    # After a bare --, flags are another script's of the same folder (compare_revisions.py -> step_time.py).
    assert check_command(".venv/bin/python benchmarks/speed/compare_revisions.py --before HEAD -- --suite peers")
    with pytest.raises(AssertionError, match="--no-such-flag"):
        check_command(".venv/bin/python benchmarks/speed/compare_revisions.py --before HEAD -- --no-such-flag")
    with pytest.raises(AssertionError, match="no such script"):
        check_command("python examples/missing.py")
    with pytest.raises(AssertionError, match="no check"):
        check_command("curl https://example.com | sh")


def test_yaml_blocks_parse_and_name_only_dash_options():
    """Full construction runs in the Composer lane; here: the keys are DASH options."""
    options = {field.name for field in dataclasses.fields(DashConfig)}
    for block in (block for block in BLOCKS if block.lang == "yaml"):
        config = yaml.safe_load(block.code)
        assert set(config) <= {"algorithms", "callbacks", "fsdp_config"}, block.name
        for section, entries in config.items():
            if section == "fsdp_config":  # Composer's own options: trained with in the Composer lane
                continue
            for name, kwargs in entries.items():
                assert name in ("dash", "dash_monitor"), f"{block.name}: {name}"
                if name == "dash":
                    assert set(kwargs) <= options, f"{block.name}: {set(kwargs) - options}"


def test_generated_option_table_lists_every_option_with_its_default():
    table = _load_generator().options_table().splitlines()[2:]
    fields = dataclasses.fields(DashConfig)
    assert len(table) == len(fields)
    for row, field in zip(table, fields):
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert cells[0] == f"`{field.name}`"
        assert cells[1] == f"`{field.default!r}`"
        assert (cells[2] == "yes") == field.metadata["per_group"]


def test_generated_signature_matches_the_constructor():
    text = _load_generator().constructor_signature()
    keywords = dict(re.findall(r"^    (\w+)=(.+),$", text, flags=re.M))
    parameters = inspect.signature(DASH.__init__).parameters
    for name in ("lr", "config", "distributor"):
        assert keywords[name] == repr(parameters[name].default)
    for field in dataclasses.fields(DashConfig):
        if field.name != "lr":
            assert keywords[field.name] == repr(field.default), field.name
    assert DASH(
        torch.nn.Linear(2, 2).parameters(), **{k: ast.literal_eval(v) for k, v in keywords.items() if k != "lr"}
    ).config


def test_pages_use_markers_that_the_hook_knows():
    generator = _load_generator()
    for path in DOC_FILES:
        for name in generator.MARKER.findall(path.read_text()):
            assert name in generator.GENERATORS, f"{path.name}: {name}"


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    for path in (ROOT / "docs").rglob("*.md"):
        page = path.relative_to(ROOT / "docs").as_posix()
        assert re.search(rf"^\s+- (.+: )?{re.escape(page)}$", config, re.M), f"{page} is not in mkdocs.yml's nav"


def test_no_page_over_400_lines():
    """A page a reader finishes: a longer one is split by question (as docs/benchmarks/ is)."""
    long = {path.name: n for path in DOC_FILES if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long


def test_readme_is_short():
    assert len((ROOT / "README.md").read_bytes()) <= 10_500
