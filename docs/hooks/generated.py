"""MkDocs hook: pages say ``<!-- generated: NAME -->`` and get text built from the code.

The option table and the constructor signature come from :class:`lightning_dash.DashConfig`,
the one list of options, so the documentation cannot drift from it. ``tests/docs/test_docs.py``
renders the same text and checks it against ``DashConfig``.

The module map (``module_map``) comes from the package's files: every module and package of
``lightning_dash/`` with the summary of its docstring (its first paragraph), sub-packages in the
order of their imports. ``tests/docs/test_module_map.py`` checks it lists every module and that the
summaries are sentences, one per module. ``python docs/hooks/generated.py module_map`` prints it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from lightning_dash import DASH, DashConfig

MARKER = re.compile(r"<!-- generated: ([a-z_]+) -->")
#: The package the module map describes.
PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dash"
#: Width of the module map's lines (names, then their wrapped summaries).
MAP_WIDTH = 118


def _value(value: Any) -> str:
    return f"`{value!r}`"


def options_table() -> str:
    """One row per option: name, default, whether it is per parameter group, meaning."""
    rows = ["| option | default | per group | meaning |", "| --- | --- | --- | --- |"]
    for spec in dataclasses.fields(DashConfig):
        per_group = "yes" if spec.metadata["per_group"] else ""
        meaning = spec.metadata["doc"].replace("|", "\\|")
        rows.append(f"| `{spec.name}` | {_value(spec.default)} | {per_group} | {meaning} |")
    return "\n".join(rows)


def constructor_signature() -> str:
    """``DASH(...)`` with every keyword it accepts and its default, as a Python block."""
    parameters = inspect.signature(DASH.__init__).parameters
    named = [name for name in parameters if name not in ("self", "options")]
    lines = ["DASH("]
    for name in named:
        parameter = parameters[name]
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and lines[-1] != "    *,":
            lines.append("    *,")
        default = "" if parameter.default is inspect.Parameter.empty else f"={parameter.default!r}"
        lines.append(f"    {name}{default},")
    lines.append("    # every DashConfig option, as a keyword (these are the defaults):")
    for spec in dataclasses.fields(DashConfig):
        if spec.name != "lr":
            lines.append(f"    {spec.name}={spec.default!r},")
    lines.append(")")
    return "```python\n" + "\n".join(lines) + "\n```"


def module_summary(path: Path) -> str | None:
    """The first paragraph of the module docstring of ``path``, on one line (None without a docstring)."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    if not docstring or not docstring.strip():
        return None
    return " ".join(docstring.strip().split("\n\n")[0].split())


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: code as plain words, a role's target as written
    (``:class:`~a.b.C``` as ``C``)."""
    text = re.sub(
        r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rpartition(".")[2] if "`~" in m.group(0) else m.group(1), text
    )
    return re.sub(r"``(.+?)``|`(.+?)`", lambda m: m.group(1) or m.group(2), text)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports included); relative imports resolved."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            found.add(".".join(part for part in (base, node.module or "") if part))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def module_name(path: Path) -> str:
    """``lightning_dash/optim/__init__.py`` -> ``lightning_dash.optim``; ``.../config.py`` -> ``....config``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sub_packages(package: Path) -> list[Path]:
    return sorted(child for child in package.iterdir() if (child / "__init__.py").is_file())


def import_order(package: Path) -> list[Path]:
    """The sub-packages of ``package`` by import depth: those importing no sibling first, then those importing
    only ones already listed, and so on; alphabetical within a depth. A cycle is listed alphabetically last."""
    children = sub_packages(package)
    names = {module_name(child / "__init__.py"): child for child in children}
    uses = {
        child: {
            names[prefix]
            for path in child.rglob("*.py")
            for module in imported_modules(path)
            for prefix in names
            if (module == prefix or module.startswith(prefix + ".")) and names[prefix] != child
        }
        for child in children
    }
    depth: dict[Path, int] = {}
    while len(depth) < len(children):
        ready = [child for child in children if child not in depth and uses[child] <= depth.keys()]
        for child in ready:
            depth[child] = 1 + max((depth[used] for used in uses[child]), default=-1)
        if not ready:  # a cycle: its alphabetically first member goes after everything listed so far
            first = next(child for child in children if child not in depth)
            depth[first] = 1 + max(depth.values(), default=-1)
    return sorted(children, key=lambda child: (depth[child], child.name))


def module_map_entries(package: Path = PACKAGE, level: int = 0) -> list[tuple[int, str, Path]]:
    """``(level, name, file)`` per line of the map: the package (its ``__init__.py``), its modules, its
    sub-packages in :func:`import_order`, each in turn."""
    entries = [(level, package.name + "/", package / "__init__.py")]
    modules = sorted(path for path in package.glob("*.py") if path.name != "__init__.py")
    entries += [(level + 1, path.name, path) for path in modules]
    for child in import_order(package):
        entries += module_map_entries(child, level + 1)
    return entries


def module_map() -> str:
    """The package as a tree: each module and package with the summary of its docstring, as a text block."""
    entries = module_map_entries()
    column = max(2 * level + len(name) for level, name, _ in entries) + 2
    lines = []
    for level, name, path in entries:
        summary = module_summary(path)
        text = plain(summary) if summary else "(no docstring)"
        wrapped = textwrap.wrap(text, MAP_WIDTH - column, break_on_hyphens=False) or [""]
        lines.append(f"{'  ' * level}{name}".ljust(column) + wrapped[0])
        lines += [" " * column + line for line in wrapped[1:]]
    return "```text\n" + "\n".join(lines) + "\n```"


GENERATORS = {"options": options_table, "signature": constructor_signature, "module_map": module_map}


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated text."""
    return MARKER.sub(lambda match: GENERATORS[match.group(1)](), markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return render(markdown)


if __name__ == "__main__":  # e.g. python docs/hooks/generated.py module_map
    for name in sys.argv[1:] or sorted(GENERATORS):
        print(GENERATORS[name]())
