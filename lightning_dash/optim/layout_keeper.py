"""Where DASH's statistics live between steps: stacked while it trains, per parameter otherwise.

The stacks (:mod:`~lightning_dash.optim.stacks.layout`) are built on first use from the
optimizer's per-parameter ``state``, with the blocks the distributor gives this process.
Whatever changes the stacks (new parameter groups, another distributor, another model
description, a loaded checkpoint) first moves their statistics back into ``state``, so
that nothing is lost and the next step rebuilds them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.distributor import BlockDistributor
from lightning_dash.optim.stacks.blocks import MatrixView
from lightning_dash.optim.stacks.layout import Layout, export_layout, stack_state
from lightning_dash.optim.step.bookkeeping import StepBookkeeping
from lightning_dash.optim.step.failures import failure_summary
from lightning_dash.optim.step.refresh import RootRefresher


class LayoutKeeper:
    """The stacked state of one optimizer, its distributor, and the moves between the two forms.

    Args:
        distributor: block ownership across data-parallel ranks.
        block_size: the side of the tiles.
        roots: the root computation, whose pending side-stream roots are settled before the
            stacks are read or retired.
        books: where rejected roots found while settling are counted.
    """

    def __init__(
        self, distributor: BlockDistributor, block_size: int, roots: RootRefresher, books: StepBookkeeping
    ) -> None:
        if not all(hasattr(distributor, name) for name in ("world_size", "plan_stacks", "exchange_blocks")):
            raise TypeError(
                "distributor must be a BlockDistributor (ProcessGroupDistributor, ShardedDistributor) or None, "
                f"got {type(distributor).__name__}"
            )
        self.distributor = distributor
        self.block_size = block_size
        self.roots = roots
        self.books = books
        #: The stacks while training (None before the first step and after :meth:`retire`).
        self.layout: Layout | None = None

    def build(
        self,
        param_groups: list[dict[str, Any]],
        state: dict[Tensor, dict[str, Any]],
        views: list[MatrixView | None],
        second_moment: bool,
    ) -> Layout:
        """Move the statistics of ``state`` into new stacks (``views``: how each parameter is
        preconditioned; ``second_moment``: whether the grafting keeps one)."""
        self.layout = stack_state(
            param_groups, state, views, self.distributor, self.block_size, want_second_moment=second_moment
        )
        return self.layout

    def retire(self, state: dict[Tensor, dict[str, Any]]) -> None:
        """Move the stacked statistics back into ``state`` so that the stacks can be rebuilt."""
        self.settle(collective=False)
        layout = self.layout
        if layout is None:
            return
        # Sharded parameters: per-tile entries, so no rank builds a whole parameter-shaped buffer.
        for index, entry in export_layout(layout, tiles=self.distributor.shards_parameters).items():
            state[layout.params[index]].update(entry)
        self.layout = None

    def settle(self, collective: bool) -> None:
        """Collect the latest verdict and swap pending side-stream roots in, so saved or
        exported state holds them (reads values back: not for the step's hot path)."""
        self.books.verdicts.collect()
        layout = self.layout
        report = self.roots.settle(layout, collective or self.distributor.world_size == 1)
        if report is not None and layout is not None:
            device = layout.params[0].device if layout.params else torch.device("cpu")
            failed, longest = failure_summary(report, self.distributor, device).tolist()
            self.books.add_failures(int(failed), int(longest))
