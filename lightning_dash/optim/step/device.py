"""One optimizer step as the device runs it: candidates, a verdict, a masked commit.

Every new statistic, root and update is computed into fresh tensors first. The device
then decides whether the step is applied (every gradient and every update finite, on
every rank) and writes the candidates into the state and the parameters with
``torch.where(skip, old, new)``: a step is applied whole or not at all, and the host
never waits for the decision. It learns it one step later (:mod:`.verdict`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.distributor import BlockDistributor, BlockUpdate
from lightning_dash.optim.precision import TENSOR_CORE_PRECISIONS, cuda_matmuls
from lightning_dash.optim.stacks.layout import Layout
from lightning_dash.optim.step.commit import any_nonfinite, decay_weights, local_peaks
from lightning_dash.optim.step.failures import failure_summary
from lightning_dash.optim.step.refresh import FailureReport, RootRefresher
from lightning_dash.optim.step.rules import UpdateRules
from lightning_dash.optim.step.schedule import roots_due
from lightning_dash.optim.step.update import StackWork, begin_stack, stack_direction
from lightning_dash.optim.step.vectors import vector_work


def step_on_device(
    layout: Layout,
    active: set[int],
    groups: list[dict[str, Any]],
    rules: UpdateRules,
    roots: RootRefresher,
    distributor: BlockDistributor,
) -> Tensor:
    """Run one step of the ``active`` parameters; returns its verdict vector
    ``[gradient not finite, update not finite, failed roots, longest failure streak]``
    on the device (see :mod:`.verdict`), the same on every rank. CUDA float32 matmuls run on
    TF32 tensor cores or in IEEE float32 as ``rules.matmul_precision`` says, whatever the
    process's own setting."""
    device = layout.params[min(active)].device
    tf32 = rules.matmul_precision in TENSOR_CORE_PRECISIONS
    with cuda_matmuls(tf32) if device.type == "cuda" else nullcontext():
        due = any(
            layout.preconditioned(i) and roots_due(layout.steps[i], groups[layout.group_of[i]], rules.root_schedule)
            for i in active
        )
        # Side-stream roots swap in before any statistics move (and before blocks are copied out).
        installed = roots.begin_step(layout, due)
        grad_bad = (~torch.isfinite(local_peaks(layout, active, device))).any().to(torch.float32)
        vectors = [vector_work(layout, vector, groups[vector.group_index], active, rules) for vector in layout.vectors]
        vectors = [work for work in vectors if work is not None]
        works: list[StackWork] = []
        reports: list[FailureReport] = []

        def compute(positions: list[int], grads: list[Tensor]) -> list[BlockUpdate]:
            begun = [
                (p, begin_stack(layout, layout.stacks[p], g, groups, active, rules)) for p, g in zip(positions, grads)
            ]
            placed = [(p, work) for p, work in begun if work is not None]
            report = roots.refresh(layout, [work for _, work in placed], due)
            reports.extend([report] if report is not None else [])
            works.extend(work for _, work in placed)
            return [BlockUpdate(p, work.plan, work.index, stack_direction(work, rules)) for p, work in placed]

        shared = distributor.exchange_blocks([stack.plan for stack in layout.stacks], layout.params, compute)
        refreshed = _merged(reports)
        update_bad = any_nonfinite(shared.tensors() + [work.update for work in vectors], device)
        flags = distributor.reduce_max(torch.stack([grad_bad, update_bad]))
        skip = flags.amax() > 0
        decay_weights(layout, groups, active, skip, rules.decay_vectors)
        for work in vectors:
            work.commit(skip)
            work.apply(skip)
        for work in works:
            work.commit(skip)
        shared.apply(layout.params, skip)
        roots.launch(layout, works, due)
        failures = _failures(installed, distributor, device)
        if refreshed is not None:
            # Roots of a skipped step were not committed, so they neither count nor lengthen a streak.
            fresh = failure_summary(refreshed, distributor, device) * (~skip).to(torch.float32)
            failures = torch.stack([failures[0] + fresh[0], torch.maximum(failures[1], fresh[1])])
        return torch.cat([flags, failures])


def _merged(reports: list[FailureReport]) -> FailureReport | None:
    """The reports of a step's micro-groups as one (None: no roots were computed)."""
    if not reports:
        return None
    return FailureReport([f for r in reports for f in r.failures], [s for r in reports for s in r.streaks])


def _failures(report: FailureReport | None, distributor: BlockDistributor, device: torch.device) -> Tensor:
    if report is None:
        return torch.zeros(2, device=device)
    return failure_summary(report, distributor, device)
