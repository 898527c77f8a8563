"""MkDocs hook: pages say ``<!-- generated: NAME -->`` and get text built from the code.

The option table and the constructor signature come from :class:`lightning_dash.DashConfig`,
the one list of options, so the documentation cannot drift from it. ``tests/test_docs.py``
renders the same text and checks it against ``DashConfig``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from lightning_dash import DASH, DashConfig

MARKER = re.compile(r"<!-- generated: ([a-z_]+) -->")


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


GENERATORS = {"options": options_table, "signature": constructor_signature}


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated text."""
    return MARKER.sub(lambda match: GENERATORS[match.group(1)](), markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return render(markdown)
