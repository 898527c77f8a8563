"""The update maths of one optimizer step per stack of blocks (the one-dimensional parameters'
maths is :mod:`.vectors`; the rules and per-block values both share are in :mod:`.rules`).

Each function computes *candidates*: new statistics and the update, in fresh
tensors, without touching the committed state. :meth:`StackWork.commit` makes them
the state once the whole step has been checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_dash.optim import precision
from lightning_dash.optim.stacks import packed
from lightning_dash.optim.stacks.blocks import StackPlan
from lightning_dash.optim.stacks.layout import Layout, Stack
from lightning_dash.optim.stacks.state import GRAFTING_RMS, MOMENTUM, StackState
from lightning_dash.optim.stacks.uploads import upload_runs
from lightning_dash.optim.step.commit import commit_masked
from lightning_dash.optim.step.compiled import kernel
from lightning_dash.optim.step.factors import accumulate_factors
from lightning_dash.optim.step.grafting import GRAFTS, grafting_direction, next_rms, uses_second_moment
from lightning_dash.optim.step.rules import PerBlock, UpdateRules, block_table, momentum_terms, next_momentum, per_block
from lightning_dash.optim.step.schedule import roots_due

if TYPE_CHECKING:
    pass


@dataclass
class StackWork:
    """The blocks of one stack that move in the current step, with their candidate state."""

    stack: Stack
    plan: StackPlan
    index: Tensor | None
    state: StackState
    momentum: Tensor
    steps: list[int]
    groups: list[dict[str, Any]]
    due: Tensor | None
    due_regions: list[int]

    def commit(self, skip: Tensor) -> None:
        """Write the candidate state into the stack's tensors, in place, unless ``skip``
        (a 0-d bool on the device) is set: no host read decides it."""
        committed = self.stack.state
        for name, candidate in self.state.named_fields():
            current = getattr(committed, name)
            if candidate is None or (candidate is current and self.index is None):
                continue
            commit_masked(current if current is not None else committed.ensure(name), candidate, self.index, skip)

    def positions(self) -> Tensor | None:
        """Positions in the whole stack of the due blocks (None: every block)."""
        if self.index is None:
            return self.due
        return self.index if self.due is None else self.index[self.due]


def begin_stack(
    layout: Layout, stack: Stack, grads: Tensor, groups: list[dict[str, Any]], active: set[int], rules: UpdateRules
) -> StackWork | None:
    """Candidate factors, second moment and momentum of the moving blocks of one stack
    (``grads``: the gradient of every block of the stack)."""
    regions = [r for r in stack.plan.regions if r.param_index in active]
    if not regions:
        return None
    if len(regions) == len(stack.plan.regions):
        plan, index, state = stack.plan, None, stack.state.copy()
    else:
        plan, index = stack.subset(tuple(r.param_index for r in regions))
        state = stack.state.select(index)
    device = state.left_pair.device
    grad = grads if index is None else grads.index_select(0, index)
    counts = [r.num_blocks for r in plan.regions]
    region_groups = [groups[layout.group_of[r.param_index]] for r in plan.regions]
    steps = [layout.steps[r.param_index] for r in plan.regions]
    betas1 = [g["betas"][0] for g in region_groups]
    columns = [
        betas1,
        [g["betas"][1] for g in region_groups],
        [g["grafting_beta2"] for g in region_groups],
        momentum_terms(rules, steps, betas1),
    ]
    scalars = block_table(columns, counts, device, state.left_pair.dtype, rules.compiled)
    momentum = state.ensure(MOMENTUM) if any(b > 0 for b in betas1) else None
    rms = state.ensure(GRAFTING_RMS) if uses_second_moment(rules.grafting) else state.grafting_rms
    (state.left_pair, state.right_pair, state.factor_scale, state.momentum, followed, state.grafting_rms) = kernel(
        advance_blocks, rules.compiled
    )(grad, state.left_pair, state.right_pair, state.factor_scale, momentum, rms, *scalars, rules)

    due_regions = [k for k, (t, g) in enumerate(zip(steps, region_groups)) if roots_due(t, g, rules.root_schedule)]
    due = None
    if due_regions and len(due_regions) < len(plan.regions):
        due = upload_runs([(plan.regions[k].stack_offset, counts[k]) for k in due_regions], device)
    return StackWork(stack, plan, index, state, followed, steps, region_groups, due, due_regions)


def advance_blocks(
    grad: Tensor,
    left_pair: Tensor,
    right_pair: Tensor,
    scale: Tensor,
    momentum: Tensor | None,
    rms: Tensor | None,
    beta1: PerBlock,
    beta2: PerBlock,
    graft_beta2: PerBlock,
    first_term: PerBlock,
    rules: UpdateRules,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    """One step of a stack's statistics (pure): new factor pairs (:mod:`...stacks.packed`), scale,
    momentum, the bias-corrected momentum the step follows, and the grafting second-moment root."""
    decay = beta2.reshape(-1) if isinstance(beta2, Tensor) else beta2
    left, right, scale = accumulate_factors(
        packed.factor_rows(left_pair), packed.factor_rows(right_pair), scale, grad, decay, rules.matmul_precision
    )
    left, right = packed.with_factors(left_pair, left), packed.with_factors(right_pair, right)
    if uses_second_moment(rules.grafting):
        rms = next_rms(rms, grad, rules.grafting, graft_beta2)
    momentum, followed = next_momentum(rules, momentum, grad, beta1)
    return left, right, scale, momentum, followed / first_term, rms


def stack_direction(work: StackWork, rules: UpdateRules) -> Tensor:
    """The update (``-lr`` times the grafted direction) of the moving blocks of one stack."""
    state, plan, groups = work.state, work.plan, work.groups
    device = state.left_pair.device
    counts = [r.num_blocks for r in plan.regions]
    columns = [
        [1.0 - g["grafting_beta2"] ** t if rules.bias_correction else 1.0 for g, t in zip(groups, work.steps)],
        [g["grafting_epsilon"] for g in groups],
        [g["shampoo_blend"] for g in groups],
        [-g["lr"] for g in groups],
    ]
    second_term, epsilon, blend, neg_lr = block_table(columns, counts, device, state.left_pair.dtype, rules.compiled)
    started = [t >= g["start_preconditioning_step"] for t, g in zip(work.steps, groups)]
    use = state.root_valid
    if any(started) and not all(started):
        use = use & per_block([float(s) for s in started], counts, device).bool()
    return kernel(direct_blocks, rules.compiled)(
        work.momentum,
        state.grafting_rms,
        state.left_pair,
        state.right_pair,
        use,
        second_term,
        epsilon,
        blend,
        neg_lr,
        rules,
        any(started),
    )


def direct_blocks(
    followed: Tensor,
    rms: Tensor | None,
    left_pair: Tensor,
    right_pair: Tensor,
    use: Tensor,
    second_term: PerBlock,
    epsilon: PerBlock,
    blend: PerBlock,
    neg_lr: PerBlock,
    rules: UpdateRules,
    started: bool,
) -> Tensor:
    """A stack's update (pure): the Shampoo direction ``L^(-1/p) M R^(-1/p)`` (``p = root_order``)
    grafted to the grafting optimizer's norm times ``lr_scale`` (raw with ``grafting="none"``), blended with
    the grafting direction where ``use`` (valid roots, started), else the grafting direction alone; times
    ``-lr``."""
    fallback = grafting_direction(followed, rms, rules.fallback, epsilon, second_term)
    if not started:
        return fallback * neg_lr
    left_root, right_root = packed.roots(left_pair), packed.roots(right_pair)
    shampoo = precision.bmm(
        precision.bmm(left_root, followed, rules.matmul_precision), right_root, rules.matmul_precision
    )
    if rules.grafting != "none":
        shampoo = GRAFTS[rules.grafting_norm](shampoo, fallback)
        shampoo = shampoo * rules.lr_scale if rules.lr_scale != 1.0 else shampoo
    if isinstance(blend, Tensor) or blend != 1.0:
        shampoo = torch.lerp(fallback, shampoo, blend)
    return torch.where(use[:, None, None], shampoo, fallback) * neg_lr
