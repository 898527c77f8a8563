"""Speed and accuracy of the batched inverse-root solvers on Shampoo-like statistics.

For each block size, a stack of ``n`` symmetric PSD blocks is built the way
Shampoo accumulates them: the average of a few ``G G^T`` over random gradients
``G`` whose rows have a geometrically decaying scale (so the spectrum spans six
decades), times a per-block magnitude spread over four decades. Each block is
damped with ``eps = relative_eps * lambda_max`` and its float64 ``eigh`` root
``(S + eps I)^(-1/4)`` is the reference. Two regimes run by default:
``relative_eps = 1e-3`` (condition number ~1e3, what ten Newton iterations
resolve) and ``1e-6`` (~6e5, where a fixed ten iterations leave the smallest
eigenvalues under-amplified, an implicit extra damping that Shampoo tolerates).

Every solver in :data:`INVERSE_ROOT_METHODS`, for every matmul dtype and spectral
scaling (``eigh`` ignores both, so it runs once), is measured on

* ``batched_ms``: one :func:`inverse_root` call on the whole stack,
* ``loop_ms``: one call per block as a ``(1, b, b)`` stack, the structure of
  Meta's Distributed Shampoo,
* ``speedup``: ``loop_ms / batched_ms``,
* ``max_rel_err``: the largest per-block ``||X - X_ref||_F / ||X_ref||_F`` of the
  batched result.

Each configuration is warmed up by one batched call, whose output is the one
checked for accuracy; times are then the median of up to five repetitions, fewer
for slow configurations (float16 matmuls are very slow on CPU). The table is
printed and written as a JSON list of records to
``benchmarks/speed/results/solvers_<cpu|cuda>.json``.

Run from the repository root::

    .venv/bin/python benchmarks/speed/solvers.py
    .venv/bin/python benchmarks/speed/solvers.py --block-sizes 128 512 --num-blocks 16
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _records import record_type, report_records
from _timing import fitting
from common import synchronize

from lightning_dash.optim import DashConfig
from lightning_dash.optim.roots import INVERSE_ROOT_METHODS, MATMUL_DTYPES, RootSettings, inverse_root

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

ROOT = 4
SEED = 1234
GRADIENT_DRAWS = 4
#: Ratio between the largest and smallest row scale of a gradient.
GRADIENT_ROW_SPREAD = 1e3
#: Ratio between the largest and smallest block magnitude in a stack.
BLOCK_MAGNITUDE_SPREAD = 1e4
SCALINGS = ("power_iteration", "frobenius")
#: Timed repetitions per measurement: as many as the warm-up says fit in the budget.
MAX_REPETITIONS = 5
MIN_REPETITIONS = 1
TIMING_BUDGET_S = 1.0

T = TypeVar("T")


@dataclass(frozen=True)
class Problem:
    """A stack of statistics as the solver gets it, its damping and the float64 reference roots; ``scale``,
    where the stack is kept divided by a per-block scale as the optimizer keeps it (``solver_choice.py``)."""

    statistics: Tensor
    eps: Tensor
    reference: Tensor
    scale: Tensor | None = None


Record = record_type(
    "Record",
    "One row of the table and of the JSON output.",
    """
    device        str
    block_size    int
    n             int
    relative_eps  float  {:.0e}
    method        str
    scaling       str?
    dtype         str
    batched_ms    float  {:.2f}
    loop_ms       float  {:.2f}
    speedup       float  {:.2f}
    max_rel_err   float  {:.2e}
    """,
)


def parse_args(on_cuda: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=[256, 512, 1024] if on_cuda else [64, 128, 256],
        help="block sizes b to benchmark (default: %(default)s)",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=32 if on_cuda else 8,
        help="blocks n per stack (default: %(default)s)",
    )
    parser.add_argument(
        "--relative-eps",
        type=float,
        nargs="+",
        default=[1e-3, 1e-6],
        help="damping relative to each block's largest eigenvalue (default: %(default)s)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=[str(dtype).removeprefix("torch.") for dtype in MATMUL_DTYPES],
        # float16 matmuls on CPU take an unoptimised path ~20x slower than float32;
        # timing them there says nothing about the solver.
        default=["float32", "bfloat16", "float16"] if on_cuda else ["float32", "bfloat16"],
        help="matmul dtypes of the iterative solvers (default: %(default)s)",
    )
    return parser.parse_args()


def shampoo_statistics(num_blocks: int, size: int, generator: torch.Generator) -> Tensor:
    """Average of ``G G^T`` over random gradients, with a magnitude spread across blocks."""
    row_scales = torch.logspace(0.0, -math.log10(GRADIENT_ROW_SPREAD), size, dtype=torch.float64)
    gradients = torch.randn(GRADIENT_DRAWS, num_blocks, size, size, generator=generator, dtype=torch.float64)
    gradients = gradients * row_scales[:, None]
    outer = (gradients @ gradients.transpose(-1, -2)).mean(dim=0)
    magnitudes = torch.logspace(
        -0.5 * math.log10(BLOCK_MAGNITUDE_SPREAD),
        0.5 * math.log10(BLOCK_MAGNITUDE_SPREAD),
        num_blocks,
        dtype=torch.float64,
    )
    return outer * magnitudes[:, None, None]


def make_problem(num_blocks: int, size: int, relative_eps: float, device: torch.device) -> Problem:
    generator = torch.Generator(device="cpu").manual_seed(SEED + size)
    exact = shampoo_statistics(num_blocks, size, generator)
    eigenvalues, eigenvectors = torch.linalg.eigh(exact)
    eps = relative_eps * eigenvalues[:, -1]
    scaled = (eigenvalues.clamp_min(0.0) + eps[:, None]).pow(-1.0 / ROOT)
    reference = (eigenvectors * scaled.unsqueeze(1)) @ eigenvectors.transpose(1, 2)
    return Problem(
        statistics=exact.float().to(device),
        eps=eps.float().to(device),
        reference=reference.to(device),
    )


def timed(run: Callable[[], T], device: torch.device) -> tuple[float, T]:
    """Wall time of one call of ``run`` in seconds, and its output."""
    synchronize(device)
    start = time.perf_counter()
    output = run()
    synchronize(device)
    return time.perf_counter() - start, output


def median_ms(run: Callable[[], object], device: torch.device, repetitions: int) -> float:
    return 1e3 * statistics.median(timed(run, device)[0] for _ in range(repetitions))


def max_relative_error(roots: Tensor, reference: Tensor) -> float:
    difference = torch.linalg.matrix_norm(roots.double() - reference, ord="fro")
    return (difference / torch.linalg.matrix_norm(reference, ord="fro")).max().item()


def solver_settings(dtype_names: list[str]) -> list[RootSettings]:
    """``eigh`` once, every other method for each chosen matmul dtype and scaling; the
    Newton solvers at a fixed ten iterations per pass (DASH's own default plans them)."""
    iterative = [method for method in INVERSE_ROOT_METHODS if method != "eigh"]
    dtypes = [getattr(torch, name) for name in dtype_names]
    # DASH's defaults, as this table has always used them: the fourth root and absolute damping.
    base = replace(DashConfig().root_settings, root_order=ROOT, relative_epsilon=False)
    return [replace(base, method="eigh")] + [
        replace(base, method=method, scaling=scaling, matmul_dtype=dtype, iterations=10)
        for method in iterative
        for dtype in dtypes
        for scaling in SCALINGS
    ]


def measure(problem: Problem, relative_eps: float, settings: RootSettings, device_name: str) -> Record:
    stats, eps = problem.statistics, problem.eps
    num_blocks, size, _ = stats.shape
    device = stats.device

    def batched() -> Tensor:
        return inverse_root(stats, eps, settings).root

    def per_block() -> list[Tensor]:
        return [inverse_root(stats[i : i + 1], eps[i : i + 1], settings).root for i in range(num_blocks)]

    warmup_s, roots = timed(batched, device)
    repetitions = fitting(TIMING_BUDGET_S, warmup_s, MIN_REPETITIONS, MAX_REPETITIONS)
    batched_ms = median_ms(batched, device, repetitions)
    loop_ms = median_ms(per_block, device, repetitions)
    return Record(
        device=device_name,
        block_size=size,
        n=num_blocks,
        relative_eps=relative_eps,
        method=settings.method,
        scaling=None if settings.method == "eigh" else settings.scaling,
        dtype=str(settings.matmul_dtype).removeprefix("torch."),
        batched_ms=batched_ms,
        loop_ms=loop_ms,
        speedup=loop_ms / batched_ms,
        max_rel_err=max_relative_error(roots, problem.reference),
    )


def main() -> None:
    on_cuda = torch.cuda.is_available()
    args = parse_args(on_cuda)
    device = torch.device("cuda" if on_cuda else "cpu")
    device_name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    records = []
    for relative_eps in args.relative_eps:
        for size in args.block_sizes:
            problem = make_problem(args.num_blocks, size, relative_eps, device)
            records.extend(
                measure(problem, relative_eps, settings, device_name) for settings in solver_settings(args.dtypes)
            )
    report_records(records, RESULTS_DIR / f"solvers_{device.type}.json")


if __name__ == "__main__":
    main()
