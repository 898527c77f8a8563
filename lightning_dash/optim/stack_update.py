"""The update maths of one optimizer step, per stack of blocks and per vector group.

Each function computes *candidates*: new statistics and the update, in fresh
tensors, without touching the committed state. :meth:`StackWork.commit` and
:meth:`VectorWork.commit` make them the state once the whole step has been checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.blocks import StackPlan
from lightning_dash.optim.factors import accumulate_factors
from lightning_dash.optim.grafting import graft_norm, grafting_direction, next_rms, uses_second_moment
from lightning_dash.optim.host_values import upload, upload_runs
from lightning_dash.optim.layout import Layout, Stack, VectorGroup
from lightning_dash.optim.state import GRAFTING_RMS, MOMENTUM, StackState

#: A value per block: a float when every block agrees, else a vector.
PerBlock = float | Tensor


@dataclass(frozen=True)
class UpdateRules:
    """The optimizer-wide choices the update maths follows in one step."""

    grafting: str
    nesterov: bool
    bias_correction: bool

    @property
    def fallback(self) -> str:
        """The grafting kind of blocks without a Shampoo direction (Adam for ``"none"``)."""
        return "adam" if self.grafting == "none" else self.grafting


def per_block(values: list[float], counts: list[int], device: torch.device) -> PerBlock:
    """One value per region expanded to one per block: a float when all agree, else a
    vector uploaded without a host wait."""
    first = values[0]
    if all(value == first for value in values):
        return first
    return upload([value for value, count in zip(values, counts) for _ in range(count)], torch.float32, device)


def blockwise(value: PerBlock) -> PerBlock:
    """Shape a per-block vector to broadcast over ``(n, rows, cols)``."""
    return value.view(-1, 1, 1) if isinstance(value, Tensor) else value


def roots_due(step: int, group: dict[str, Any]) -> bool:
    """Whether a block at its ``step`` recomputes its roots: at start, start + f, ..."""
    start = group["start_preconditioning_step"]
    return step >= start and (step - start) % group["precondition_frequency"] == 0


def momentum_terms(
    rules: UpdateRules, steps: list[int], counts: list[int], betas1: list[float], device: torch.device
) -> PerBlock:
    """``1 - beta1**t`` (``t + 1`` with Nesterov), per block."""
    if not rules.bias_correction:
        return 1.0
    shift = 1 if rules.nesterov else 0
    return per_block([1.0 - b ** (t + shift) for b, t in zip(betas1, steps)], counts, device)


def next_momentum(
    rules: UpdateRules, momentum: Tensor | None, grad: Tensor, beta1: PerBlock
) -> tuple[Tensor | None, Tensor]:
    """The next EMA of the gradient (a new tensor) and the momentum the step follows."""
    if momentum is None:
        return None, grad
    following = momentum.lerp(grad, 1.0 - beta1)
    return following, (grad.lerp(following, beta1) if rules.nesterov else following)


def active_params(layout: Layout) -> set[int]:
    """Indices of parameters with a gradient (empty ones excepted); a host-side decision."""
    candidates = [i for i, p in enumerate(layout.params) if p.grad is not None and p.numel() > 0]
    for index in candidates:
        if layout.params[index].grad.is_sparse:
            raise ValueError(f"params: DASH does not support sparse gradients ({layout.names[index]})")
    return set(candidates)


def local_peaks(layout: Layout, active: set[int], device: torch.device) -> Tensor:
    """The largest magnitude of each active gradient's local part, as one vector (NaN
    propagates; an empty part counts as zero). Two launches, no host read."""
    held = [grad for i in sorted(active) if (grad := layout.local(layout.params[i].grad)).numel() > 0]
    if not held:
        return torch.zeros(1, device=device)
    return torch.stack([norm.to(torch.float32) for norm in torch._foreach_norm(held, math.inf)])


def any_nonfinite(tensors: list[Tensor], device: torch.device) -> Tensor:
    """A 0-d float on ``device``: 1 when some entry of ``tensors`` is not finite, else 0."""
    if not tensors:
        return torch.zeros((), device=device)
    peaks = torch.stack([norm.to(torch.float32) for norm in torch._foreach_norm(tensors, math.inf)])
    return (~torch.isfinite(peaks)).any().to(torch.float32)


def gradients_all_zero(layout: Layout, active: set[int], reduce_max: Callable[[Tensor], Tensor]) -> bool:
    """Whether every active gradient is exactly zero on every rank (reads one value back)."""
    device = layout.params[min(active)].device
    peaks = torch.nan_to_num(local_peaks(layout, active, device), nan=math.inf)
    return bool(reduce_max(peaks.max().view(1)).item() == 0)


def decay_weights(layout: Layout, groups: list[dict[str, Any]], active: set[int], skip: Tensor) -> None:
    """Decoupled weight decay ``W <- W (1 - lr wd)`` of the moving parameters (none when
    the 0-d bool ``skip`` is set)."""
    for group_index, group in enumerate(groups):
        factor = 1.0 - group["lr"] * group["weight_decay"]
        if factor != 1.0:
            moving = [i for i in sorted(active) if layout.group_of[i] == group_index]
            decayed = [layout.local(layout.params[i]) for i in moving]
            if decayed:
                torch._foreach_mul_(decayed, torch.where(skip, 1.0, torch.full_like(skip, factor, dtype=torch.float64)))


def commit_masked(current: Tensor, candidate: Tensor, index: Tensor | None, skip: Tensor) -> None:
    """``current`` (at ``index``, or whole) takes ``candidate`` unless ``skip`` is set; in place."""
    if index is None:
        torch.where(skip, current, candidate.to(current.dtype), out=current)
    else:
        current.index_copy_(0, index, torch.where(skip, current.index_select(0, index), candidate.to(current.dtype)))


@dataclass
class VectorWork:
    """The candidate step of the moving one-dimensional parameters of one group."""

    vector: VectorGroup
    params: list[Tensor]
    numels: list[int]
    index: Tensor | None
    momentum: Tensor | None
    rms: Tensor
    update: Tensor

    def apply(self, skip: Tensor) -> None:
        """Add the update to the parameters (nothing when the 0-d bool ``skip`` is set)."""
        update = torch.where(skip, 0.0, self.update)
        torch._foreach_add_(self.params, [u.view(p.shape) for u, p in zip(update.split(self.numels), self.params)])

    def commit(self, skip: Tensor) -> None:
        """Make the candidate momentum and second moment the group's state, in place,
        unless ``skip`` (a 0-d bool on the device) is set."""
        if self.momentum is not None:
            commit_masked(self.vector.momentum, self.momentum, self.index, skip)
        commit_masked(self.vector.rms, self.rms, self.index, skip)


def vector_work(
    layout: Layout, vector: VectorGroup, group: dict[str, Any], active: set[int], rules: UpdateRules
) -> VectorWork | None:
    """Candidate grafting-optimizer step of the one-dimensional parameters of one group."""
    members = [k for k, index in enumerate(vector.param_indices) if index in active]
    if not members:
        return None
    whole = [layout.params[vector.param_indices[k]] for k in members]
    params = [layout.local(p) for p in whole]
    numels = [vector.numels[k] for k in members]
    device, dtype = vector.momentum.device, vector.momentum.dtype
    grad = torch.cat([layout.local(p.grad).reshape(-1).to(dtype) for p in whole])
    if len(members) == len(vector.param_indices):
        index, momentum, rms = None, vector.momentum, vector.rms
    else:
        index = upload_runs([(vector.offsets[k], vector.numels[k]) for k in members], device)
        momentum, rms = vector.momentum[index], vector.rms[index]
    steps = [layout.steps[vector.param_indices[k]] for k in members]
    beta1, _ = group["betas"]
    graft_beta2 = group["grafting_beta2"]
    if uses_second_moment(rules.fallback):
        rms = next_rms(rms, grad, rules.fallback, graft_beta2)
    momentum, followed = next_momentum(rules, momentum if beta1 > 0 else None, grad, beta1)
    first_term = momentum_terms(rules, steps, numels, [beta1] * len(steps), device)
    second_term = per_block([1.0 - graft_beta2**t for t in steps], numels, device) if rules.bias_correction else 1.0
    direction = grafting_direction(followed / first_term, rms, rules.fallback, group["grafting_epsilon"], second_term)
    return VectorWork(vector, params, numels, index, momentum, rms, direction.mul_(-group["lr"]))


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
    device = state.left_factor.device
    grad = grads if index is None else grads.index_select(0, index)
    counts = [r.num_blocks for r in plan.regions]
    region_groups = [groups[layout.group_of[r.param_index]] for r in plan.regions]
    steps = [layout.steps[r.param_index] for r in plan.regions]
    betas1 = [g["betas"][0] for g in region_groups]
    beta1 = blockwise(per_block(betas1, counts, device))
    beta2 = per_block([g["betas"][1] for g in region_groups], counts, device)

    state.left_factor, state.right_factor, state.factor_scale = accumulate_factors(
        state.left_factor, state.right_factor, state.factor_scale, grad, beta2
    )
    if uses_second_moment(rules.grafting):
        graft_beta2 = blockwise(per_block([g["grafting_beta2"] for g in region_groups], counts, device))
        state.grafting_rms = next_rms(state.ensure(GRAFTING_RMS), grad, rules.grafting, graft_beta2)
    wants_momentum = any(b > 0 for b in betas1)
    state.momentum, followed = next_momentum(rules, state.ensure(MOMENTUM) if wants_momentum else None, grad, beta1)
    first_term = blockwise(momentum_terms(rules, steps, counts, betas1, device))

    due_regions = [k for k, (t, g) in enumerate(zip(steps, region_groups)) if roots_due(t, g)]
    due = None
    if due_regions and len(due_regions) < len(plan.regions):
        due = upload_runs([(plan.regions[k].stack_offset, counts[k]) for k in due_regions], device)
    return StackWork(stack, plan, index, state, followed / first_term, steps, region_groups, due, due_regions)


def stack_direction(work: StackWork, rules: UpdateRules) -> Tensor:
    """The update (``-lr`` times the grafted direction) of the moving blocks of one stack."""
    state, plan, groups = work.state, work.plan, work.groups
    device = state.left_factor.device
    counts = [r.num_blocks for r in plan.regions]
    second_term: PerBlock = 1.0
    if rules.bias_correction:
        second_term = blockwise(
            per_block([1.0 - g["grafting_beta2"] ** t for g, t in zip(groups, work.steps)], counts, device)
        )
    epsilon = blockwise(per_block([g["grafting_epsilon"] for g in groups], counts, device))
    fallback = grafting_direction(work.momentum, state.grafting_rms, rules.fallback, epsilon, second_term)
    started = [t >= g["start_preconditioning_step"] for t, g in zip(work.steps, groups)]
    if any(started):
        shampoo = torch.bmm(torch.bmm(state.left_root, work.momentum), state.right_root)
        if rules.grafting != "none":
            shampoo = graft_norm(shampoo, fallback)
        blend = blockwise(per_block([g["shampoo_blend"] for g in groups], counts, device))
        if isinstance(blend, Tensor) or blend != 1.0:
            shampoo = torch.lerp(fallback, shampoo, blend)
        use = state.root_valid
        if not all(started):
            use = use & per_block([float(s) for s in started], counts, device).bool()
        direction = torch.where(use[:, None, None], shampoo, fallback)
    else:
        direction = fallback
    return direction.mul_(blockwise(per_block([-g["lr"] for g in groups], counts, device)))
