"""A :class:`~lightning_dash.optim.distributor.BlockDistributor` for parameters FSDP2 shards by rows.

Each rank holds a row shard of every parameter and, after FSDP2's reduce-scatter, the
same rows of its gradient. Blocks are cut from the whole parameters (as in one
process) and owned by ranks as under DDP (greedy LPT over the FLOP cost model). Each
step, one ``all_to_all`` carries the gradient rows of every block to its owner, the
owner updates its statistics and computes the block's update, and a second
``all_to_all`` carries the update rows back to the ranks that hold them
(:mod:`.row_exchange`). No rank materialises a whole parameter. One-dimensional
parameters are updated elementwise on each rank's own shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from lightning_dash.distributed.process_group import ProcessGroupDistributor, wire_dtype
from lightning_dash.distributed.row_exchange import RowExchange, Runs, holder_preferences, plan_rank, row_range
from lightning_dash.optim.distributor import BlockUpdate, masked
from lightning_dash.optim.stacks import GRAFTING_RMS, MOMENTUM, Region, StackPlan, working_dtype


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def check_row_sharded(params: list[Tensor], names: list[str] | None, world_size: int) -> None:
    """Refuse parameters that are not sharded by rows over ``world_size`` ranks (FSDP2's
    ``fully_shard`` on a one-dimensional mesh), naming the first one."""
    for index, param in enumerate(params):
        name = names[index] if names else f"parameter {index} {tuple(param.shape)}"
        if not isinstance(param, DTensor):
            raise ValueError(
                f"{name} is not sharded (a plain tensor): with strategy 'dash_fsdp' every parameter must "
                "belong to a module passed to fully_shard (shard the root module last)"
            )
        mesh = param.device_mesh
        if mesh.ndim != 1 or mesh.size() != world_size or tuple(param.placements) != (Shard(0),):
            raise ValueError(
                f"{name} is placed as {param.placements} on a mesh of shape {tuple(mesh.shape)}: DASH supports "
                f"FSDP2 row sharding (Shard(0)) over a one-dimensional mesh of {world_size} ranks"
            )


def _end_to_end(tensors: list[Tensor | None], sizes: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``tensors`` flattened and laid end to end in ``dtype``, zeros where one is None
    (``sizes``: their numbers of elements); one ``cat``, however many tensors."""
    missing = max((size for tensor, size in zip(tensors, sizes) if tensor is None), default=0)
    zeros = torch.zeros(missing, dtype=dtype, device=device) if missing else None
    parts = [zeros[:size] if tensor is None else tensor.reshape(-1) for tensor, size in zip(tensors, sizes)]
    return torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype, device=device)


@dataclass(frozen=True)
class _RankExchange:
    """This rank's part of the row exchange: the plan, its stacks, and the row runs of both sides."""

    rows: RowExchange
    plans: list[StackPlan]
    holder_runs: Runs
    owner_runs: Runs


class _RowUpdates:
    """The update rows this rank holds, received from the blocks' owners."""

    def __init__(self, exchange: RowExchange, positions: Tensor, received: Tensor) -> None:
        self.exchange = exchange
        self.positions = positions
        self.received = received

    def tensors(self) -> list[Tensor]:
        return [self.received]

    def apply(self, params: list[Tensor], skip: Tensor) -> None:
        """Scatter the received rows into this rank's shards end to end, then add them to
        the parameters with one ``_foreach_add_`` per parameter dtype."""
        received = masked(self.received, skip)
        held = self.exchange.held
        flat = received.new_zeros(self.exchange.held_numel).index_copy_(0, self.positions, received)
        by_dtype: dict[torch.dtype, tuple[list[Tensor], list[tuple[int, int]]]] = {}
        for index, span in held.items():
            local = _local(params[index])
            targets, spans = by_dtype.setdefault(local.dtype, ([], []))
            targets.append(local.view(-1))
            spans.append(span)
        for dtype, (targets, spans) in by_dtype.items():
            cast = flat.to(dtype)
            torch._foreach_add_(targets, [cast[offset : offset + numel] for offset, numel in spans])


class ShardedDistributor(ProcessGroupDistributor):
    """Block ownership and the two row exchanges of DASH on FSDP2-sharded parameters.

    Args:
        process_group: the group the parameters are sharded over (None: the default group).
        communication_dtype: dtype of the update rows sent back (float32 keeps the result
            equal to a single process's; bfloat16/float16 halve that traffic). Gradient
            rows travel in the statistics' dtype.
        root_iterations: iterations per root, for the cost model.
    """

    shards_parameters = True
    #: This rank's part of the exchange for the current layout (planned with the stacks).
    _exchange: _RankExchange | None = None

    # ------------------------------------------------------------------ placement
    def local(self, tensor: Tensor) -> Tensor:
        return _local(tensor)

    def local_part(self, param: Tensor, value: Tensor) -> Tensor:
        if isinstance(value, DTensor) or not isinstance(param, DTensor) or value.shape != param.shape:
            return _local(value)
        start, end = row_range(param.shape[0], self.world_size, self.rank)
        return value[start:end]

    def shard_like(self, param: Tensor, local: Tensor) -> Tensor:
        if not isinstance(param, DTensor):
            return local
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    def plan_stacks(self, regions: list[Region], params: list[Tensor], frequencies: list[int]) -> list[StackPlan]:
        check_row_sharded(params, None, self.world_size)
        tiles = [(tile, frequency) for region, frequency in zip(regions, frequencies) for tile in region.single_tiles()]
        owners = self.assign_owners(
            keys=[(t.param_index, t.row_start, t.col_start) for t, _ in tiles],
            shapes=[t.block_shape for t, _ in tiles],
            frequencies=[frequency for _, frequency in tiles],
            preferred=holder_preferences(regions, params, self.world_size),
        )
        rank_plans, rows = plan_rank(regions, params, owners, self.world_size, self.rank)
        plans = rank_plans[self.rank]
        device = self._device()
        self._exchange = _RankExchange(rows, plans, rows.holder_runs().to(device), rows.owner_runs(plans).to(device))
        return plans

    @property
    def elements_per_step(self) -> int:
        """Elements this rank sends to others in one step (0 before the first step)."""
        return 0 if self._exchange is None else self._exchange.rows.elements_sent()

    # ------------------------------------------------------------------ exchanges
    def _all_to_all(self, send: Tensor, send_sizes: list[int], receive_sizes: list[int]) -> Tensor:
        received = send.new_empty(sum(receive_sizes))
        dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=self.process_group)
        self.bytes_sent += (sum(send_sizes) - send_sizes[self.rank]) * send.element_size()
        return received

    def block_gradients(self, plans: list[StackPlan], params: list[Tensor]) -> list[Tensor]:
        """Send the gradient rows this rank holds to the blocks' owners; receive its blocks'.
        One gather before the ``all_to_all`` and one scatter after it, whatever the model."""
        exchange = self._exchange
        rows = exchange.rows
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        device = self._device()
        grads = [None if params[index].grad is None else _local(params[index].grad) for index in rows.held]
        held = _end_to_end(grads, [numel for _, numel in rows.held.values()], dtype, device)
        send = held.index_select(0, exchange.holder_runs.positions())
        received = self._all_to_all(send, rows.outgoing_sizes, rows.incoming_sizes)
        flat = received.new_empty(exchange.owner_runs.total).index_copy_(0, exchange.owner_runs.positions(), received)
        stacks, offset = [], 0
        for plan in plans:
            numel = plan.num_blocks * plan.block_shape[0] * plan.block_shape[1]
            stack = flat[offset : offset + numel].view(plan.num_blocks, *plan.block_shape)
            stacks.append(stack.to(working_dtype(params[plan.regions[0].param_index])))
            offset += numel
        return stacks

    def share_updates(self, updates: list[BlockUpdate]) -> _RowUpdates:
        """Send each block's update rows to the ranks that hold them; receive this rank's.
        One gather before the ``all_to_all``; :meth:`_RowUpdates.apply` scatters after it."""
        exchange = self._exchange
        device = self._device()
        full: dict[int, Tensor] = {}
        for item in updates:
            if item.index is None:
                full[item.stack] = item.update
            else:
                shape = (exchange.plans[item.stack].num_blocks, *item.plan.block_shape)
                stack = torch.zeros(shape, dtype=item.update.dtype, device=device)
                full[item.stack] = stack.index_copy_(0, item.index, item.update)
        widest = torch.float64 if any(item.update.dtype == torch.float64 for item in updates) else torch.float32
        sizes = [plan.num_blocks * plan.block_shape[0] * plan.block_shape[1] for plan in exchange.plans]
        stacks = _end_to_end([full.get(stack) for stack in range(len(exchange.plans))], sizes, widest, device)
        send = stacks.index_select(0, exchange.owner_runs.positions()).to(wire_dtype(self.communication_dtype, widest))
        received = self._all_to_all(send, exchange.rows.incoming_sizes, exchange.rows.outgoing_sizes)
        return _RowUpdates(exchange.rows, exchange.holder_runs.positions(), received)

    def reduce_max(self, values: Tensor) -> Tensor:
        reduced = values.to(self._device(), copy=True)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.process_group)
        return reduced.to(values.device)

    def gather_states(self, state: dict[Any, dict[str, Tensor]]) -> dict[Any, dict[str, Tensor]] | None:
        """Every rank's entries on rank 0: tiles are each one rank's; the row shards of
        one-dimensional parameters' buffers are concatenated in rank order."""
        gathered = self.gather_to_first(state)
        if gathered is None:
            return None
        merged: dict[Any, dict[str, Tensor]] = {}
        for rank_state in gathered:
            for key, entry in rank_state.items():
                target = merged.setdefault(key, {})
                for name, value in entry.items():
                    if name in (MOMENTUM, GRAFTING_RMS) and name in target:
                        target[name] = torch.cat([target[name], value])
                    else:
                        target.setdefault(name, value)
        return merged
