"""The project's files speak of the project: no words about how it was developed (work sessions,
tickets, assistants, notes to self) in the documentation, the READMEs or the source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Where a reader meets prose: the pages, every README, the changelog, and the docstrings and comments
#: of the package, the benchmarks and the examples (read whole: their code uses none of these words).
FILES = sorted(
    {
        *ROOT.glob("*.md"),
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "benchmarks").rglob("*.md"),
        *(ROOT / "lightning_dash").rglob("*.md"),
        *(ROOT / "lightning_dash").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        *(ROOT / "examples").rglob("*.py"),
    }
)
#: Phrases that describe the work on the project rather than the project.
INTERNAL = [
    re.compile(r"\bsessions?\b", re.IGNORECASE),
    re.compile(r"\bsub-?agents?\b|\bhelper agents?\b|\bthe agent\b", re.IGNORECASE),
    re.compile(r"\bthe brief\b|\bCEO\b|\bticket\b", re.IGNORECASE),
    re.compile(r"\b[Ii]ssue (?:#)?\d+\b"),
    re.compile(r"\b(?:TODO|FIXME|XXX)\b"),
]


def internal_phrases(text: str) -> list[str]:
    """The internal phrases of ``text``, each with its line number."""
    return [
        f"{number}: {match.group(0)!r}"
        for number, line in enumerate(text.splitlines(), 1)
        for pattern in INTERNAL
        for match in pattern.finditer(line)
    ]


def test_the_scan_finds_internal_wording():
    text = "Measured this session.\nSee issue 48.\n# TODO: later\nA todo list and a sessionless run."
    assert [found.split(": ", 1)[1] for found in internal_phrases(text)] == ["'session'", "'issue 48'", "'TODO'"]


@pytest.mark.parametrize("path", FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_internal_wording(path):
    assert not internal_phrases(path.read_text()), internal_phrases(path.read_text())
