"""Our strategies in every installed Lightning namespace.

Lightning is installed under up to four names: the unified package's halves ``lightning.pytorch`` and
``lightning.fabric``, and the standalone ``pytorch_lightning`` and ``lightning_fabric``, which are copies of
those halves with their imports renamed (Lightning generates them so). Each namespace has its own classes and
its own strategy registry: ``pytorch_lightning.Trainer`` takes only a ``pytorch_lightning`` strategy, looked up
by name in ``pytorch_lightning.strategies.StrategyRegistry``.

So each of our strategy modules is written once, against the unified package, and :func:`register_strategies`

* registers the module itself in ``lightning.pytorch.strategies.StrategyRegistry`` (Trainer modules) or
  ``lightning.fabric.strategies.STRATEGY_REGISTRY`` (Fabric modules), when ``lightning`` is installed;
* for each installed standalone package, loads a copy of the module renamed as Lightning renames its own
  (``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric``, and our listed
  modules -> their copies), e.g. ``lightning_dash.integration._pytorch_lightning.dash_ddp``, and registers that
  copy in ``pytorch_lightning.strategies.StrategyRegistry`` or ``lightning_fabric.strategies.STRATEGY_REGISTRY``.

A namespace that is not installed is not imported. The copies are importable by name (spawned ranks unpickle
their classes) and :func:`standalone_module` returns one, e.g. to construct a standalone ``DashStrategy`` with
options.

Convention for a strategy module: it defines ``register_strategies(registry) -> None``, which adds its
strategies to ``registry`` and skips a name already there (registration is idempotent), and it imports
Lightning only through ``lightning.pytorch`` / ``lightning.fabric`` (the lightning_dash modules it imports are
not renamed, so they must not import Lightning, unless they are listed here themselves).
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from types import ModuleType
from typing import Any

#: Our Lightning Trainer strategy modules, written against ``lightning.pytorch``. Add new ones here.
TRAINER_STRATEGY_MODULES: tuple[str, ...] = (
    "lightning_dash.strategies.dash_ddp",
    "lightning_dash.strategies.dash_fsdp",
)
#: Our Lightning Fabric strategy modules, written against ``lightning.fabric``. Add new ones here.
FABRIC_STRATEGY_MODULES: tuple[str, ...] = (
    "lightning_dash.fabric.fabric_ddp",
    "lightning_dash.fabric.fabric_fsdp",
)

#: The FSDP2 strategies' registry names (Trainer's and Fabric's) and their launchers' start methods.
FSDP_LAUNCHERS = (("dash_fsdp", "popen"), ("dash_fsdp_spawn", "spawn"), ("dash_fsdp_fork", "fork"))

#: How a standalone package renames the unified package's modules.
_STANDALONE_NAMES = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}


@dataclass(frozen=True)
class _Namespace:
    """One Lightning namespace: the package that must be installed, where its strategy registry is, and the
    package our renamed copies live in (None: the unified package, which takes our modules as they are)."""

    package: str
    registry_module: str
    registry_name: str
    copies: str | None

    def registry(self) -> dict[str, Any]:
        return getattr(importlib.import_module(self.registry_module), self.registry_name)


_TRAINER_NAMESPACES = (
    _Namespace("lightning", "lightning.pytorch.strategies", "StrategyRegistry", None),
    _Namespace("pytorch_lightning", "pytorch_lightning.strategies", "StrategyRegistry", "pytorch_lightning"),
)
_FABRIC_NAMESPACES = (
    _Namespace("lightning", "lightning.fabric.strategies", "STRATEGY_REGISTRY", None),
    _Namespace("lightning_fabric", "lightning_fabric.strategies", "STRATEGY_REGISTRY", "lightning_fabric"),
)


class _RenamedCopies(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``lightning_dash.strategies._<standalone>`` (an empty package) and, inside it, the renamed
    copy of each of our modules it was told about (by its last name component)."""

    def __init__(self) -> None:
        #: Copy name -> name of the module it copies.
        self.originals: dict[str, str] = {}

    @staticmethod
    def package(standalone: str) -> str:
        return f"{__package__}._{standalone}"

    def add(self, original: str, standalone: str) -> str:
        """Make the copy of ``original`` for ``standalone`` importable; return its name."""
        copy = f"{self.package(standalone)}.{original.rpartition('.')[2]}"
        known = self.originals.setdefault(copy, original)
        if known != original:
            raise ValueError(f"{original} and {known} would both be copied to {copy}: rename one of them")
        return copy

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in {self.package(standalone) for standalone in _STANDALONE_NAMES.values()}:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname in self.originals:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        original = self.originals.get(module.__name__)
        if original is None:
            module.__doc__ = "Renamed copies of lightning_dash's strategy modules for a standalone Lightning package."
            return
        spec = find_spec(original)
        source = spec.loader.get_source(original) if spec is not None and spec.loader is not None else None
        if source is None:
            raise ImportError(f"cannot copy {original} for {module.__name__}: its source is not available")
        renamed = self.rename(source)
        _refuse_unified_imports(renamed, original)
        module.__file__ = spec.origin  # renaming keeps the lines: tracebacks show the original's
        exec(compile(renamed, spec.origin or original, "exec", dont_inherit=True), module.__dict__)

    def rename(self, source: str) -> str:
        """``source`` with the unified package's modules and ours renamed to their standalone copies."""
        names = {**_STANDALONE_NAMES, **{original: copy for copy, original in self.originals.items()}}
        pattern = r"\b(" + "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True)) + r")\b"
        return re.sub(pattern, lambda match: names[match.group(1)], source)


def _refuse_unified_imports(source: str, original: str) -> None:
    """A copy that still imports ``lightning`` would mix namespaces (its classes fail Lightning's checks late)."""
    for node in ast.walk(ast.parse(source)):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        unified = [name for name in names if name.split(".")[0] == "lightning"]
        if unified:
            raise ImportError(
                f"{original} imports {unified[0]}: strategy modules import Lightning only as lightning.pytorch "
                "or lightning.fabric, so that their standalone copies can be renamed"
            )


_COPIES = _RenamedCopies()


def _installed(package: str) -> bool:
    return find_spec(package) is not None  # a top-level name: looked up, not imported


def standalone_module(original: str, standalone: str) -> ModuleType:
    """The copy of our module ``original`` for the standalone package ``standalone`` (``"pytorch_lightning"``
    or ``"lightning_fabric"``), loaded once; e.g. ``standalone_module("lightning_dash.strategies.dash_ddp",
    "pytorch_lightning").DashStrategy(block_size=256)`` for ``pytorch_lightning.Trainer(strategy=...)``.
    Spawned ranks can unpickle the classes of the copies of the listed modules: importing lightning_dash
    registers, hence loads, those."""
    if standalone not in _STANDALONE_NAMES.values():
        raise ValueError(f"standalone must be one of {sorted(_STANDALONE_NAMES.values())}, got {standalone!r}")
    if _COPIES not in sys.meta_path:
        sys.meta_path.insert(0, _COPIES)
    return importlib.import_module(_COPIES.add(original, standalone))


def register_strategies(
    trainer_modules: Sequence[str] = TRAINER_STRATEGY_MODULES,
    fabric_modules: Sequence[str] = FABRIC_STRATEGY_MODULES,
) -> None:
    """Register the strategies of ``trainer_modules`` and ``fabric_modules`` (ours by default) in every
    installed Lightning namespace, importing none that is not installed; calling it again changes nothing."""
    targets = [
        (modules, namespace)
        for modules, namespaces in ((trainer_modules, _TRAINER_NAMESPACES), (fabric_modules, _FABRIC_NAMESPACES))
        for namespace in namespaces
        if modules and _installed(namespace.package)
    ]
    # Every copy is known before the first is loaded, so that copies importing each other are renamed to each other.
    for modules, namespace in targets:
        for name in modules:
            if namespace.copies is not None:
                _COPIES.add(name, namespace.copies)
    for modules, namespace in targets:
        registry = namespace.registry()
        for name in modules:
            module = (
                importlib.import_module(name) if namespace.copies is None else standalone_module(name, namespace.copies)
            )
            module.register_strategies(registry)


def register_each(registry: Any, strategy: type, names: Sequence[tuple[str, dict[str, Any]]], kind: str) -> None:
    """Register ``strategy`` under each of ``names`` (a name with the keyword arguments it stands for, a
    ``start_method`` among them) in ``registry``, described as ``kind`` with DASH; a name already there is
    kept (registration is idempotent)."""
    for name, settings in names:
        if name in registry:
            continue
        description = f"{kind} with DASH (block-owned Shampoo), {settings['start_method']} launcher"
        if "find_unused_parameters" in settings:
            description += f", find_unused_parameters={settings['find_unused_parameters']}"
        registry.register(name, strategy, description=description, **settings)
