"""The package's structure: what imports what, what works with torch alone, and sizes.

These are structural facts of the source tree (exact, not timings): the optimizer
package never reaches into communication or trainer code, a plain PyTorch user needs
neither Lightning nor Composer, and no module or class grows past what one reader holds.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "lightning_dash"
TRAINERS = ("lightning", "lightning_fabric", "pytorch_lightning", "composer")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports included)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "optim").rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE / "optim"))
)
def test_optim_imports_neither_communication_nor_trainers(path):
    forbidden = [
        m
        for m in imported_modules(path)
        if m.startswith("lightning_dash.")
        and not m.startswith("lightning_dash.optim")
        or m.split(".")[0] in TRAINERS
        or m.startswith("torch.distributed")
    ]
    assert not forbidden, f"{path.name} imports {forbidden}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "distributed").glob("*.py")), ids=lambda p: p.name)
def test_distributed_imports_no_trainer(path):
    forbidden = [
        m
        for m in imported_modules(path)
        if m.split(".")[0] in TRAINERS
        or m.startswith(("lightning_dash.strategies", "lightning_dash.callbacks", "lightning_dash.composer"))
    ]
    assert not forbidden, f"{path.name} imports {forbidden}"


def package_module_name(path: Path) -> str:
    """``lightning_dash/optim/stacks/__init__.py`` -> ``lightning_dash.optim.stacks``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth (lazy and type-checking imports
    included): ``from package import name`` counts as the submodule ``package.name`` when one exists."""
    modules = {package_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[module] = {target for target in targets if target in modules and target != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], index[target])
        if lowest[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_import_circles_are_found():
    """The search itself, on a graph with one circle of three and a module outside it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    """No two modules of the package import each other, directly or through others, not even for
    type checking: each module can be read, and tested, before the ones that use it."""
    assert import_circles(package_import_graph()) == []


#: What the data-parallel runtimes may use of the optimizer: its package, the distributor protocol,
#: the stacks' public API and the shared argument checks; never the step's or the solvers' internals.
OPTIM_PUBLIC_SURFACE = (
    "lightning_dash.optim",
    "lightning_dash.optim.distributor",
    "lightning_dash.optim.stacks",
    "lightning_dash.optim.validation",
)


@pytest.mark.parametrize("path", sorted((PACKAGE / "distributed").glob("*.py")), ids=lambda p: p.name)
def test_distributed_uses_only_the_optimizers_public_surface(path):
    private = [
        m for m in imported_modules(path) if m.startswith("lightning_dash.optim") and m not in OPTIM_PUBLIC_SURFACE
    ]
    assert not private, f"{path.name} imports {private}"


@pytest.mark.multiprocess
def test_dash_trains_with_torch_alone():
    """With every trainer package made unimportable, the optimizer imports (without FSDP2's DTensor) and
    trains, and no trainer module was loaded on the way."""
    script = textwrap.dedent(f"""
        import importlib.abc, importlib.util, sys
        BLOCKED = {TRAINERS!r}
        real_find_spec = importlib.util.find_spec
        def find_spec(name, *args):
            return None if name.split(".")[0] in BLOCKED else real_find_spec(name, *args)
        importlib.util.find_spec = find_spec
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)")
                return None
        sys.meta_path.insert(0, Block())

        import torch
        from lightning_dash import DASH, DashConfig
        # FSDP2's DTensor (about 0.6 s to import) is for the sharded runtime alone.
        assert "torch.distributed.tensor" not in sys.modules, "import lightning_dash loaded torch.distributed.tensor"
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = DASH(model.parameters(), config=DashConfig(lr=0.01, block_size=4))
        for step in range(3):
            optimizer.zero_grad()
            model(torch.randn(5, 6)).square().mean().backward()
            optimizer.step()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok", optimizer.owned_blocks)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "6"]  # 8x6 -> 2x2 tiles of 4, 2x8 -> 1x2


def test_no_module_over_400_lines_and_no_class_over_300():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > 400:
            too_long.append(f"{path.relative_to(PACKAGE)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                too_long.append(f"{path.relative_to(PACKAGE)}: class {node.name} {node.end_lineno - node.lineno + 1}")
    assert not too_long, too_long


@pytest.mark.parametrize(("package", "other"), [("fabric", "strategies"), ("strategies", "fabric")])
def test_fabric_and_trainer_strategies_import_nothing_from_each_other(package, other):
    """What both front-ends share lives in ``lightning_dash.integration``; neither reaches sideways."""
    sideways = {
        f"{path.name}: {module}"
        for path in sorted((PACKAGE / package).glob("*.py"))
        for module in imported_modules(path)
        if module.startswith(f"lightning_dash.{other}")
    }
    assert not sideways, sorted(sideways)
