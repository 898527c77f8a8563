"""A :class:`~lightning_dash.optim.distributor.BlockDistributor` over a torch process group."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dash.distributed.assignment import block_cost, plan_ownership
from lightning_dash.optim.validation import check_communication_dtype


class ProcessGroupDistributor:
    """Block ownership by greedy LPT over a FLOP cost model, and gloo/NCCL collectives.

    Args:
        process_group: the data-parallel group (None: the default group).
        communication_dtype: dtype of the all-gathered block updates; float32 keeps
            every rank's parameters equal to a single-process run, bfloat16/float16
            halve the traffic (every rank still applies the same rounded update).
        root_iterations: iterations per root, for the cost model.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        communication_dtype: torch.dtype = torch.float32,
        root_iterations: int = 10,
    ) -> None:
        self.process_group = process_group
        self.communication_dtype = check_communication_dtype(communication_dtype)
        self.root_iterations = root_iterations
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._owners: dict[Hashable, int] = {}
        self._costs: dict[Hashable, float] = {}
        self.bytes_gathered = 0

    def assign_owners(
        self, keys: Sequence[Hashable], shapes: Sequence[tuple[int, int]], frequencies: Sequence[int]
    ) -> list[int]:
        """Owner of each block; earlier assignments are kept, new blocks are placed by LPT
        on top of the existing loads."""
        costs = [block_cost(rows, cols, frequency, self.root_iterations)
                 for (rows, cols), frequency in zip(shapes, frequencies)]
        new = [i for i, key in enumerate(keys) if key not in self._owners]
        if len(new) == len(keys):
            plan = plan_ownership(costs, self.world_size)
            owners = list(plan.owners)
        else:
            loads = [0.0] * self.world_size
            for key, owner in self._owners.items():
                loads[owner] += self._costs[key]
            owners = [self._owners.get(key, -1) for key in keys]
            for index in sorted(new, key=lambda i: (-costs[i], i)):
                rank = min(range(self.world_size), key=lambda r: (loads[r], r))
                owners[index] = rank
                loads[rank] += costs[index]
        self._owners = dict(zip(keys, owners))
        self._costs = dict(zip(keys, costs))
        return owners

    @property
    def balance(self) -> float:
        loads = [0.0] * self.world_size
        for key, owner in self._owners.items():
            loads[owner] += self._costs[key]
        total = sum(loads)
        return 1.0 if total == 0 else max(loads) / (total / self.world_size)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        send = tensor.to(self.communication_dtype)
        received = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(received, send, group=self.process_group)
        self.bytes_gathered += send.numel() * send.element_size() * self.world_size
        return [part.to(tensor.dtype) for part in received]

    def gather_to_first(self, obj: Any) -> Optional[list[Any]]:
        gathered: Optional[list[Any]] = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=dist.get_global_rank(self.process_group, 0)
                           if self.process_group is not None else 0, group=self.process_group)
        return gathered


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
