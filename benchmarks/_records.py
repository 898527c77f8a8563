"""Tables written as text: a record's fields, and a printed table's columns, declared once each.

A record table has one line per field: its name, its type (``str``, ``int``, ``float``,
``bool``, ``tuple``; a trailing ``?`` allows ``None``) and then either ``= default`` (a
Python literal) or the format its table cell takes (``{:.2f}``; ``{}`` when left out).
:func:`record_type` makes the frozen dataclass of those fields, :func:`record_cells` the
table of its records. A column table has one line per printed column: its header, two or
more spaces, and the template its cell is filled from (``str.format_map`` of a row).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from common import format_columns, write_json

TYPES: dict[str, Any] = {"str": str, "int": int, "float": float, "bool": bool, "tuple": tuple}
#: The default of a field that has none (``dataclasses.MISSING`` cannot be a dataclass default).
REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class Field:
    """One line of a record table."""

    name: str
    type: Any
    default: Any = REQUIRED
    spec: str = "{}"


def parse_fields(table: str) -> list[Field]:
    """The fields of a record table, in order."""
    fields = []
    for line in filter(None, (line.strip() for line in table.splitlines())):
        name, type_name, *rest = line.split(None, 2)
        kind = TYPES[type_name.rstrip("?")]
        kind = kind | None if type_name.endswith("?") else kind
        text = rest[0] if rest else ""
        if text.startswith("="):
            fields.append(Field(name, kind, default=ast.literal_eval(text[1:].strip())))
        else:
            fields.append(Field(name, kind, spec=text or "{}"))
    return fields


def record_type(name: str, doc: str, table: str) -> type:
    """The frozen dataclass ``name`` of the fields of ``table``, documented by ``doc``; its
    ``FIELDS`` are the parsed lines."""
    fields = parse_fields(table)
    specs = [
        (f.name, f.type) if f.default is REQUIRED else (f.name, f.type, dataclasses.field(default=f.default))
        for f in fields
    ]
    module = sys._getframe(1).f_globals["__name__"]
    namespace = {"__doc__": doc, "__module__": module, "FIELDS": tuple(fields)}
    return dataclasses.make_dataclass(name, specs, frozen=True, namespace=namespace)


def record_cells(records: Sequence[Any]) -> tuple[list[str], list[list[str]]]:
    """Header (the field names) and rows of ``records`` (of one :func:`record_type`): each
    value in its field's format, ``-`` for ``None``."""
    fields = type(records[0]).FIELDS
    rows = [
        ["-" if value is None else field.spec.format(value) for field, value in zip(fields, dataclasses.astuple(r))]
        for r in records
    ]
    return [field.name for field in fields], rows


class Quantities(Mapping[str, Any]):
    """A row as column templates read it: ``a/b`` is ``a`` over ``b``, a unit (``KiB``, ``MiB``,
    ``GiB``) or another key of the row."""

    UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

    def __init__(self, row: Mapping[str, Any]) -> None:
        self.row = row

    def __getitem__(self, key: str) -> Any:
        name, _, divisor = key.partition("/")
        if not divisor:
            return self.row[name]
        return self.row[name] / (self.UNITS[divisor] if divisor in self.UNITS else self.row[divisor])

    def __iter__(self) -> Iterator[str]:
        return iter(self.row)

    def __len__(self) -> int:
        return len(self.row)


def columns(table: str) -> list[tuple[str, str]]:
    """The ``(header, template)`` pairs of a column table."""
    return [tuple(re.split(r"\s{2,}", line.strip(), maxsplit=1)) for line in table.splitlines() if line.strip()]  # type: ignore[misc]


def column_cells(table: str, rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of a column table filled from ``rows`` (each read as :class:`Quantities`)."""
    spec = columns(table)
    cells = [[template.format_map(Quantities(row)) for _, template in spec] for row in rows]
    return [header for header, _ in spec], cells


def report_records(records: Sequence[Any], path: Path) -> Path:
    """Print the table of ``records`` (:func:`record_cells`) and write them to ``path`` as a JSON list."""
    print(format_columns(*record_cells(records)))
    written = write_json(path, list(records))
    print(f"\nwrote {written}")
    return written
