"""The code blocks of the README and the documentation, and how the tests run each kind.

A block is a fenced code block. The line right before its fence (skipping snippet
markers) may say how the tests treat it:

- ``<!-- docs-test: gpu -->``: needs a CUDA device; skipped without one.
- ``<!-- docs-test: composer -->``: needs Composer; runs in the Composer lane only.
- ``<!-- docs-test: torchtitan -->``: needs torchtitan; runs in the torchtitan lane only.

Python blocks are complete programs and run as they are, each in a fresh process in an
empty directory. Shell blocks are checked command by command (see :func:`check_command`).
YAML blocks are llm-foundry configuration and are built in the Composer lane. Text blocks
are output and are not run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The README, the documentation pages and the Composer method card shipped in the package.
DOC_FILES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "lightning_dash" / "composer" / "dash" / "README.md",
]

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"<!-- docs-test: (?P<marker>[\w-]+) -->")
SNIPPET_MARKER = re.compile(r"<!-- --8<-- \[(start|end):[\w-]+\] -->")
MARKERS = {"gpu", "composer", "torchtitan"}


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its docs-test marker and its text."""

    path: Path
    line: int
    lang: str
    marker: str | None
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced code block of ``path``, in order."""
    lines = path.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence or not fence.group("lang"):
            index += 1
            continue
        start, indent = index, fence.group("indent")
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
        body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[start + 1 : end]]
        previous = start - 1
        while previous >= 0 and SNIPPET_MARKER.fullmatch(lines[previous].strip()):
            previous -= 1
        marker = MARKER.fullmatch(lines[previous].strip()) if previous >= 0 else None
        found.append(
            Block(path, start + 1, fence.group("lang"), marker and marker.group("marker"), "\n".join(body) + "\n")
        )
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in blocks(path)]


def run_python(block: Block, workdir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a Python block as a script in ``workdir`` with this interpreter and the repository importable."""
    script = workdir / "block.py"
    script.write_text(block.code)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(workdir), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
    )


def commands(block: Block) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments and blank lines dropped."""
    joined = block.code.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        command = line.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            found.append(command)
    return found


def _extras() -> set[str]:
    """The extras declared in pyproject.toml's ``[project.optional-dependencies]`` table."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = ", table, flags=re.M))


#: The benchmarks' shared modules live here, one folder above the scripts that import them.
BENCHMARKS = ROOT / "benchmarks"


def _source_with_siblings(script: Path) -> str:
    """``script``'s source and that of the modules it imports from beside it or, for a benchmark, from
    the shared modules in ``benchmarks/`` (its options may come from there, e.g. ``common.results_parser``)."""
    source = script.read_text()
    names = re.findall(r"^(?:from|import) (\w+)", source, flags=re.M)
    folders = [script.parent, *([BENCHMARKS] if script.parent.parent == BENCHMARKS else [])]
    siblings = [folder / f"{name}.py" for folder in folders for name in names]
    return "\n".join([source, *(sibling.read_text() for sibling in siblings if sibling.is_file())])


def _check_script(words: list[str]) -> str:
    script = next((word for word in words if word.endswith(".py")), None)
    if script is None or not (ROOT / script).is_file():
        raise AssertionError(f"no such script in the repository: {script!r}")
    source = _source_with_siblings(ROOT / script)
    for word in words[words.index(script) + 1 :]:
        if word == "--":  # what follows is passed through to another script of the same folder
            source = "".join(_source_with_siblings(path) for path in sorted((ROOT / script).parent.glob("*.py")))
            continue
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and f'"{flag}"' not in source:
            raise AssertionError(f"{script} has no option {flag}")
    return f"{script} and its options exist"


def _check_make(target: str) -> str:
    """``target`` has a rule in the Makefile and ``make -n`` accepts it (a .PHONY entry alone is no rule)."""
    if not re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), flags=re.M):
        raise AssertionError(f"make {target}: no rule in the Makefile")
    result = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"make {target}: {result.stderr.strip()}")
    return f"make {target} is a target"


def check_command(command: str) -> str:
    """Check that a documented shell command can work as written; returns what was checked.

    - ``make T [VAR=...]``: ``T`` is a target of the Makefile (``make -n T`` succeeds).
    - ``pip install ".[extra]"``: installs this clone, and each extra exists (the package is
      not published, so ``pip install lightning-dash`` fails).
    - ``[ENV=...] <python> script.py --flag ...`` (any interpreter, or ``composer -n N``): the
      script is in the repository and every ``--flag`` is one of its options.
    Anything else fails, so that a new kind of command gets a check before it is documented.
    """
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if words[0] == "make":
        targets = [word for word in words[1:] if "=" not in word]
        return "; ".join(_check_make(target) for target in targets)
    if words[:2] == ["pip", "install"]:
        for requirement in words[2:]:
            if requirement.startswith("lightning-dash"):
                raise AssertionError(f"lightning-dash is not on PyPI: {requirement}; install the clone (pip install .)")
            match = re.fullmatch(r"\.(?:\[(?P<extras>[\w,-]+)\])?", requirement)
            if match is None:
                raise AssertionError(f"pip installs something other than this clone: {requirement}")
            unknown = set((match.group("extras") or "").split(",")) - _extras() - {""}
            if unknown:
                raise AssertionError(f"no such extra: {sorted(unknown)}")
        return "the clone and its extras exist"
    if words[0].endswith("python") or words[0] == "composer":
        return _check_script(words)
    raise AssertionError(f"no check for this kind of command: {command!r}")
