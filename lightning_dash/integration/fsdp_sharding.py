"""Sharding an unchanged module with FSDP2 the way DASH's strategies do it by default.

FSDP2 shards the parameters of each ``fully_shard`` call as one group, and a Parameter
shared by two groups would be split into two copies. So every parameter shared between
modules (tied embeddings, a weight assigned to two layers) must end up in one group: a
candidate unit that shares a parameter with the rest of the model is not made a unit, and
top-level modules that share parameters are sharded together in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit

#: The LightningModule methods Lightning calls instead of ``forward``: where the model
#: itself holds parameters, FSDP2 gathers them around these calls.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def is_sharded(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` is already a DTensor (the user sharded it)."""
    return any(isinstance(param, DTensor) for param in module.parameters())


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` can be called (``ModuleList``, ``ModuleDict`` and ``ParameterList``
    are containers without a ``forward``: FSDP2 cannot hook them)."""
    return type(module).forward is not nn.Module.forward


def _parameter_ids(module: nn.Module) -> set[int]:
    return {id(param) for param in module.parameters()}


def _parameter_ids_outside(root: nn.Module, *excluded: nn.Module) -> set[int]:
    """The parameters reachable from ``root`` without passing through any of ``excluded``."""
    found: set[int] = set()
    seen = {id(module) for module in excluded}
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.update(id(param) for param in module.parameters(recurse=False))
        stack.extend(module.children())
    return found


def shard_units(module: nn.Module, classes: Collection[type[nn.Module]] | None) -> list[nn.Module]:
    """The submodules that become FSDP2 units before the root, innermost first: instances
    of ``classes`` when given, else every child of every ``nn.ModuleList`` (the layers
    of a transformer); a candidate that shares a parameter with the rest of ``module``
    is left to an enclosing group, so that the tie survives."""
    if classes:
        found = [m for m in module.modules() if m is not module and isinstance(m, tuple(classes))]
    else:
        found = [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]
    found = list({id(m): m for m in found}.values())
    found = [m for m in found if not _parameter_ids(m) & _parameter_ids_outside(module, m)]
    order = {id(m): position for position, m in enumerate(module.modules())}
    return sorted(found, key=lambda m: -order[id(m)])


def shard_model(module: nn.Module, mesh: DeviceMesh | None, classes: Collection[type[nn.Module]] | None = None) -> None:
    """``fully_shard`` each unit of :func:`shard_units` (the children of every
    ``nn.ModuleList``, or the instances of ``classes``), then ``module`` itself: Fabric
    calls the module it set up, so its root is the model (for a LightningModule,
    :func:`shard_module` shards its children instead). Weights tied across the root's
    children stay tied: they are in the root's group."""
    options = {"mesh": mesh} if mesh is not None else {}
    for unit in shard_units(module, classes):
        fully_shard(unit, **options)
    fully_shard(module, **options)


def _callable_children(module: nn.Module, skipped: set[int]) -> Iterator[nn.Module]:
    """The children of ``module`` that hold parameters and are not in ``skipped``, with each
    container (a module without ``forward``) replaced by its own callable children."""
    for child in module.children():
        if id(child) in skipped:
            continue
        if not has_forward(child):
            yield from _callable_children(child, skipped)
        elif any(True for _ in child.parameters()):
            yield child


def _shares_parameters(module: nn.Module, others: list[nn.Module]) -> bool:
    ids = _parameter_ids(module)
    return any(ids & _parameter_ids(other) for other in others if other is not module)


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh | None,
    classes: Collection[type[nn.Module]] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> int:
    """Shard a LightningModule as FSDP2 units whose hooks Lightning's calls reach.

    Lightning calls the step methods, not ``forward``; they call the model's children. So:
    each unit of :func:`shard_units` first; then each callable child holding parameters
    (containers such as a top-level ``ModuleList`` are looked into, not sharded) that shares
    none with another; and, where parameters remain (on ``module`` itself, in a
    ``ParameterList``, or in children tied to each other), ``module`` as the root, gathered
    around its step methods. Returns how many FSDP2 groups there were.
    """
    options: dict = {"mesh": mesh} if mesh is not None else {}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    units = shard_units(module, classes)
    children = list(_callable_children(module, {id(unit) for unit in units}))
    loose = _parameter_ids_outside(module, *units, *children)  # on module itself or in a ParameterList
    roots = [c for c in children if not _shares_parameters(c, children) and not loose & _parameter_ids(c)]
    for unit in [*units, *roots]:
        fully_shard(unit, **options)
    if not _parameter_ids(module) - set().union(*map(_parameter_ids, [*units, *roots])):
        return len(units) + len(roots)
    fully_shard(module, **options)
    for name in STEP_METHODS:
        register_fsdp_forward_method(module, name)
    return len(units) + len(roots) + 1


def check_shard_modules(value: Any) -> tuple[type[nn.Module], ...] | None:
    """``shard_modules`` as a tuple of ``nn.Module`` subclasses (None or empty: None), else ``TypeError``."""
    if value is None:
        return None
    classes = tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else None
    if classes is None or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"shard_modules must be a list of nn.Module subclasses (e.g. [Block]) or None, got {value!r}")
    return classes or None


def mesh_sizes(
    data_parallel_size: int | str, tensor_parallel_size: int | str, num_nodes: int, num_processes: int
) -> tuple[int, int]:
    """The data- and tensor-parallel sizes over ``num_nodes`` nodes of ``num_processes`` processes, ``"auto"``
    made concrete (as Lightning: tensor parallelism over one node's processes; data parallelism over the
    processes left); ``ValueError`` where the sizes do not fit the world size, naming the sizes that would."""
    world_size = num_nodes * num_processes
    tensor = num_processes if tensor_parallel_size == "auto" else int(tensor_parallel_size)
    divisors = [size for size in range(1, world_size + 1) if world_size % size == 0]
    if world_size % tensor:
        raise ValueError(
            f"tensor_parallel_size={tensor} does not divide the {world_size} processes: give one of {divisors} "
            "(the data-parallel size is then the processes over it)"
        )
    data = world_size // tensor if data_parallel_size == "auto" else int(data_parallel_size)
    if data * tensor != world_size:
        raise ValueError(
            f"data_parallel_size={data} times tensor_parallel_size={tensor} is not the {world_size} processes: "
            f"give data_parallel_size={world_size // tensor} or 'auto'"
        )
    return data, tensor


def check_mesh_sizes(strategy: Any) -> tuple[int, int]:
    """A DASH FSDP2 strategy's data- and tensor-parallel sizes for its processes (:func:`mesh_sizes`)."""
    sizes = strategy._data_parallel_size, strategy._tensor_parallel_size
    return mesh_sizes(*sizes, strategy.num_nodes, strategy.num_processes)


def setup_sharded_environment(strategy: Any, setup_environment: Callable[[], None]) -> None:
    """A DASH FSDP2 strategy's ``setup_environment`` (Trainer's or Fabric's): ``"auto"`` mesh sizes made
    concrete and checked (:func:`check_mesh_sizes`), then the base class's ``setup_environment``, then
    gloo's workers kept alive until exit."""
    strategy._data_parallel_size, strategy._tensor_parallel_size = check_mesh_sizes(strategy)
    setup_environment()
    settle_gloo_workers_at_exit()


def check_data_parallel_sharding(module: nn.Module, mesh: DeviceMesh) -> None:
    """With tensor parallelism, refuse a model whose ``configure_model`` (or Fabric's
    ``parallelize_fn``) left it unsharded, or left a parameter outside the data-parallel
    mesh while there are several data-parallel groups (its gradient would not be averaged
    over them), naming the parameter."""
    if mesh["tensor_parallel"].size() == 1:
        return
    if not is_sharded(module):
        raise ValueError(
            f"tensor_parallel_size={mesh['tensor_parallel'].size()}: apply tensor parallelism in configure_model "
            "(or Fabric's parallelize_fn) with parallelize_module on device_mesh['tensor_parallel'], then "
            "fully_shard on device_mesh['data_parallel']; an unchanged module is sharded by data parallelism only"
        )
    if mesh["data_parallel"].size() == 1:
        return
    for name, param in module.named_parameters():
        if not isinstance(param, DTensor) or "data_parallel" not in (param.device_mesh.mesh_dim_names or ()):
            raise ValueError(
                f"{name} is not sharded over device_mesh['data_parallel'] (placements "
                f"{getattr(param, 'placements', 'none: a plain tensor')}): call fully_shard(..., "
                "mesh=device_mesh['data_parallel']) after parallelize_module, so that its gradient is averaged "
                "over the data-parallel groups"
            )


def shard_over_data_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    classes: Collection[type[nn.Module]] | None,
    shard: Callable[[nn.Module, DeviceMesh, Collection[type[nn.Module]] | None], object],
) -> None:
    """What both FSDP2 front ends do with the model once the user's code has parallelised it:
    refuse a tensor-parallel layout that data parallelism cannot complete
    (:func:`check_data_parallel_sharding`), then, unless the user sharded it, shard it over
    ``mesh["data_parallel"]`` with ``shard`` (:func:`shard_model` for the module Fabric calls,
    :func:`shard_module` for a LightningModule, whose step methods Lightning calls)."""
    check_data_parallel_sharding(module, mesh)
    if not is_sharded(module):
        shard(module, mesh["data_parallel"], classes)
