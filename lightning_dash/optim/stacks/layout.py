"""Where every parameter's optimizer state lives while DASH trains.

Parameters of two or more dimensions are cut into blocks (:mod:`.blocks`); the
blocks this process owns live in stacks, one :class:`~.state.StackState` per block
shape, device and state dtype. The one-dimensional parameters of a group share
flat momentum and second-moment buffers. A layout is built at the first step
(and again after the groups, the distributor or the state change) from the
per-parameter entries of ``optimizer.state``, and exported back to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_dash.optim.roots.common import working_dtype
from lightning_dash.optim.stacks.blocks import MatrixView, Region, StackPlan, param_regions, stack_regions
from lightning_dash.optim.stacks.state import (
    GRAFTING_RMS,
    MOMENTUM,
    StackState,
    export_stack,
    export_tiles,
    import_stack,
)
from lightning_dash.optim.stacks.uploads import upload


def matrix_regions(views: list[MatrixView | None], block_size: int) -> list[Region]:
    """The block regions of every preconditioned parameter (a view that is not None), in order."""
    return [
        region
        for index, view in enumerate(views)
        if view is not None
        for region in param_regions(index, view, block_size)
    ]


def stacks_by_placement(regions: list[Region], params: list[Tensor]) -> list[StackPlan]:
    """Stacks of equal block shape, apart for each device and state dtype."""

    def placement(region: Region) -> tuple[torch.device, torch.dtype]:
        param = params[region.param_index]
        return param.device, working_dtype(param)

    keys = dict.fromkeys(placement(region) for region in regions)
    return [plan for key in keys for plan in stack_regions([r for r in regions if placement(r) == key])]


@dataclass
class Stack:
    """One stack: its plan (which tiles of which parameters) and its state."""

    plan: StackPlan
    state: StackState
    _subsets: dict[tuple[int, ...], tuple[StackPlan, Tensor]] = field(default_factory=dict, repr=False)

    def subset(self, param_indices: tuple[int, ...]) -> tuple[StackPlan, Tensor]:
        """The plan of the blocks of ``param_indices`` and their positions here, on the
        state's device (kept: the same parameters tend to move together step after step)."""
        if param_indices not in self._subsets:
            plan, positions = self.plan.subset(set(param_indices))
            self._subsets[param_indices] = (plan, upload(positions, torch.int64, self.state.left_pair.device))
        return self._subsets[param_indices]


@dataclass
class VectorGroup:
    """The one-dimensional parameters of one param group on one device, as flat buffers."""

    group_index: int
    param_indices: list[int]
    offsets: list[int]
    numels: list[int]
    momentum: Tensor
    rms: Tensor


class Placement(Protocol):
    """Where parameters live across ranks (the part of a ``BlockDistributor`` a layout needs)."""

    def plan_stacks(
        self, regions: list[Region], params: list[Tensor], frequencies: list[int], names: list[str] | None = None
    ) -> list[StackPlan]:
        """The stacks of the blocks this rank owns."""
        ...

    def local(self, tensor: Tensor) -> Tensor:
        """The part of a parameter (or gradient) this rank updates elementwise."""
        ...

    def local_part(self, param: Tensor, value: Tensor) -> Tensor:
        """This rank's part of a tensor shaped like ``param``."""
        ...


def _whole(tensor: Tensor) -> Tensor:
    return tensor


@dataclass
class Layout:
    """Every parameter (flat, in ``param_groups`` order) and where its state lives.

    ``block_size`` is the side of the tiles the stacks hold. ``local`` gives the part of a
    parameter or gradient this rank updates elementwise (the whole tensor unless parameters
    are sharded across ranks).
    """

    params: list[Tensor]
    group_of: list[int]
    names: list[str]
    steps: list[int]
    stacks: list[Stack]
    vectors: list[VectorGroup]
    views: list[MatrixView | None]
    block_size: int
    local: Callable[[Tensor], Tensor] = _whole

    def preconditioned(self, index: int) -> bool:
        """Whether parameter ``index`` has Shampoo blocks (else the grafting optimizer alone updates it)."""
        return self.views[index] is not None


def build_layout(
    params: list[Tensor],
    group_of: list[int],
    names: list[str],
    views: list[MatrixView | None],
    saved: dict[int, dict[str, Tensor]],
    plans: list[StackPlan],
    block_size: int,
    want_momentum: bool,
    want_second_moment: bool,
    placement: Placement | None = None,
) -> Layout:
    """Allocate the stacks of ``plans`` and the vector buffers of the parameters without a
    view (not preconditioned), filled from ``saved`` (per-parameter entries by flat index;
    missing statistics start at zero). The vector buffers hold the ``placement``'s local
    part of each parameter."""
    local = placement.local if placement is not None else _whole
    local_part = placement.local_part if placement is not None else (lambda param, value: value)
    steps = [int(saved[index]["step"].item()) for index in range(len(params))]
    stacks: list[Stack] = []
    for plan in plans:
        if not plan.regions:
            continue
        first = params[plan.regions[0].param_index]
        state = StackState.zeros(plan.num_blocks, plan.block_shape, first.device, working_dtype(first))
        if want_momentum:
            state.ensure(MOMENTUM)
        if want_second_moment:
            state.ensure(GRAFTING_RMS)
        import_stack(plan, state, params, block_size, saved, names)
        stacks.append(Stack(plan, state))
    vectors: list[VectorGroup] = []
    for group_index in sorted(set(group_of)):
        members: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, param in enumerate(params):
            if group_of[index] == group_index and views[index] is None and param.numel() > 0:
                members.setdefault((param.device, working_dtype(param)), []).append(index)
        for (device, dtype), indices in members.items():
            numels = [local(params[i]).numel() for i in indices]
            offsets = [sum(numels[:k]) for k in range(len(numels))]
            momentum = torch.zeros(sum(numels), device=device, dtype=dtype)
            rms = torch.zeros(sum(numels), device=device, dtype=dtype)
            for index, offset, numel in zip(indices, offsets, numels):
                for name, flat in ((MOMENTUM, momentum), (GRAFTING_RMS, rms)):
                    if name in saved[index]:
                        part = local_part(params[index], saved[index][name])
                        flat[offset : offset + numel].copy_(local(part).reshape(-1))
            vectors.append(VectorGroup(group_index, indices, offsets, numels, momentum, rms))
    return Layout(params, group_of, names, steps, stacks, vectors, views, block_size, local)


def export_layout(layout: Layout, include_vectors: bool = True, tiles: bool = False) -> dict[int, dict[str, Tensor]]:
    """Per-parameter copies of the layout's state, keyed by flat parameter index.

    One-dimensional parameters are replicated on every rank when parameters are whole;
    ``include_vectors`` leaves them out so that only one rank contributes them when
    ranks are merged (their buffers are this rank's local part, shaped like it).
    With ``tiles`` every statistic of a block is its own entry (see :func:`.state.export_tiles`).
    """
    out: dict[int, dict[str, Tensor]] = {}
    for stack in layout.stacks:
        if tiles:
            export_tiles(stack.plan, stack.state, layout.block_size, out)
        else:
            export_stack(stack.plan, stack.state, layout.params, layout.block_size, out)
    for vector in layout.vectors if include_vectors else []:
        for index, offset, numel in zip(vector.param_indices, vector.offsets, vector.numels):
            shape = layout.local(layout.params[index]).shape
            out[index] = {
                MOMENTUM: vector.momentum[offset : offset + numel].clone().view(shape),
                GRAFTING_RMS: vector.rms[offset : offset + numel].clone().view(shape),
            }
    return out


def owned_blocks(layout: Layout | None) -> int:
    """Blocks whose statistics this process holds."""
    return 0 if layout is None else sum(stack.plan.num_blocks for stack in layout.stacks)


def preconditioned_blocks(layout: Layout | None) -> int:
    """Blocks whose Shampoo roots are in use (reads a count back from the device)."""
    return 0 if layout is None else sum(int(stack.state.root_valid.sum()) for stack in layout.stacks)


def layout_bytes(layout: Layout | None) -> int:
    """Bytes of the statistics, roots and buffers held in the layout's stacks and vectors."""
    if layout is None:
        return 0
    tensors = [t for stack in layout.stacks for t in stack.state.tensors()]
    tensors += [t for vector in layout.vectors for t in (vector.momentum, vector.rms)]
    return sum(t.numel() * t.element_size() for t in tensors)


def param_names(param_groups: list[dict[str, Any]]) -> list[str]:
    """A name for every parameter, for messages: the group's ``param_names`` when given
    (named parameters), else its position and shape."""
    names = []
    for group_index, group in enumerate(param_groups):
        given = group.get("param_names")
        for position, param in enumerate(group["params"]):
            names.append(
                str(given[position])
                if given is not None
                else f"param_groups[{group_index}]['params'][{position}] {tuple(param.shape)}"
            )
    return names


def stack_state(
    param_groups: list[dict[str, Any]],
    state: dict[Tensor, dict[str, Any]],
    views: list[MatrixView | None],
    placement: Placement,
    block_size: int,
    want_second_moment: bool,
) -> Layout:
    """Move the per-parameter statistics of ``state`` (an optimizer's) into a new layout
    of the stacks ``placement`` gives this process (``views``: how each parameter is
    preconditioned, if it is); only step counts stay in ``state``."""
    params = [p for group in param_groups for p in group["params"]]
    group_of = [g for g, group in enumerate(param_groups) for _ in group["params"]]
    saved = {}
    for index, param in enumerate(params):
        entry = state[param]
        entry["step"] = torch.as_tensor(entry.get("step", 0.0), dtype=torch.float32, device="cpu")
        saved[index] = entry
    regions = matrix_regions(views, block_size)
    frequencies = [param_groups[group_of[r.param_index]]["precondition_frequency"] for r in regions]
    names = param_names(param_groups)
    layout = build_layout(
        params,
        group_of,
        names,
        views,
        saved,
        placement.plan_stacks(regions, params, frequencies, names),
        block_size,
        want_momentum=any(group["betas"][0] > 0 for group in param_groups),
        want_second_moment=want_second_moment,
        placement=placement,
    )
    for param in params:
        step = state[param]["step"]
        state[param].clear()
        state[param]["step"] = step
    return layout
