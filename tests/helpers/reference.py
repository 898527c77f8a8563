"""A float64, one-block-at-a-time reference of the DASH update, written from the formulas.

It shares no code with the package: tiles are cut with explicit loops and roots
come from float64 ``eigh``. Tests compare the batched float32 optimizer against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def inverse_root(matrix: Tensor, eps: float, order: int = 4) -> Tensor:
    """``(matrix + eps I)^(-1/order)`` in float64, clamping rounding negatives at zero."""
    values, vectors = torch.linalg.eigh(matrix.double())
    return (vectors * (values.clamp_min(0) + eps).pow(-1.0 / order)) @ vectors.T


def largest_singular_value(matrix: Tensor, iterations: int = 8) -> float:
    """The grafting rule's estimate of ``matrix``'s largest singular value, in float64: power iteration
    on ``A^T A`` from the start vector ``v_j = sin(2.399963 j)``, ``j = 1 .. cols``, ``iterations`` times."""
    vector = torch.tensor([math.sin(2.399963 * j) for j in range(1, matrix.shape[1] + 1)], dtype=torch.float64)
    for _ in range(iterations):
        vector = matrix.T @ (matrix @ vector)
        vector = vector / vector.norm()
    return float((matrix @ vector).norm())


def tiles(rows: int, cols: int, block: int) -> list[tuple[slice, slice]]:
    """Row-major tiles of a rows x cols matrix, remainders last in each direction."""
    out = []
    for r in range(0, rows, block):
        for c in range(0, cols, block):
            out.append((slice(r, min(r + block, rows)), slice(c, min(c + block, cols))))
    return out


@dataclass
class ReferenceDash:
    """Hyperparameters mirror the DASH constructor; only Adam grafting or none.

    ``root_delay`` (default 0: roots are used in the step that computes them) models
    asynchronous preconditioning with every swap at its deadline: roots computed from
    the statistics of step ``t`` are used from step ``t + root_delay``, or from the next
    step that computes roots if that comes first; until a block's first roots arrive it
    follows the grafting direction.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    epsilon: float = 3e-5
    relative_epsilon: bool = True
    weight_decay: float = 0.0
    block_size: int = 1024
    precondition_frequency: int = 10
    start_preconditioning_step: int = 1
    grafting: str = "adam"
    grafting_beta2: float = 0.95
    grafting_epsilon: float = 1e-8
    grafting_norm: str = "frobenius"  # the Shampoo step takes Adam's Frobenius norm; or "spectral"
    root_order: int = 2
    nesterov: bool = True
    lr_scale: float = 2.0
    root_delay: int = 0
    factor_bias_correction: bool = True  # False: damp the raw factor averages
    # "doubling": roots at start, at every step before start + period whose number (the gradients in the
    # factors) is a power of two, and every period from start; "from_start": at start, then every period;
    # "multiples": at start, then at every multiple of the frequency
    root_schedule: str = "doubling"
    decay_vectors: bool = True  # False: weight decay on matrices only
    state: dict = field(default_factory=dict)

    def step(self, params: list[Tensor], grads: list[Tensor]) -> None:
        for index, (param, grad) in enumerate(zip(params, grads)):
            if param.dim() >= 2:
                self._matrix_step(index, param, grad)
            else:
                self._vector_step(index, param, grad)

    def _adam_direction(self, st: dict, grad: Tensor, t: int) -> Tensor:
        """The bias-corrected momentum the step follows (Nesterov: ``b1 m_t + (1 - b1) g_t``, corrected
        by ``1 - b1^(t+1)``) and Adam's direction from it."""
        b1 = self.betas[0]
        st["m"] = b1 * st["m"] + (1 - b1) * grad
        st["v"] = self.grafting_beta2 * st["v"] + (1 - self.grafting_beta2) * grad * grad
        if self.nesterov:
            m_hat = (b1 * st["m"] + (1 - b1) * grad) / (1 - b1 ** (t + 1))
        else:
            m_hat = st["m"] / (1 - b1**t)
        v_hat = st["v"] / (1 - self.grafting_beta2**t)
        return m_hat, m_hat / (v_hat.sqrt() + self.grafting_epsilon)

    def _vector_step(self, index: int, param: Tensor, grad: Tensor) -> None:
        st = self.state.setdefault(index, {"t": 0, "m": torch.zeros_like(param), "v": torch.zeros_like(param)})
        st["t"] += 1
        _, direction = self._adam_direction(st, grad.double(), st["t"])
        param.mul_(1 - self.lr * self.weight_decay if self.decay_vectors else 1.0).sub_(self.lr * direction)

    def _damping(self, factor: Tensor) -> float:
        """``epsilon``, times the factor's Frobenius norm when it is relative."""
        return self.epsilon * float(torch.linalg.matrix_norm(factor)) if self.relative_epsilon else self.epsilon

    def _matrix_step(self, index: int, param: Tensor, grad: Tensor) -> None:
        if param.dim() == 3:  # a stack of experts (DASH without a model): one matrix per expert
            experts, part_rows, cols = param.shape
            rows = experts * part_rows
            cut = [
                (slice(e * part_rows + rs.start, e * part_rows + rs.stop), cs)
                for e in range(experts)
                for rs, cs in tiles(part_rows, cols, self.block_size)
            ]
        else:
            rows, cols = param.shape[0], math.prod(param.shape[1:])
            cut = tiles(rows, cols, self.block_size)
        weight, gradient = param.view(rows, cols), grad.double().reshape(rows, cols)
        blocks = self.state.setdefault(index, {})
        weight.mul_(1 - self.lr * self.weight_decay)
        for key, (rs, cs) in enumerate(cut):
            g = gradient[rs, cs]
            st = blocks.setdefault(
                key,
                {
                    "t": 0,
                    "m": torch.zeros_like(g),
                    "v": torch.zeros_like(g),
                    "L": torch.zeros(g.shape[0], g.shape[0], dtype=torch.float64),
                    "R": torch.zeros(g.shape[1], g.shape[1], dtype=torch.float64),
                    "Lr": None,
                    "Rr": None,
                    "pending": None,
                },
            )
            st["t"] += 1
            t, b2 = st["t"], self.betas[1]
            start, freq = self.start_preconditioning_step, self.precondition_frequency
            if self.root_schedule == "multiples":
                due = t == start or (t > start and t % freq == 0)
            else:
                due = t >= start and (t - start) % freq == 0
                if self.root_schedule == "doubling" and start <= t < start + freq and math.log2(t).is_integer():
                    due = True
            if st["pending"] is not None and (due or t >= st["pending"][0]):
                _, st["Lr"], st["Rr"] = st["pending"]
                st["pending"] = None
            new = 1 - b2 if b2 < 1 else 1.0  # a decay of 1 accumulates sums
            st["L"] = b2 * st["L"] + new * g @ g.T
            st["R"] = b2 * st["R"] + new * g.T @ g
            m_hat, adam = self._adam_direction(st, g, t)
            if due:
                correction = 1 - b2**t if b2 < 1 and self.factor_bias_correction else 1.0
                left_factor, right_factor = st["L"] / correction, st["R"] / correction
                left = inverse_root(left_factor, self._damping(left_factor), self.root_order)
                right = inverse_root(right_factor, self._damping(right_factor), self.root_order)
                if self.root_delay == 0:
                    st["Lr"], st["Rr"] = left, right
                else:
                    st["pending"] = (t + self.root_delay, left, right)
            if t >= start and st["Lr"] is not None:
                shampoo = st["Lr"] @ m_hat @ st["Rr"]
                if self.grafting == "adam" and self.grafting_norm == "spectral":
                    shampoo = shampoo * (largest_singular_value(adam) / largest_singular_value(shampoo))
                elif self.grafting == "adam":
                    shampoo = shampoo * (adam.norm() / shampoo.norm())
                direction = shampoo if self.grafting == "none" else self.lr_scale * shampoo
            else:
                direction = adam
            weight[rs, cs] -= self.lr * direction
