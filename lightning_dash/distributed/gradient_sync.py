"""Gradient synchronisation for the Lightning strategy: counted all-reduce, or DeMo.

Both are DDP communication hooks, so they replace DDP's own all-reduce rather than
adding traffic: ``allreduce`` averages buckets as DDP would and counts the bytes of
a ring all-reduce; ``local`` leaves each rank's gradient local so that a DeMo
synchroniser can exchange compressed momentum components instead.
"""

# No ``from __future__ import annotations`` here: DDP inspects the hooks' annotations
# and expects the real ``dist.GradBucket`` and ``Future[torch.Tensor]`` objects.
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.futures import Future


@dataclass
class CommStats:
    """Bytes one rank sent and received for gradient synchronisation, and the bytes the
    optimizer's own block exchange sent (``optimizer_bytes_sent``), cumulative."""

    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    steps: int = 0
    optimizer_bytes_sent: float = 0.0

    def record(self, sent: float, received: float) -> None:
        self.bytes_sent += sent
        self.bytes_received += received

    def as_dict(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "steps": self.steps,
            "bytes_sent_per_step": self.bytes_sent / steps,
            "bytes_received_per_step": self.bytes_received / steps,
            "optimizer_bytes_sent_per_step": self.optimizer_bytes_sent / steps,
        }


def ring_allreduce_bytes(payload_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: ``2 (W - 1) / W`` payloads."""
    return 2.0 * (world_size - 1) / world_size * payload_bytes


def counting_allreduce_hook(stats: CommStats, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP's averaging all-reduce of one bucket, with its traffic added to ``stats``."""
    buffer = bucket.buffer()
    world_size = dist.get_world_size()
    traffic = ring_allreduce_bytes(buffer.numel() * buffer.element_size(), world_size)
    stats.record(traffic, traffic)
    buffer.div_(world_size)
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda future: future.value()[0])


def local_gradient_hook(stats: CommStats, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Keep the bucket's local gradient: no communication (DeMo synchronises later)."""
    future: Future[torch.Tensor] = Future()
    future.set_result(bucket.buffer())
    return future
