"""What DASH needs from a data-parallel runtime, as a protocol.

The optimizer never imports ``torch.distributed``: a trainer integration hands it
an object with this interface (``lightning_dash.distributed`` provides one over a
process group). All methods are collective unless stated otherwise, and every
rank calls them in the same order with the same metadata.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Optional, Protocol

from torch import Tensor


class BlockDistributor(Protocol):
    """Block ownership and the collectives of ZeRO-1-style DASH."""

    rank: int
    world_size: int

    def assign_owners(
        self, keys: Sequence[Hashable], shapes: Sequence[tuple[int, int]], frequencies: Sequence[int]
    ) -> list[int]:
        """Owner rank of each block (not collective: deterministic on every rank).

        Blocks whose key was assigned before keep their owner, so their state
        stays where it is when parameters are added during training.
        """
        ...

    @property
    def balance(self) -> float:
        """max / mean of the per-rank cost of the current assignment."""
        ...

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's equally sized float32 ``tensor`` (sent in the communication dtype)."""
        ...

    def gather_to_first(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's picklable ``obj`` on rank 0 (None elsewhere)."""
        ...
