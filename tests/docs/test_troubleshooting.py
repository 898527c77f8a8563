"""``docs/troubleshooting/`` lists every error message and warning the package emits.

Every module under ``lightning_dash/`` is parsed with ``ast`` (nothing is imported, so the
Composer and distributed modules are read like the rest). For each ``raise X(<message>)``
the literal text of the message is taken apart into its fragments (the parts of a string
literal, f-string, ``+`` concatenation, ``%`` or ``.format`` template between the
formatted values), following a local name to the string assigned to it in the same
function. The longest fragment, stripped of surrounding whitespace and punctuation, must
appear on the page (compared with whitespace collapsed and Markdown backticks removed);
a failure names ``file:line`` and the fragment to add. The warnings (``warnings.warn``,
``rank_zero_warn``, ``<logger>.warning``) are held to the same rule.

Raises that create no new message are skipped, by kind (``SKIPPED_KINDS``): a bare
``raise``, a re-raise of the variable an ``except ... as`` clause bound, and an exception
class raised without arguments (the abstract-method stubs). Anything else whose message
cannot be read, or has no fragment of ``MIN_FRAGMENT`` characters, fails unless it is in
``ALLOWLIST``.

A second test goes the other way: every message entry on the page (a list item that
starts with a code span followed by the exception type in italics) must still contain a
fragment of some raise or warning, so that entries for removed messages do not linger.
"""

from __future__ import annotations

import ast
import re
import string
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_dash"
PAGES = sorted((ROOT / "docs" / "troubleshooting").glob("*.md"))

MIN_FRAGMENT = 8
# Stripped from both ends of a fragment. Comparison operators (">=") stay: they are part
# of what the page quotes, and dropping them would shorten "must be >=" below the minimum.
STRIP = string.whitespace + ",.;:!?'\"()[]{}"

# Sites whose message has no usable literal fragment, as "path:line" relative to the
# repository root, each with the reason it is exempt. Keep this short: rather reword the
# message than add to it.
ALLOWLIST: dict[str, str] = {}

# What is not checked at all, and why (see the module docstring).
SKIPPED_KINDS = {
    "bare raise": "re-raises the exception being handled; its message was made elsewhere",
    "re-raise of a caught variable": "raises the exception an except clause bound; no new message",
    "exception class without arguments": "no message to document (abstract-method stubs)",
}

WARNING_CALLS = {"warn", "rank_zero_warn", "warning"}


@dataclass(frozen=True)
class Site:
    where: str  # "path:line"
    kind: str  # "raise" or "warning"
    fragments: tuple[str, ...] | None  # None: the message could not be read
    skipped: str | None = None  # a key of SKIPPED_KINDS

    @property
    def longest(self) -> str:
        return max(self.fragments or ("",), key=len)


def normalise(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def _split_template(template: str, pattern: str) -> list[str]:
    return re.split(pattern, template)


def fragments(node: ast.expr, names: dict[str, ast.expr]) -> list[str] | None:
    """The literal text pieces of a message expression, or None if it is not a string
    built from literals (a call result, an attribute, an unknown name, ...)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [part.value for part in node.values if isinstance(part, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        # A side that is not literal text ("..." + name) is a formatted value, as in an f-string.
        left, right = fragments(node.left, names), fragments(node.right, names)
        return None if left is None and right is None else (left or []) + (right or [])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        template = fragments(node.left, names)
        if template is None:
            return None
        return [piece for part in template for piece in _split_template(part, r"%[-#0 +]*\d*(?:\.\d+)?[a-zA-Z%]")]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and isinstance(node.func.value, ast.Constant)
        and isinstance(node.func.value.value, str)
    ):
        return _split_template(node.func.value.value, r"\{[^{}]*\}")
    if isinstance(node, ast.Name) and node.id in names:
        return fragments(names[node.id], {k: v for k, v in names.items() if k != node.id})
    return None


def _local_strings(function: ast.AST | None, before: int) -> dict[str, ast.expr]:
    """Names assigned (``name = <expr>``) in ``function`` above line ``before``; the last
    assignment wins, which is right for the straight-line code this is meant for."""
    names: dict[str, ast.expr] = {}
    if function is None:
        return names
    assignments = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.Assign) and node.lineno < before and len(node.targets) == 1
    ]
    for node in sorted(assignments, key=lambda node: node.lineno):
        target = node.targets[0]
        if isinstance(target, ast.Name):
            names[target.id] = node.value
    return names


def _is_class_name(node: ast.expr) -> bool:
    """``NotImplementedError`` or ``errors.Custom``: a class by the naming convention."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name[:1].isupper()


class _Collector(ast.NodeVisitor):
    def __init__(self, where: str) -> None:
        self.where = where
        self.sites: list[Site] = []
        self.functions: list[ast.AST] = []
        self.caught: list[str] = []

    def _function(self, node: ast.AST) -> None:
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        self.caught.append(node.name or "")
        self.generic_visit(node)
        self.caught.pop()

    def visit_Raise(self, node: ast.Raise) -> None:
        where = f"{self.where}:{node.lineno}"
        exc = node.exc
        names = _local_strings(self.functions[-1] if self.functions else None, node.lineno)
        if isinstance(exc, ast.Name) and exc.id not in self.caught and isinstance(names.get(exc.id), ast.Call):
            exc = names[exc.id]  # error = ValueError(...); raise error
        if exc is None:
            self.sites.append(Site(where, "raise", None, "bare raise"))
        elif isinstance(exc, ast.Name) and exc.id in self.caught:
            self.sites.append(Site(where, "raise", None, "re-raise of a caught variable"))
        elif _is_class_name(exc) or (isinstance(exc, ast.Call) and _is_class_name(exc.func) and not exc.args):
            self.sites.append(Site(where, "raise", None, "exception class without arguments"))
        elif isinstance(exc, ast.Call) and exc.args:
            self.sites.append(Site(where, "raise", _tuple(fragments(exc.args[0], names))))
        else:  # an instance built elsewhere (a parameter, an attribute, a call's result): its text is unknown here
            self.sites.append(Site(where, "raise", None))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in WARNING_CALLS and node.args:
            where = f"{self.where}:{node.lineno}"
            names = _local_strings(self.functions[-1] if self.functions else None, node.lineno)
            message = node.args[0]
            if len(node.args) > 1:  # a logger's "%"-template with its arguments
                message = ast.BinOp(left=message, op=ast.Mod(), right=ast.Tuple(elts=node.args[1:], ctx=ast.Load()))
            self.sites.append(Site(where, "warning", _tuple(fragments(message, names))))
        self.generic_visit(node)


def _tuple(pieces: list[str] | None) -> tuple[str, ...] | None:
    if pieces is None:
        return None
    return tuple(normalise(piece).strip(STRIP) for piece in pieces)


def sites_in(source: str, where: str) -> list[Site]:
    collector = _Collector(where)
    collector.visit(ast.parse(source, filename=where))
    return collector.sites


def collect_sites() -> list[Site]:
    return [
        site
        for path in sorted(PACKAGE.rglob("*.py"))
        for site in sites_in(path.read_text(), str(path.relative_to(ROOT)))
    ]


SITES = collect_sites()


def pages_text() -> str:
    """Every troubleshooting page, one after another."""
    return "\n".join(path.read_text() for path in PAGES)


@pytest.fixture(scope="module")
def page() -> str:
    assert len(PAGES) > 1, "docs/troubleshooting/ has no pages"
    return normalise(pages_text())


def test_the_scan_finds_the_package_raises() -> None:
    """A guard for the scanner itself: if it silently found nothing, every test would pass."""
    raises = [site for site in SITES if site.kind == "raise" and site.skipped is None]
    warnings = [site for site in SITES if site.kind == "warning"]
    assert len(raises) >= 100, len(raises)
    assert len(warnings) >= 4, len(warnings)
    assert not set(ALLOWLIST) - {site.where for site in SITES}, "ALLOWLIST names sites that no longer exist"
    assert {site.skipped for site in SITES} <= {None, *SKIPPED_KINDS}


def test_the_scanner_reads_each_form_of_message() -> None:
    source = textwrap.dedent(
        """
        def f(name, error):
            message = "a message held in a local name: " + name
            built = KeyError(f"an instance built in the function {name}")
            try:
                pass
            except ValueError as caught:
                raise caught from None
            if name:
                raise
            raise NotImplementedError
            raise TypeError(f"{name} formatted in an f-string, got {error!r}")
            raise ValueError("percent %s formatted template, %r" % (name, error))
            raise ValueError("{} formatted by str.format".format(name))
            raise ValueError(message)
            raise built
            raise error
            raise ValueError(describe(name))
            warnings.warn(f"a warning's literal text: {name}", stacklevel=2)
        """
    )
    found = [(site.kind, site.skipped, site.longest if site.fragments else None) for site in sites_in(source, "x")]
    assert found == [
        ("raise", "re-raise of a caught variable", None),
        ("raise", "bare raise", None),
        ("raise", "exception class without arguments", None),
        ("raise", None, "formatted in an f-string, got"),
        ("raise", None, "formatted template"),  # split at %s and %r
        ("raise", None, "formatted by str.format"),
        ("raise", None, "a message held in a local name"),
        ("raise", None, "an instance built in the function"),
        ("raise", None, None),  # an argument: unknown text, so it fails unless allowlisted
        ("raise", None, None),  # a call's result: likewise
        ("warning", None, "a warning's literal text"),
    ]


@pytest.mark.parametrize("kind", ["raise", "warning"])
def test_every_message_is_on_the_page(page: str, kind: str) -> None:
    missing = []
    for site in SITES:
        if site.kind != kind or site.skipped is not None or site.where in ALLOWLIST:
            continue
        if site.fragments is None:
            missing.append(f"{site.where}: the message is not built from string literals; document it and allowlist")
        elif len(site.longest) < MIN_FRAGMENT:
            missing.append(f"{site.where}: no literal fragment of {MIN_FRAGMENT}+ characters ({site.fragments})")
        elif site.longest not in page:
            missing.append(f"{site.where}: add {site.longest!r} to a page of docs/troubleshooting/")
    assert not missing, f"{len(missing)} {kind} message(s) not on the troubleshooting page:\n" + "\n".join(missing)


ENTRY = re.compile(r"^- `(?P<message>[^`]+)` — \*(?P<type>\w+)\*", re.MULTILINE)


def test_every_entry_still_matches_a_message() -> None:
    entries = ENTRY.findall(pages_text())
    assert len(entries) >= 50, "the page's entries no longer have the form '- `message` — *Type*'"
    known = [site.longest for site in SITES if site.fragments and len(site.longest) >= MIN_FRAGMENT]
    stale = [message for message, _ in entries if not any(fragment in normalise(message) for fragment in known)]
    listing = "\n".join(stale)
    assert not stale, f"entries that match no raise or warning in lightning_dash/ (remove or update them):\n{listing}"
