"""A per-block loop Shampoo: DASH's update, one block at a time.

This is the baseline of ``benchmarks/speed/step_time.py``: the structure of Distributed
Shampoo, where every block of every parameter keeps its own statistics and is
processed by its own small kernels. It performs DASH's update exactly (the same
factor updates, bias corrections, Adam grafting, root schedule and the same
:func:`~lightning_dash.optim.roots.solve.inverse_root` solver, called on a ``(1, b, b)``
stack), so the only difference from DASH is the loop over blocks instead of
batched stacks. ``tests/benchmarks/test_benchmarks.py`` checks that both produce the same
parameters.

Only what the benchmark needs is supported: Adam grafting, no distribution, no
state dict, and gradients are assumed finite. Its defaults are DASH's (inverse square
roots, Nesterov momentum, roots every 2 steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dash.optim.config import DEFAULT_EPSILON, DashConfig
from lightning_dash.optim.roots import inverse_root
from lightning_dash.optim.stacks.blocks import matrix_shape
from lightning_dash.optim.step.factors import accumulate_factors
from lightning_dash.optim.step.grafting import GRAFTS, grafting_direction, next_rms
from lightning_dash.optim.step.rules import UpdateRules, momentum_terms, next_momentum
from lightning_dash.optim.step.schedule import roots_due

#: The options of :class:`ShampooLoop` that fix how its roots are computed (DashConfig's names).
ROOT_OPTIONS = (
    "inverse_root_method",
    "root_order",
    "matrix_scaling",
    "matmul_dtype",
    "root_iterations",
    "chebyshev_degree",
    "relative_epsilon",
)


@dataclass
class _Block:
    """One tile of one parameter's matrix view and its statistics."""

    rows: slice
    cols: slice
    left_factor: Tensor
    right_factor: Tensor
    left_root: Tensor
    right_root: Tensor
    momentum: Tensor
    second_moment: Tensor  # its square root, as DASH keeps it
    root_valid: Tensor
    factor_scale: Tensor  # the factors are kept divided by it, as DASH keeps them


def block_slices(shape: tuple[int, int], block_size: int) -> list[tuple[slice, slice]]:
    """Row-major ``block_size`` tiles of a matrix, remainders last in each direction."""
    rows, cols = shape
    return [
        (slice(r, min(r + block_size, rows)), slice(c, min(c + block_size, cols)))
        for r in range(0, rows, block_size)
        for c in range(0, cols, block_size)
    ]


def _new_block(rows: slice, cols: slice, device: torch.device) -> _Block:
    height, width = rows.stop - rows.start, cols.stop - cols.start
    return _Block(
        rows=rows,
        cols=cols,
        left_factor=torch.zeros(height, height, device=device),
        right_factor=torch.zeros(width, width, device=device),
        left_root=torch.zeros(height, height, device=device),
        right_root=torch.zeros(width, width, device=device),
        momentum=torch.zeros(height, width, device=device),
        second_moment=torch.zeros(height, width, device=device),
        root_valid=torch.zeros((), dtype=torch.bool, device=device),
        factor_scale=torch.zeros(1, dtype=torch.float64, device=device),
    )


class ShampooLoop(torch.optim.Optimizer):
    """DASH's update (Adam grafting) computed block by block.

    Arguments mean what they mean for :class:`lightning_dash.DASH`; hyperparameters
    are optimizer-wide.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        epsilon: float = DEFAULT_EPSILON,
        weight_decay: float = 0.0,
        block_size: int = 1024,
        precondition_frequency: int = 2,
        start_preconditioning_step: int = 1,
        inverse_root_method: str = "eigh",
        matrix_scaling: str = "power_iteration",
        matmul_dtype: torch.dtype = torch.float32,
        grafting_beta2: float = 0.95,
        grafting_epsilon: float = 1e-8,
        root_iterations: int | None = None,
        chebyshev_degree: int = 40,
        relative_epsilon: bool = True,
        root_order: int = 2,
        nesterov: bool = True,
        grafting_norm: str = DashConfig().grafting_norm,
        lr_scale: float = DashConfig().lr_scale,
        root_schedule: str = DashConfig().root_schedule,
    ) -> None:
        options = dict(locals())
        defaults = {"lr": lr, "betas": betas, "epsilon": epsilon, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.block_size = block_size
        self.precondition_frequency = precondition_frequency
        self.start_preconditioning_step = start_preconditioning_step
        self.grafting_beta2 = grafting_beta2
        self.grafting_epsilon = grafting_epsilon
        self.rules = UpdateRules("adam", nesterov, bias_correction=True)
        self.graft = GRAFTS[grafting_norm]
        self.lr_scale = lr_scale
        self.root_schedule = root_schedule
        # the solver options become RootSettings the way DASH's own configuration makes them
        self.root_settings = DashConfig.build(**{name: options[name] for name in ROOT_OPTIONS}).root_settings

    def _roots_due(self, step: int) -> bool:
        schedule = {"start_preconditioning_step": self.start_preconditioning_step}
        return roots_due(step, {**schedule, "precondition_frequency": self.precondition_frequency}, self.root_schedule)

    def _root(self, factor: Tensor, scale: Tensor, correction: float, eps: float) -> Tensor:
        """``(scale * factor / correction + d I)^(-1/p)`` by the configured solver on a 1-block stack."""
        damping = torch.full((1,), eps, device=factor.device)
        return inverse_root(factor[None], damping, self.root_settings, scale / correction, eps).root[0]

    def _followed(self, momentum: Tensor, grad: Tensor, beta1: float, step: int) -> tuple[Tensor, Tensor]:
        """The next momentum and the bias-corrected momentum the step follows, by DASH's own rules."""
        momentum, followed = next_momentum(self.rules, momentum, grad, beta1)
        return momentum, followed / momentum_terms(self.rules, [step], [beta1])[0]

    def _adam_direction(self, momentum: Tensor, second_moment: Tensor, step: int) -> Tensor:
        return grafting_direction(
            momentum, second_moment, "adam", self.grafting_epsilon, 1.0 - self.grafting_beta2**step
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if wd != 0.0:
                    param.mul_(1.0 - lr * wd)
                if param.dim() >= 2:
                    self._matrix_step(param, group)
                else:
                    self._vector_step(param, group)
        return loss

    def _vector_step(self, param: Tensor, group: dict[str, Any]) -> None:
        """Adam on a one-dimensional parameter, as DASH does."""
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["momentum"] = torch.zeros_like(param, dtype=torch.float32)
            state["second_moment"] = torch.zeros_like(param, dtype=torch.float32)
        state["step"] += 1
        step, beta1 = state["step"], group["betas"][0]
        grad = param.grad.float()
        state["second_moment"] = next_rms(state["second_moment"], grad, "adam", self.grafting_beta2)
        state["momentum"], momentum = self._followed(state["momentum"], grad, beta1, step)
        param.add_(self._adam_direction(momentum, state["second_moment"], step), alpha=-group["lr"])

    def _matrix_step(self, param: Tensor, group: dict[str, Any]) -> None:
        """Every block of one parameter, one after the other."""
        state = self.state[param]
        matrix = param.view(matrix_shape(param.shape))
        if not state:
            state["step"] = 0
            state["blocks"] = [
                _new_block(rows, cols, param.device) for rows, cols in block_slices(matrix.shape, self.block_size)
            ]
        state["step"] += 1
        step = state["step"]
        beta1, beta2 = group["betas"]
        due = self._roots_due(step)
        factor_correction = 1.0 - beta2**step if beta2 < 1.0 else 1.0
        grad_matrix = param.grad.view(matrix.shape)
        for block in state["blocks"]:
            grad = grad_matrix[block.rows, block.cols].float()
            left, right, block.factor_scale = accumulate_factors(
                block.left_factor[None], block.right_factor[None], block.factor_scale, grad[None], beta2
            )
            block.left_factor, block.right_factor = left[0], right[0]
            block.second_moment = next_rms(block.second_moment, grad, "adam", self.grafting_beta2)
            block.momentum, momentum = self._followed(block.momentum, grad, beta1, step)
            if due:
                self._refresh_roots(block, factor_correction, group["epsilon"])
            direction = self._adam_direction(momentum, block.second_moment, step)
            if step >= self.start_preconditioning_step:
                shampoo = block.left_root @ momentum @ block.right_root
                grafted = self.lr_scale * self.graft(shampoo.unsqueeze(0), direction.unsqueeze(0))[0]
                direction = torch.where(block.root_valid, grafted, direction)
            matrix[block.rows, block.cols].add_(direction, alpha=-group["lr"])

    def _refresh_roots(self, block: _Block, correction: float, eps: float) -> None:
        """New roots of one block; a non-finite result keeps the previous ones.

        Like DASH, the test stays on the device (no host read-back); a block that
        never had valid roots follows its Adam direction.
        """
        left = self._root(block.left_factor, block.factor_scale, correction, eps)
        right = self._root(block.right_factor, block.factor_scale, correction, eps)
        ok = torch.isfinite(left).all() & torch.isfinite(right).all()
        block.left_root.copy_(torch.where(ok, left, block.left_root))
        block.right_root.copy_(torch.where(ok, right, block.right_root))
        block.root_valid.logical_or_(ok)
