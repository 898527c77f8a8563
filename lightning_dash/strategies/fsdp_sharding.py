"""Sharding an unchanged module with FSDP2 the way DASH's strategies do it by default."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def is_sharded(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` is already a DTensor (the user sharded it)."""
    return any(isinstance(param, DTensor) for param in module.parameters())


def shard_units(module: nn.Module, classes: Collection[type[nn.Module]] | None) -> list[nn.Module]:
    """The submodules that become FSDP2 units before the root, innermost first: instances
    of ``classes`` when given, else every child of every ``nn.ModuleList`` (the layers
    of a transformer)."""
    if classes:
        found = [m for m in module.modules() if m is not module and isinstance(m, tuple(classes))]
    else:
        found = [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]
    order = {id(m): position for position, m in enumerate(module.modules())}
    return sorted(found, key=lambda m: -order[id(m)])


def shard_model(module: nn.Module, mesh: DeviceMesh | None, classes: Collection[type[nn.Module]] | None = None) -> None:
    """``fully_shard`` each unit of :func:`shard_units` (the children of every
    ``nn.ModuleList``, or the instances of ``classes``), then ``module`` itself: Fabric
    calls the module it set up, so its root is the model (for a LightningModule,
    :func:`shard_module` shards its children instead). Weights tied across the root's
    children stay tied."""
    options = {"mesh": mesh} if mesh is not None else {}
    for unit in shard_units(module, classes):
        fully_shard(unit, **options)
    fully_shard(module, **options)


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh | None,
    classes: Collection[type[nn.Module]] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> int:
    """Apply ``fully_shard`` to each unit of :func:`shard_units`, then to the roots: each
    child of ``module`` that holds parameters (a LightningModule's training step calls
    its models, not its own ``forward``), and ``module`` itself when it holds
    parameters directly. Returns how many units there were in all."""
    options: dict = {"mesh": mesh} if mesh is not None else {}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    units = shard_units(module, classes)
    sharded = {id(unit) for unit in units}
    roots = [child for child in module.children() if id(child) not in sharded and any(True for _ in child.parameters())]
    for unit in [*units, *roots]:
        fully_shard(unit, **options)
    if any(True for _ in module.parameters(recurse=False)):
        fully_shard(module, **options)
    return len(units) + len(roots)
