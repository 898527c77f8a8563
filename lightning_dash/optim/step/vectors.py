"""The update maths of the one-dimensional parameters of one group: the grafting optimizer alone.

Like the stacks' maths (:mod:`.update`), it computes candidates in fresh tensors;
:meth:`VectorWork.commit` makes them the state once the whole step has been checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.stacks.layout import Layout, VectorGroup
from lightning_dash.optim.stacks.uploads import upload_runs
from lightning_dash.optim.step.commit import commit_masked
from lightning_dash.optim.step.compiled import kernel
from lightning_dash.optim.step.grafting import grafting_direction, next_rms, uses_second_moment
from lightning_dash.optim.step.rules import PerBlock, UpdateRules, block_table, momentum_terms, next_momentum


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
    grad = torch.empty(sum(numels), dtype=dtype, device=device)
    torch.cat([layout.local(p.grad).reshape(-1) for p in whole], out=grad)
    if len(members) == len(vector.param_indices):
        index, momentum, rms = None, vector.momentum, vector.rms
    else:
        index = upload_runs([(vector.offsets[k], vector.numels[k]) for k in members], device)
        momentum, rms = vector.momentum[index], vector.rms[index]
    steps = [layout.steps[vector.param_indices[k]] for k in members]
    beta1, _ = group["betas"]
    graft_beta2 = group["grafting_beta2"]
    first = momentum_terms(rules, steps, [beta1] * len(steps))
    second = [1.0 - graft_beta2**t if rules.bias_correction else 1.0 for t in steps]
    columns = [[beta1] * len(steps), [graft_beta2] * len(steps), first, second, [-group["lr"]] * len(steps)]
    scalars = [
        v.view(-1) if isinstance(v, Tensor) else v for v in block_table(columns, numels, device, dtype, rules.compiled)
    ]
    momentum, rms, update = kernel(advance_vector, rules.compiled)(
        grad, momentum if beta1 > 0 else None, rms, *scalars, group["grafting_epsilon"], rules
    )
    return VectorWork(vector, params, numels, index, momentum, rms, update)


def advance_vector(
    grad: Tensor,
    momentum: Tensor | None,
    rms: Tensor,
    beta1: PerBlock,
    graft_beta2: PerBlock,
    first_term: PerBlock,
    second_term: PerBlock,
    neg_lr: PerBlock,
    epsilon: float,
    rules: UpdateRules,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """The grafting optimizer's step on a flat buffer (pure): new momentum, second-moment
    root and update."""
    if uses_second_moment(rules.fallback):
        rms = next_rms(rms, grad, rules.fallback, graft_beta2)
    momentum, followed = next_momentum(rules, momentum, grad, beta1)
    direction = grafting_direction(followed / first_term, rms, rules.fallback, epsilon, second_term)
    return momentum, rms, direction * neg_lr
