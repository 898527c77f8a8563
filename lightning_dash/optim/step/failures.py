"""Counting rejected inverse roots, and stopping once a block keeps failing."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dash.optim.distributor import BlockDistributor
from lightning_dash.optim.step.refresh import FailureReport


class RootComputationError(RuntimeError):
    """A block's inverse root failed ``max_consecutive_root_failures`` times in a row."""


def failure_summary(report: FailureReport, distributor: BlockDistributor, device: torch.device) -> Tensor:
    """``[failed roots, longest streak]`` of ``report`` over all ranks, on ``device`` (not
    read back; collective when blocks are owned by several ranks)."""
    local = torch.stack(report.failures).float() if report.failures else torch.zeros(1, 2, device=device)
    summary = torch.stack([local[:, 0].sum(), local[:, 1].max()]).to(device)
    return distributor.reduce_failures(summary)


def raise_on_streak(report: FailureReport, names: list[str], longest: int, limit: int | None, method: str) -> None:
    """Raise :class:`RootComputationError` once the longest streak (over all ranks)
    reaches ``limit``, naming the parameter when this rank holds the block.

    Every rank sees the same ``longest``, so every rank raises together. The host
    learns a step's streaks when it reads that step's verdict back, at the next step,
    and raises there before that step changes anything: the step in which the streak
    reached the limit was applied with the blocks' previous roots.
    """
    if limit is None or longest < limit:
        return
    for plan, streak in report.streaks:
        streak = streak.cpu()
        for region in plan.regions:
            block = region.stack_offset
            if int(streak[block : block + region.num_blocks].max()) >= limit:
                raise RootComputationError(
                    f"inverse root of {names[region.param_index]} failed {limit} times in a row "
                    f"(method={method}); try a larger epsilon, a lower lr, or 'eigh'"
                )
    raise RootComputationError(
        f"an inverse root owned by another rank failed {limit} times in a row "
        f"(method={method}); that rank names the parameter"
    )
