"""A :class:`~lightning_dash.optim.distributor.BlockDistributor` for parameters FSDP2 and tensor parallelism shard.

Each rank holds a rectangle of every parameter (a row shard under FSDP2; rows, or rows and
columns, under tensor parallelism; the same rectangle on several ranks where a mesh
dimension replicates) and, after FSDP2's reduce-scatter, the same part of its gradient.
Blocks are cut from the whole parameters (as in one process) and owned by ranks as under
DDP (greedy LPT over the FLOP cost model), over the whole mesh. Each step, one
``all_to_all`` carries the gradient pieces of every block to its owner, the owner updates
its statistics and computes the block's update, and a second ``all_to_all`` carries the
update pieces back to every rank that holds them (:mod:`.piece_exchange`): once, or once per
micro-group under a memory budget (:mod:`.micro_groups`). No rank materialises a whole
parameter (:mod:`.placements` checks that every shard is a rectangle of one).
One-dimensional parameters are updated elementwise on each rank's own shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_dash.distributed.micro_groups import (
    assign_micro_groups,
    capacity_bytes,
    check_micro_group_mib,
    peak_gathered_bytes,
    warn_block_above_budget,
)
from lightning_dash.distributed.piece_exchange import PieceExchange, Runs, holder_preferences, plan_rank
from lightning_dash.distributed.placements import check_sharded_placements, sharded_holdings
from lightning_dash.distributed.process_group import ProcessGroupDistributor, wire_dtype
from lightning_dash.optim.distributor import BlockUpdate, ComputeUpdates, masked
from lightning_dash.optim.stacks import Region, StackPlan, working_dtype


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_gradient(param: Tensor) -> Tensor | None:
    """This rank's part of ``param``'s gradient, laid out as its part of ``param``."""
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return None if grad is None else _local(grad)


def _end_to_end(tensors: list[Tensor | None], sizes: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``tensors`` flattened and laid end to end in ``dtype``, zeros where one is None
    (``sizes``: their numbers of elements); one ``cat``, however many tensors."""
    missing = max((size for tensor, size in zip(tensors, sizes) if tensor is None), default=0)
    zeros = torch.zeros(missing, dtype=dtype, device=device) if missing else None
    parts = [zeros[:size] if tensor is None else tensor.reshape(-1) for tensor, size in zip(tensors, sizes)]
    return torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype, device=device)


@dataclass(frozen=True)
class _Pending:
    """An ``all_to_all`` in flight and the tensor it fills."""

    received: Tensor
    work: dist.Work | None

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        return self.received


@dataclass(frozen=True)
class _RankExchange:
    """This rank's part of one micro-group's exchange: the plan, its stacks (this rank's
    stacks ``first``, ``first + 1``, ...), and the runs of both directions (gradients to
    the owners, updates back to the holders)."""

    pieces: PieceExchange
    plans: list[StackPlan]
    first: int
    gradient_send: Runs
    gradient_receive: Runs
    update_send: Runs
    update_receive: Runs

    @classmethod
    def of(cls, pieces: PieceExchange, plans: list[StackPlan], first: int, device: torch.device) -> _RankExchange:
        return cls(
            pieces,
            plans,
            first,
            pieces.gradient_send_runs().to(device),
            pieces.gradient_receive_runs(plans).to(device),
            pieces.update_send_runs(plans).to(device),
            pieces.update_receive_runs().to(device),
        )

    @property
    def positions(self) -> list[int]:
        """Positions of its stacks among this rank's stacks."""
        return list(range(self.first, self.first + len(self.plans)))


class _HeldUpdates:
    """The update pieces this rank holds, received from the blocks' owners and scattered
    into a flat tensor laid out as its rectangles end to end (:attr:`PieceExchange.held`)."""

    def __init__(self, held: dict[int, tuple[int, int]], flat: Tensor) -> None:
        self.held = held
        self.flat = flat

    def tensors(self) -> list[Tensor]:
        return [self.flat]

    def apply(self, params: list[Tensor], skip: Tensor) -> None:
        """Add the rows to the parameters with one ``_foreach_add_`` per parameter dtype."""
        flat = masked(self.flat, skip)
        by_dtype: dict[torch.dtype, tuple[list[Tensor], list[tuple[int, int]]]] = {}
        for index, span in self.held.items():
            local = _local(params[index])
            targets, spans = by_dtype.setdefault(local.dtype, ([], []))
            targets.append(local.view(-1))
            spans.append(span)
        for dtype, (targets, spans) in by_dtype.items():
            cast = flat.to(dtype)
            torch._foreach_add_(targets, [cast[offset : offset + numel] for offset, numel in spans])


def _group_regions(regions: list[Region], owners: list[int], groups: list[int]) -> list[tuple[list[Region], list[int]]]:
    """Each micro-group's regions and their tiles' owners (tiles in region order); a
    region whose tiles are all in one micro-group stays whole."""
    grouped: list[tuple[list[Region], list[int]]] = [([], []) for _ in range(max(groups, default=0) + 1)]
    position = 0
    for region in regions:
        span = range(position, position + region.num_blocks)
        if len({groups[k] for k in span}) == 1:
            members, their_owners = grouped[groups[position]]
            members.append(region)
            their_owners.extend(owners[k] for k in span)
        else:
            for tile, k in zip(region.single_tiles(), span):
                grouped[groups[k]][0].append(tile)
                grouped[groups[k]][1].append(owners[k])
        position += region.num_blocks
    return grouped


class ShardedDistributor(ProcessGroupDistributor):
    """Block ownership and the two piece exchanges of DASH on sharded parameters (FSDP2, tensor parallelism).

    Args:
        process_group: the group the parameters are sharded over (None: the default group).
        communication_dtype: dtype of the update rows sent back (float32 keeps the result
            equal to a single process's; bfloat16/float16 halve that traffic). Gradient
            rows travel in the statistics' dtype.
        root_iterations: iterations per root, for the cost model.
        micro_group_mib: memory budget, in MiB per rank, for the whole blocks a step
            gathers at once (:mod:`.micro_groups`); None: every block in one round (the
            fewest collectives).
    """

    shards_parameters = True
    #: This rank's part of each micro-group's exchange for the current layout (planned with the stacks).
    _groups: list[_RankExchange] = []
    _peak_gathered_bytes = 0

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        communication_dtype: torch.dtype = torch.float32,
        root_iterations: int = 10,
        micro_group_mib: float | None = None,
    ) -> None:
        budget = check_micro_group_mib(micro_group_mib)  # checked before the process group is read
        super().__init__(process_group, communication_dtype, root_iterations)
        self.micro_group_mib = budget

    # ------------------------------------------------------------------ placement
    def local(self, tensor: Tensor) -> Tensor:
        return _local(tensor)

    def local_part(self, param: Tensor, value: Tensor) -> Tensor:
        if isinstance(value, DTensor) or not isinstance(param, DTensor) or value.shape != param.shape:
            return _local(value)
        chunks = param.__create_chunk_list__()
        if not chunks:
            return value[:0]
        return value[tuple(slice(o, o + n) for o, n in zip(chunks[0].offsets, chunks[0].sizes))]

    def shard_like(self, param: Tensor, local: Tensor) -> Tensor:
        if not isinstance(param, DTensor):
            return local
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    def plan_stacks(
        self, regions: list[Region], params: list[Tensor], frequencies: list[int], names: list[str] | None = None
    ) -> list[StackPlan]:
        check_sharded_placements(params, names)
        tiles = [(tile, frequency) for region, frequency in zip(regions, frequencies) for tile in region.single_tiles()]
        holdings = sharded_holdings(regions, params, names, self.process_group)
        keys = [(t.param_index, t.row_start, t.col_start) for t, _ in tiles]
        owners = self.assign_owners(
            keys=keys,
            shapes=[t.block_shape for t, _ in tiles],
            frequencies=[frequency for _, frequency in tiles],
            preferred=holder_preferences(regions, holdings),
        )
        sizes = {i: working_dtype(p).itemsize for i, p in enumerate(params)}
        footprints = [2 * t.block_shape[0] * t.block_shape[1] * sizes[t.param_index] for t, _ in tiles]
        capacity = None if self.micro_group_mib is None else capacity_bytes(self.micro_group_mib)
        groups = assign_micro_groups([self._costs[key] for key in keys], owners, footprints, capacity)
        peaks = peak_gathered_bytes(groups, owners, footprints, self.world_size)
        self._peak_gathered_bytes = peaks[self.rank]
        if self.rank == 0 and capacity is not None and max(footprints, default=0) > capacity:
            largest = max(range(len(tiles)), key=lambda index: footprints[index])
            warn_block_above_budget(tiles[largest][0], footprints[largest], max(peaks), self.micro_group_mib, names)
        plans: list[StackPlan] = []
        self._groups = []
        for group_regions, group_owners in _group_regions(regions, owners, groups):
            rank_plans, pieces = plan_rank(group_regions, params, group_owners, holdings, self.rank)
            self._groups.append(_RankExchange.of(pieces, rank_plans[self.rank], len(plans), self._device()))
            plans += rank_plans[self.rank]
        return plans

    @property
    def elements_per_step(self) -> int:
        """Elements this rank sends to others in one step (0 before the first step)."""
        return sum(group.pieces.elements_sent() for group in self._groups)

    @property
    def micro_groups(self) -> int:
        """Micro-groups a step exchanges and computes in turn (0 before the first step)."""
        return len(self._groups)

    @property
    def peak_gathered_bytes(self) -> int:
        """The most bytes of whole blocks (gradients and their updates) this rank holds at
        once in a step, as planned (:func:`.micro_groups.peak_gathered_bytes`). The exchange's
        send and receive buffers of block pieces come on top."""
        return self._peak_gathered_bytes

    # ------------------------------------------------------------------ exchanges
    def _start_all_to_all(self, send: Tensor, send_sizes: list[int], receive_sizes: list[int]) -> _Pending:
        received = send.new_empty(sum(receive_sizes))
        work = dist.all_to_all_single(
            received, send, receive_sizes, send_sizes, group=self.process_group, async_op=True
        )
        self.bytes_sent += (sum(send_sizes) - send_sizes[self.rank]) * send.element_size()
        return _Pending(received, work)

    def exchange_blocks(self, plans: list[StackPlan], params: list[Tensor], compute: ComputeUpdates) -> _HeldUpdates:
        """Gather each micro-group's block gradients on their owners, let ``compute`` turn them
        into updates, and send those back to the ranks that hold the blocks' pieces; the next
        micro-group's gradients travel while the current one is computed. One gather before
        each ``all_to_all`` and one scatter after it, whatever the model."""
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        device = self._device()
        held = self._groups[0].pieces.held
        grads = [_local_gradient(params[index]) for index in held]
        flat_grads = _end_to_end(grads, [numel for _, numel in held.values()], dtype, device)
        received_updates = torch.zeros(
            self._groups[0].pieces.held_numel, dtype=wire_dtype(self.communication_dtype, dtype), device=device
        )
        pending = self._send_gradients(self._groups[0], flat_grads)
        for number, group in enumerate(self._groups):
            received = pending.wait()
            if number + 1 < len(self._groups):
                pending = self._send_gradients(self._groups[number + 1], flat_grads)
            stacks = self._gradient_stacks(group, received, params)
            del received
            updates = compute(group.positions, stacks)
            del stacks
            rows = self._send_updates(group, updates, received_updates.dtype).wait()
            received_updates.index_copy_(0, group.update_receive.positions(), rows)
        return _HeldUpdates(held, received_updates)

    def _send_gradients(self, group: _RankExchange, flat_grads: Tensor) -> _Pending:
        send = flat_grads.index_select(0, group.gradient_send.positions())
        return self._start_all_to_all(
            send, group.pieces.split_sizes["gradients_out"], group.pieces.split_sizes["gradients_in"]
        )

    def _gradient_stacks(self, group: _RankExchange, received: Tensor, params: list[Tensor]) -> list[Tensor]:
        receive = group.gradient_receive
        flat = received.new_empty(receive.total).index_copy_(0, receive.positions(), received)
        stacks, offset = [], 0
        for plan in group.plans:
            numel = plan.num_blocks * plan.block_shape[0] * plan.block_shape[1]
            stack = flat[offset : offset + numel].view(plan.num_blocks, *plan.block_shape)
            stacks.append(stack.to(working_dtype(params[plan.regions[0].param_index])))
            offset += numel
        return stacks

    def _send_updates(self, group: _RankExchange, updates: list[BlockUpdate], wire: torch.dtype) -> _Pending:
        device = self._device()
        full: dict[int, Tensor] = {}
        for item in updates:
            stack = item.stack - group.first
            if item.index is None:
                full[stack] = item.update
            else:
                shape = (group.plans[stack].num_blocks, *item.plan.block_shape)
                zeros = torch.zeros(shape, dtype=item.update.dtype, device=device)
                full[stack] = zeros.index_copy_(0, item.index, item.update)
        sizes = [plan.num_blocks * plan.block_shape[0] * plan.block_shape[1] for plan in group.plans]
        stacks = _end_to_end([full.get(stack) for stack in range(len(group.plans))], sizes, wire, device)
        send = stacks.index_select(0, group.update_send.positions())
        return self._start_all_to_all(
            send, group.pieces.split_sizes["updates_out"], group.pieces.split_sizes["updates_in"]
        )

    def reduce_max(self, values: Tensor) -> Tensor:
        reduced = values.to(self._device(), copy=True)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.process_group)
        return reduced.to(values.device)

    def gather_states(self, state: dict[Any, dict[str, Tensor]]) -> dict[Any, dict[str, Tensor]] | None:
        """Every rank's entries on rank 0: tiles are each one rank's; the buffers of
        one-dimensional parameters arrive sharded like them and are made whole first
        (collective: every rank holds the same ones, in the same order)."""
        whole = {
            key: {
                name: value.full_tensor().cpu() if isinstance(value, DTensor) else value
                for name, value in entry.items()
            }
            for key, entry in state.items()
        }
        gathered = self.gather_to_first(whole)
        if gathered is None:
            return None
        merged: dict[Any, dict[str, Tensor]] = {}
        for rank_state in gathered:
            for key, entry in rank_state.items():
                target = merged.setdefault(key, {})
                for name, value in entry.items():
                    target.setdefault(name, value)
        return merged
