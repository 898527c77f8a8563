"""A :class:`~lightning_dash.optim.distributor.BlockDistributor` over a torch process group."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dash.distributed.assignment import block_cost, imbalance, lpt_assign
from lightning_dash.distributed.block_exchange import (
    ExchangePlan,
    GatheredUpdates,
    merge_rank_states,
    pack_updates,
    plan_exchange,
)
from lightning_dash.optim.distributor import BlockUpdate, WholeParameters
from lightning_dash.optim.stacks import Region, StackPlan
from lightning_dash.optim.validation import check_communication_dtype, check_int


def wire_dtype(communication_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype updates of ``dtype`` travel in: ``communication_dtype``, except that the
    float32 default carries float64 updates as they are (it promises a single process's result)."""
    return dtype if communication_dtype == torch.float32 and dtype == torch.float64 else communication_dtype


class ProcessGroupDistributor(WholeParameters):
    """Block ownership by greedy LPT over a FLOP cost model, and gloo/NCCL collectives,
    for ranks that hold whole parameters and identical gradients (DDP).

    Args:
        process_group: the data-parallel group (None: the default group).
        communication_dtype: dtype of the all-gathered block updates; float32 keeps
            every rank's parameters equal to a single-process run, bfloat16/float16
            halve the traffic (every rank still applies the same rounded update).
        root_iterations: iterations per root, for the cost model.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        communication_dtype: torch.dtype = torch.float32,
        root_iterations: int = 10,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {process_group!r}")
        self.process_group = process_group
        self.communication_dtype = check_communication_dtype(communication_dtype)
        self.root_iterations = check_int("root_iterations", root_iterations, low=1)
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._owners: dict[Hashable, int] = {}
        self._costs: dict[Hashable, float] = {}
        self._exchange: ExchangePlan | None = None
        #: Bytes this rank sent to other ranks in the optimizer's block exchanges (cumulative;
        #: the few bytes of the per-step agreement collectives are not counted).
        self.bytes_sent = 0

    def _loads(self) -> list[float]:
        loads = [0.0] * self.world_size
        for key, owner in self._owners.items():
            loads[owner] += self._costs[key]
        return loads

    @property
    def balance(self) -> float:
        """max / mean of the per-rank cost of the current ownership."""
        return imbalance(self._loads())

    def assign_owners(
        self,
        keys: list[Hashable],
        shapes: list[tuple[int, int]],
        frequencies: list[int],
        preferred: list[int | None] | None = None,
    ) -> list[int]:
        """Owner of each block (not collective); blocks seen before keep their owner, new
        ones are placed by LPT on top of the existing loads, each on its ``preferred`` rank
        (where its data already is) when that rank is among the least loaded."""
        costs = [
            block_cost(rows, cols, frequency, self.root_iterations)
            for (rows, cols), frequency in zip(shapes, frequencies)
        ]
        new = [i for i, key in enumerate(keys) if key not in self._owners]
        wanted = None if preferred is None else [preferred[i] for i in new]
        placed = lpt_assign([costs[i] for i in new], self.world_size, self._loads(), wanted)
        owners = [self._owners.get(key, -1) for key in keys]
        for index, owner in zip(new, placed):
            owners[index] = owner
        self._owners = dict(zip(keys, owners))
        self._costs = dict(zip(keys, costs))
        return owners

    def plan_stacks(
        self, regions: list[Region], params: list[Tensor], frequencies: list[int], names: list[str] | None = None
    ) -> list[StackPlan]:
        tiles = [(tile, frequency) for region, frequency in zip(regions, frequencies) for tile in region.single_tiles()]
        owners = self.assign_owners(
            keys=[(t.param_index, t.row_start, t.col_start) for t, _ in tiles],
            shapes=[t.block_shape for t, _ in tiles],
            frequencies=[frequency for _, frequency in tiles],
        )
        self._exchange = plan_exchange(regions, params, owners, self.world_size)
        return self._exchange.plans[self.rank]

    def share_updates(self, updates: list[BlockUpdate]) -> GatheredUpdates:
        """All-gather every rank's flat update buffer (in ``communication_dtype``)."""
        device = updates[0].update.device if updates else self._device()
        local = pack_updates(self._exchange, self.rank, updates, device)
        gathered = self.all_gather(local)
        wire = wire_dtype(self.communication_dtype, local.dtype)
        self.bytes_sent += (self.world_size - 1) * local.numel() * wire.itemsize  # a ring all-gather
        return GatheredUpdates(self._exchange, gathered)

    def reduce_failures(self, summary: Tensor) -> Tensor:
        gathered = torch.stack(self.all_gather(summary.to(self._device())))
        return torch.stack([gathered[:, 0].sum(), gathered[:, 1].max()])

    def gather_states(self, state: dict[int, dict[str, Tensor]]) -> dict[int, dict[str, Tensor]] | None:
        gathered = self.gather_to_first(state)
        return None if gathered is None else merge_rank_states(gathered)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's equally sized ``tensor`` (sent in the communication dtype)."""
        send = tensor.to(wire_dtype(self.communication_dtype, tensor.dtype))
        received = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(received, send, group=self.process_group)
        return [part.to(tensor.dtype) for part in received]

    def gather_to_first(self, obj: Any) -> list[Any] | None:
        """Every rank's picklable ``obj`` on rank 0 (None elsewhere)."""
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        destination = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.gather_object(obj, gathered, dst=destination, group=self.process_group)
        return gathered

    def _device(self) -> torch.device:
        """Where this group's collectives run: the current CUDA device for NCCL, else the CPU."""
        if dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def shard_across_ranks(optimizer: Any, communication_dtype: torch.dtype = torch.float32) -> bool:
    """Give ``optimizer`` (a DASH) a :class:`ProcessGroupDistributor` over the default
    process group when one with several ranks is running; returns whether it did.

    Both trainer integrations call this after converting the user's optimizer, so
    Lightning and Composer runs share one ownership plan and one all-gather.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    optimizer.distributor = ProcessGroupDistributor(
        communication_dtype=communication_dtype, root_iterations=optimizer.root_settings.iterations or 10
    )
    return True
