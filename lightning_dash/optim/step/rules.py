"""What every update of a step shares: the optimizer-wide rules it follows, values per block of
a stack (a float when all blocks agree, else a vector), and the momentum a step follows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_dash.optim import precision
from lightning_dash.optim.precision import resolve as resolve_matmul_precision
from lightning_dash.optim.stacks.uploads import upload

if TYPE_CHECKING:
    from lightning_dash.optim.config import DashConfig

#: A value per block: a float when every block agrees, else a vector.
PerBlock = float | Tensor


@dataclass(frozen=True)
class UpdateRules:
    """The optimizer-wide choices the update maths follows in one step."""

    grafting: str
    nesterov: bool
    bias_correction: bool
    compiled: bool = False
    lr_scale: float = 1.0  # of the grafted Shampoo direction only: vectors and fallbacks step at the lr itself
    matmul_precision: str = precision.FLOAT32  # of float32 matmuls, resolved (lightning_dash.optim.precision)
    root_schedule: str = "from_start"  # lightning_dash.optim.step.schedule
    decay_vectors: bool = True  # whether weight decay moves 1-D parameters too
    grafting_norm: str = "frobenius"  # lightning_dash.optim.step.grafting.GRAFTING_NORMS

    @classmethod
    def of(cls, config: DashConfig) -> UpdateRules:
        """The rules ``config`` sets (its matmul precision resolved)."""
        return cls(
            config.grafting,
            config.nesterov,
            config.bias_correction,
            config.compile,
            config.lr_scale,
            resolve_matmul_precision(config.matmul_precision),
            config.root_schedule,
            config.decay_vectors,
            config.grafting_norm,
        )

    @property
    def fallback(self) -> str:
        """The grafting kind of blocks without a Shampoo direction (Adam for ``"none"``)."""
        return "adam" if self.grafting == "none" else self.grafting


def per_block(
    values: list[float], counts: list[int], device: torch.device, dtype: torch.dtype = torch.float32
) -> PerBlock:
    """One value per region expanded to one per block: a float when all agree, else a
    vector uploaded without a host wait."""
    first = values[0]
    if all(value == first for value in values):
        return first
    return upload([value for value, count in zip(values, counts) for _ in range(count)], dtype, device)


def block_table(
    columns: list[list[float]], counts: list[int], device: torch.device, dtype: torch.dtype, as_tensors: bool
) -> list[PerBlock]:
    """Per-region values (one list per column) as per-block values shaped ``(n, 1, 1)``.

    Eagerly a column whose regions agree stays a float (fewer kernels); for a compiled
    step (``as_tensors``) every column is a tensor, all uploaded in one copy, so changing
    values (learning rates, bias corrections) never change the compiled graph.
    """
    if not as_tensors:
        return [blockwise(per_block(column, counts, device, dtype)) for column in columns]
    flat = [value for column in columns for value, count in zip(column, counts) for _ in range(count)]
    return list(upload(flat, dtype, device).view(len(columns), -1, 1, 1).unbind(0))


def blockwise(value: PerBlock) -> PerBlock:
    """Shape a per-block vector to broadcast over ``(n, rows, cols)``."""
    return value.view(-1, 1, 1) if isinstance(value, Tensor) else value


def momentum_terms(rules: UpdateRules, steps: list[int], betas1: list[float]) -> list[float]:
    """``1 - beta1**t`` (``t + 1`` with Nesterov) per region (1 without bias correction)."""
    shift = 1 if rules.nesterov else 0
    return [1.0 - b ** (t + shift) if rules.bias_correction else 1.0 for b, t in zip(betas1, steps)]


def next_momentum(
    rules: UpdateRules, momentum: Tensor | None, grad: Tensor, beta1: PerBlock
) -> tuple[Tensor | None, Tensor]:
    """The next EMA of the gradient (a new tensor) and the momentum the step follows."""
    if momentum is None:
        return None, grad
    following = momentum.lerp(grad, 1.0 - beta1)
    return following, (grad.lerp(following, beta1) if rules.nesterov else following)
