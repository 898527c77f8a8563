"""Recomputing the inverse roots that fall due, in line or on a side stream, behind one interface.

All due factors of one size are solved in one batched call (across stacks). A
block's new roots are accepted when both are finite and, for the Newton solvers,
both residuals are at most :func:`~lightning_dash.optim.roots.common.failure_residual`; otherwise the previous
roots stay and the block's failure streak grows.

:class:`RootRefresher` is what a step talks to, whatever the path:
:meth:`~RootRefresher.begin_step` (swap in side-stream roots before statistics
move), :meth:`~RootRefresher.refresh` (compute due roots into the step's candidate
state, on the synchronous path) and :meth:`~RootRefresher.launch` (start the side-
stream computation once the step is committed). Each returns what its roots' failures
are to be checked against, as a :class:`FailureReport`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dash.optim.roots import RootResult, RootSettings, failure_residual, inverse_root
from lightning_dash.optim.stacks import packed
from lightning_dash.optim.stacks.blocks import StackPlan
from lightning_dash.optim.stacks.layout import Layout
from lightning_dash.optim.stacks.state import StackState
from lightning_dash.optim.step.async_refresh import RootPipeline
from lightning_dash.optim.step.rules import per_block
from lightning_dash.optim.step.update import StackWork

#: ``solver(stacked factors, eps, settings, scale, min_eps)``, as
#: :func:`~lightning_dash.optim.roots.inverse_root`.
Solver = Callable[..., RootResult]


@dataclass
class FailureReport:
    """Per-stack ``[failed blocks, longest streak]`` tensors (not read back yet), and the
    plans with per-block streaks that name a parameter whose streak hit the limit."""

    failures: list[Tensor]
    streaks: list[tuple[StackPlan, Tensor]]


@dataclass
class RootRequest:
    """One batched solver call: every due factor of one size (a fresh, bias-corrected copy)."""

    inputs: Tensor
    eps: Tensor
    scale: Tensor
    min_eps: float
    pieces: list[tuple[int, str]]  # (target, "left" | "right") of each consecutive piece
    counts: list[int]  # blocks in each piece


@dataclass
class RootJob:
    """The roots due in one step: solver calls, and the (state, blocks) each result goes to."""

    targets: list[tuple[StackState, Tensor | None]]
    requests: list[RootRequest]


def committed_streaks(layout: Layout) -> list[tuple[StackPlan, Tensor]]:
    """Every stack's plan with its committed per-block root failure streaks."""
    return [(stack.plan, stack.state.root_failures) for stack in layout.stacks]


def root_inputs(work: StackWork, bias_correction: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Factors, scales (bias-corrected) and epsilon of the blocks whose roots are due."""
    counts = [work.plan.regions[k].num_blocks for k in work.due_regions]
    groups = [work.groups[k] for k in work.due_regions]
    device = work.state.left_pair.device
    left, right, scale = work.state.left_pair, work.state.right_pair, work.state.factor_scale
    if work.due is not None:
        left, right, scale = left[work.due], right[work.due], scale[work.due]
    left, right = packed.factors(left), packed.factors(right)  # new tensors, whatever happens to the state
    if bias_correction:
        correction = per_block(
            [
                1.0 - g["betas"][1] ** work.steps[k] if g["betas"][1] < 1 else 1.0
                for k, g in zip(work.due_regions, groups)
            ],
            counts,
            device,
            torch.float64,  # as the factor scales
        )
        scale = scale / correction
    # The damping in the statistics' dtype (a float32 epsilon moves float64 steps by about 1e-9).
    eps = per_block([g["epsilon"] for g in groups], counts, device, left.dtype)
    if not isinstance(eps, Tensor):
        eps = torch.full((left.shape[0],), eps, device=device, dtype=left.dtype)
    return left, right, scale, eps


def root_job(works: list[StackWork], bias_correction: bool, whole_stacks: bool) -> RootJob:
    """The due factors of ``works``, one request per size and dtype.

    Results go to each work's own candidate state (``whole_stacks=False``: this step)
    or to its stack's full state (``True``: installed at a later step, after the
    work's blocks were committed).
    """
    targets: list[tuple[StackState, Tensor | None]] = []
    sizes: dict[tuple[int, torch.dtype], tuple[list[Tensor], list[Tensor], list[Tensor], list[tuple[int, str]]]] = {}
    smallest: dict[tuple[int, torch.dtype], float] = {}
    for work in works:
        if not work.due_regions:
            continue
        left, right, scale, eps = root_inputs(work, bias_correction)
        target = len(targets)
        targets.append((work.stack.state, work.positions()) if whole_stacks else (work.state, work.due))
        for side, factor in (("left", left), ("right", right)):
            key = (factor.shape[1], factor.dtype)
            factors, scales, epsilons, pieces = sizes.setdefault(key, ([], [], [], []))
            smallest[key] = min([smallest.get(key, math.inf)] + [work.groups[k]["epsilon"] for k in work.due_regions])
            factors.append(factor)
            scales.append(scale)
            epsilons.append(eps)
            pieces.append((target, side))
    requests = [
        RootRequest(
            torch.cat(factors),
            torch.cat(epsilons),
            torch.cat(scales),
            smallest[key],
            pieces,
            [f.shape[0] for f in factors],
        )
        for key, (factors, scales, epsilons, pieces) in sizes.items()
    ]
    return RootJob(targets, requests)


def accept_roots(
    state: StackState, due: Tensor | None, left: Tensor, left_ok: Tensor, right: Tensor, right_ok: Tensor
) -> Tensor:
    """Keep new roots where both are acceptable, otherwise the previous ones; returns
    ``[failed blocks, longest streak]``. The state's pairs are replaced, never written in
    place (they may be shared with the committed state until the step commits)."""
    ok = left_ok & right_ok
    if due is None:
        state.left_pair = packed.with_roots(state.left_pair, left, ok)
        state.right_pair = packed.with_roots(state.right_pair, right, ok)
        state.root_valid = state.root_valid | ok
        state.root_failures = torch.where(ok, 0, state.root_failures + 1).to(torch.int32)
        streak = state.root_failures
    else:
        state.left_pair = state.left_pair.index_copy(0, due, packed.with_roots(state.left_pair[due], left, ok))
        state.right_pair = state.right_pair.index_copy(0, due, packed.with_roots(state.right_pair[due], right, ok))
        state.root_valid = state.root_valid.index_copy(0, due, state.root_valid[due] | ok)
        streak = torch.where(ok, 0, state.root_failures[due] + 1).to(torch.int32)
        state.root_failures = state.root_failures.index_copy(0, due, streak)
    return torch.stack([(~ok).sum(), streak.max()]).to(torch.int64)


class RootRefresher:
    """Computes the due inverse roots of a step, synchronously or on a side CUDA stream.

    The side-stream path is taken when ``asynchronous`` is set and :attr:`pipeline`
    handles the parameters' device (CUDA, or the pipeline's CPU emulation).

    Attributes:
        solver: the batched inverse-root function (:func:`~lightning_dash.optim.roots.solve.inverse_root`); a
            replacement with the same signature may be set (e.g. to inject failures).
        pipeline: the side-stream scheduler (:class:`~lightning_dash.optim.step.async_refresh.RootPipeline`).
        last_residual: largest Newton residual of the roots accepted in the latest step.
    """

    def __init__(self, settings: RootSettings, bias_correction: bool, asynchronous: bool, max_staleness: int) -> None:
        self.settings = settings
        self.bias_correction = bias_correction
        self.asynchronous = asynchronous
        self.pipeline = RootPipeline(max_staleness)
        self.solver: Solver = inverse_root
        self.last_residual: Tensor | None = None

    def streamed(self, layout: Layout) -> bool:
        """Whether this layout's roots go through the side stream (the same on every rank)."""
        return self.asynchronous and bool(layout.params) and self.pipeline.handles(layout.params[0].device)

    def begin_step(self, layout: Layout, roots_due: bool) -> FailureReport | None:
        """Before statistics move: swap in side-stream roots that are ready or due; a
        report when the open launch closed (its failures count in this step)."""
        if self.streamed(layout) and self.pipeline.begin_step(roots_due, self.install):
            return FailureReport(self.pipeline.take_failures(), committed_streaks(layout))
        return None

    def refresh(self, layout: Layout, works: list[StackWork], roots_due: bool) -> FailureReport | None:
        """Synchronous path: recompute the due roots into the works' candidate states."""
        if not roots_due or self.streamed(layout):
            return None
        job = root_job(works, self.bias_correction, whole_stacks=False)
        failures = self.install(job, self._solve(job))
        return FailureReport(failures, [(work.plan, work.state.root_failures) for work in works])

    def launch(self, layout: Layout, works: list[StackWork], roots_due: bool) -> None:
        """Side-stream path, after the step committed: start computing its due roots."""
        if not roots_due or not self.streamed(layout):
            return
        job = root_job(works, self.bias_correction, whole_stacks=True)
        snapshots = [t for request in job.requests for t in (request.inputs, request.eps, request.scale)]
        self.pipeline.launch(job, snapshots, lambda: self._solve(job), layout.params[0].device)

    def settle(self, layout: Layout | None, collective: bool) -> FailureReport | None:
        """Swap pending side-stream roots in now, so saved or exported state holds them.

        ``collective``: every rank calls this together, so the launch is closed here and a
        report returned; otherwise it is closed at its usual step.
        """
        if layout is None or not self.pipeline.pending:
            return None
        if self.pipeline.settle(self.install, close=collective):
            return FailureReport(self.pipeline.take_failures(), committed_streaks(layout))
        return None

    def discard(self) -> None:
        """Drop roots in flight (the state they were computed from is being replaced)."""
        self.pipeline.discard()

    def _solve(self, job: RootJob) -> list[RootResult]:
        return [
            self.solver(request.inputs, request.eps, self.settings, request.scale, request.min_eps)
            for request in job.requests
        ]

    def install(self, job: RootJob, solved: list[RootResult]) -> list[Tensor]:
        """Accept solved roots into their targets; returns their failure tensors."""
        residuals = [result.residual.max() for result in solved if result.residual is not None]
        self.last_residual = torch.stack(residuals).max() if residuals else None
        limit = failure_residual(self.settings)
        pieces: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        for request, result in zip(job.requests, solved):
            ok = torch.isfinite(result.root).all(dim=(1, 2))
            if result.residual is not None:
                ok = ok & (result.residual <= limit)
            pieces.update(zip(request.pieces, zip(result.root.split(request.counts), ok.split(request.counts))))
        return [
            accept_roots(state, due, *pieces[(target, "left")], *pieces[(target, "right")])
            for target, (state, due) in enumerate(job.targets)
        ]
