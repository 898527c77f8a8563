"""The module map of ``docs/development.md`` stays true: generated from the package's files, it lists
every module, each with a docstring that opens with one sentence of its own, sub-packages in import order."""

from __future__ import annotations

import importlib.util
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_dash"
MODULES = sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def _load_generator():
    spec = importlib.util.spec_from_file_location("docs_generated", ROOT / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATED = _load_generator()


def _files_in_map(rendered: str) -> set[Path]:
    """The files a rendered map names, read back from its text: two spaces of indentation per level, a
    name ending in ``/`` for a package (its ``__init__.py``), summaries in a column of their own."""
    lines = rendered.splitlines()
    assert lines[0] == "```text" and lines[-1] == "```"
    column = re.match(r"\S+\s+", lines[1]).end()
    files, folders = set(), []
    for line in lines[1:-1]:
        indent = len(line) - len(line.lstrip())
        if indent >= column:
            continue  # a summary's continuation
        level, name = indent // 2, line.split()[0]
        folders[level:] = []
        if name.endswith("/"):
            folders.append(name[:-1])
            files.add(PACKAGE.parent.joinpath(*folders, "__init__.py"))
        else:
            files.add(PACKAGE.parent.joinpath(*folders, name))
    return files


def test_the_map_lists_every_module_and_nothing_else():
    assert _files_in_map(GENERATED.module_map()) == set(MODULES)


def test_development_page_shows_the_generated_map():
    page = (ROOT / "docs" / "development.md").read_text()
    assert "<!-- generated: module_map -->" in page
    assert GENERATED.module_map() in GENERATED.render(page)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_every_module_opens_with_one_sentence(path):
    summary = GENERATED.module_summary(path)
    assert summary, f"{path.relative_to(ROOT)} has no docstring: open it with one sentence saying what it holds"
    words = GENERATED.plain(summary)
    assert not words[0].islower(), f"{path.relative_to(ROOT)}: the summary should start a sentence: {summary!r}"
    assert summary.endswith("."), f"{path.relative_to(ROOT)}: the summary should be one sentence, ending in '.'"
    second = re.search(r"[.!?]\s+[A-Z`:]", summary)
    assert not second, (
        f"{path.relative_to(ROOT)}: the first paragraph holds more than one sentence ({summary!r}); "
        "leave a blank line after the first"
    )


def test_no_two_modules_share_a_summary():
    owners = defaultdict(list)
    for path in MODULES:
        summary = GENERATED.module_summary(path) or ""
        owners[" ".join(GENERATED.plain(summary).casefold().split())].append(str(path.relative_to(ROOT)))
    shared = {summary: paths for summary, paths in owners.items() if summary and len(paths) > 1}
    assert not shared, f"modules whose docstrings open alike (say what each one holds): {shared}"


@pytest.mark.parametrize(
    "package",
    [PACKAGE, *sorted(path.parent for path in PACKAGE.rglob("*/__init__.py") if "__pycache__" not in path.parts)],
    ids=lambda path: str(path.relative_to(ROOT)),
)
def test_sub_packages_import_only_the_ones_listed_above_them(package):
    order = GENERATED.import_order(package)
    names = [GENERATED.module_name(child / "__init__.py") for child in order]
    for position, child in enumerate(order):
        later = names[position + 1 :]
        upward = {
            f"{path.relative_to(ROOT)} imports {module}"
            for path in child.rglob("*.py")
            for module in GENERATED.imported_modules(path)
            if any(module == name or module.startswith(name + ".") for name in later)
        }
        assert not upward, f"{child.relative_to(ROOT)} imports a sub-package listed after it: {sorted(upward)}"


def test_imports_are_resolved_and_markup_is_dropped():
    path = PACKAGE / "optim" / "roots" / "solve.py"
    assert GENERATED.module_name(path) == "lightning_dash.optim.roots.solve"
    assert GENERATED.module_name(path.with_name("__init__.py")) == "lightning_dash.optim.roots"
    assert GENERATED.plain("A :class:`~a.b.Distributor` over ``torch``, see :mod:`a.b`.") == (
        "A Distributor over torch, see a.b."
    )
