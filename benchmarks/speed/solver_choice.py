"""Which inverse-root solver is fastest at the required accuracy, per block size: the measured
basis of ``inverse_root_method="auto"`` (:mod:`lightning_dash.optim.roots.choice`).

For every block size ``b`` in :data:`BLOCK_SIZES`, a stack of ``n = STACK_ELEMENTS / b^2``
blocks (at least one; ~4M elements, the order of one size's due factors in a step) is
built twice, as DASH accumulates its left factors: the exponential moving average with
``beta2 = 0.95`` of ``G G^T`` over 20 gradients, bias-corrected, in float64:

* ``well``: ``G_t = A B_t + noise``: a fixed per-block subspace ``A`` of rank ``b / 8``
  whose directions span two decades, random coefficients ``B_t``, and Gaussian noise of
  a tenth of the signal's Frobenius norm (full rank, condition number ~1e4);
* ``deficient``: ``G_t = A B_t`` of rank ``b / 4`` without noise, so three quarters of
  the factor's spectrum is exactly zero and the root there is ``epsilon^(-1/4)``.

Each solver gets what the optimizer would pass it: the factor stored in float32 divided
by a float64 per-block scale, DASH's default damping (``epsilon = 1e-6`` relative to the
factor's Frobenius norm) and default solver settings (power-iteration scaling, float32
matmuls, planned iterations), root 4. Per method in :data:`INVERSE_ROOT_METHODS`:

* ``time_ms``: the fastest of several :func:`inverse_root` calls on the whole ``well``
  stack (the first is the accuracy run; then as many rounds as fit in
  :data:`SIZE_BUDGET_S`, between :data:`MIN_ROUNDS` and :data:`MAX_ROUNDS`, the methods
  interleaved and their order rotated every round). The Newton and Chebyshev solvers run
  a number of batched iterations fixed on the host, so their time does not depend on the
  data;
* ``well_error`` / ``deficient_error``: the largest per-block ``||X - X_ref||_F /
  ||X_ref||_F`` against ``X_ref``, the float64 ``eigh`` root of the same (float64,
  damped) factor;
* ``well_rejected`` / ``deficient_rejected``: blocks the optimizer would reject (not
  finite, or a Newton residual above :func:`failure_residual`).

A method qualifies when both errors are at most :data:`REQUIRED_RELATIVE_ERROR` and no
block is rejected; ``eigh``, the reference, always qualifies. The winner of a size is its
fastest qualifying method. The table is printed and written, with the run's machine and
settings, to ``benchmarks/speed/results/solver_choice_<device type>.json``.

Run from the repository root (~5 minutes on 2 CPU cores; the lock keeps other heavy jobs
from sharing the cores)::

    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/speed/solver_choice.py
    .venv/bin/python benchmarks/speed/solver_choice.py --device cuda
    .venv/bin/python benchmarks/speed/solver_choice.py --block-sizes 16 64 --stack-elements 65536 --output /tmp/x.json
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _environment import cpu_name
from _records import record_cells, record_type
from _timing import fitting
from common import device_label, format_columns, write_json
from solvers import Problem, max_relative_error, timed

from lightning_dash.optim.config import DEFAULT_EPSILON, DashConfig
from lightning_dash.optim.roots import INVERSE_ROOT_METHODS, RootResult, RootSettings, failure_residual, inverse_root

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

BLOCK_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)
#: Elements per stack: 16384 blocks of 16, ..., 4 of 1024, 1 of 2048.
STACK_ELEMENTS = 2**22
#: The required accuracy: largest relative Frobenius error of a root, on both cases, at
#: which a method may be chosen. eigh is the reference and always qualifies.
REQUIRED_RELATIVE_ERROR = 1e-2
ROOT = 4
BETA2 = 0.95
GRADIENTS = 20
#: Signal rank of the ``well`` and ``deficient`` gradients, as a fraction of the block size.
WELL_RANK_FRACTION = 1 / 8
DEFICIENT_RANK_FRACTION = 1 / 4
#: Ratio between the strongest and weakest signal direction of a gradient.
SIGNAL_SPREAD = 1e2
#: Frobenius norm of the ``well`` gradients' noise, relative to their signal.
NOISE_LEVEL = 0.1
SEED = 2024
#: Timing rounds per size after the accuracy run: as many as fit in the budget, within range.
SIZE_BUDGET_S = 20.0
MIN_ROUNDS = 1
MAX_ROUNDS = 3
CASES = ("well", "deficient")


Record = record_type(
    "Record",
    "One row of the table and of the JSON output.",
    """
    device              str
    block_size          int
    num_blocks          int
    method              str
    time_ms             float  {:.1f}
    timed_calls         int
    well_error          float  {:.1e}
    deficient_error     float  {:.1e}
    well_rejected       int
    deficient_rejected  int
    qualifies           bool
    """,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="torch device to measure (default: %(default)s)")
    parser.add_argument(
        "--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES), help="block sizes (default: %(default)s)"
    )
    parser.add_argument(
        "--stack-elements", type=int, default=STACK_ELEMENTS, help="elements per stack (default: %(default)s)"
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default: results/solver_choice_*.json)")
    return parser.parse_args()


def root_settings(method: str) -> RootSettings:
    """DASH's default solver settings (scaling, matmul dtype, planned iterations, relative
    damping) with ``method``."""
    return replace(DashConfig().root_settings, method=method, root_order=ROOT)


def gradients(num_blocks: int, size: int, rank: int, noise: float, generator: torch.Generator) -> list[Tensor]:
    """``GRADIENTS`` float64 gradient stacks ``A B_t (+ noise)``: a fixed subspace ``A`` whose
    directions' scales span :data:`SIGNAL_SPREAD`, and fresh coefficients every step."""
    scales = torch.logspace(0.0, -math.log10(SIGNAL_SPREAD), rank, dtype=torch.float64)
    basis = torch.randn(num_blocks, size, rank, generator=generator, dtype=torch.float64) * scales
    drawn = []
    for _ in range(GRADIENTS):
        signal = basis @ torch.randn(num_blocks, rank, size, generator=generator, dtype=torch.float64)
        signal = signal / torch.linalg.matrix_norm(signal)[:, None, None]
        if noise > 0:
            extra = torch.randn(num_blocks, size, size, generator=generator, dtype=torch.float64)
            signal = signal + noise * extra / torch.linalg.matrix_norm(extra)[:, None, None]
        drawn.append(signal)
    return drawn


def ema_factor(drawn: list[Tensor]) -> Tensor:
    """Bias-corrected ``L = sum_t (1 - beta2) beta2^(T - t) G_t G_t^T / (1 - beta2^T)``."""
    factor = torch.zeros(drawn[0].shape[0], drawn[0].shape[1], drawn[0].shape[1], dtype=torch.float64)
    for gradient in drawn:
        factor = torch.baddbmm(factor, gradient, gradient.transpose(1, 2), beta=BETA2, alpha=1.0 - BETA2)
    return factor / (1.0 - BETA2**GRADIENTS)


def reference_roots(factor: Tensor, epsilon: float) -> Tensor:
    """``(L + epsilon ||L||_F I)^(-1/4)`` by float64 eigh (the factor is PSD; roundoff-level
    negative eigenvalues are clamped to zero)."""
    damping = epsilon * torch.linalg.matrix_norm(factor)
    eigenvalues, eigenvectors = torch.linalg.eigh(factor)
    scaled = (eigenvalues.clamp_min(0.0) + damping[:, None]).pow(-1.0 / ROOT)
    return (eigenvectors * scaled.unsqueeze(1)) @ eigenvectors.transpose(1, 2)


def make_problem(case: str, num_blocks: int, size: int, device: torch.device) -> Problem:
    """The ``well`` or ``deficient`` stack: float32 factors divided by a float64 per-block
    scale (their largest entry, so stored entries are at most 1), as the optimizer keeps them."""
    generator = torch.Generator().manual_seed(SEED + size + (0 if case == "well" else 1))
    if case == "well":
        drawn = gradients(num_blocks, size, max(1, round(size * WELL_RANK_FRACTION)), NOISE_LEVEL, generator)
    else:
        drawn = gradients(num_blocks, size, max(1, round(size * DEFICIENT_RANK_FRACTION)), 0.0, generator)
    factor = ema_factor(drawn)
    scale = factor.abs().amax(dim=(1, 2))
    return Problem(
        statistics=(factor / scale[:, None, None]).float().to(device),
        scale=scale.to(device),
        eps=torch.full((num_blocks,), DEFAULT_EPSILON, device=device),
        reference=reference_roots(factor, DEFAULT_EPSILON).to(device),
    )


def solve(problem: Problem, method: str) -> Callable[[], RootResult]:
    settings = root_settings(method)
    return lambda: inverse_root(problem.statistics, problem.eps, settings, problem.scale, DEFAULT_EPSILON)


def rejected_blocks(result: RootResult, method: str) -> int:
    """Blocks the optimizer's acceptance test would reject (see ``root_refresh.install``)."""
    ok = torch.isfinite(result.root).all(dim=(1, 2))
    if result.residual is not None:
        ok = ok & (result.residual <= failure_residual(root_settings(method)))
    return int((~ok).sum())


def measure_size(size: int, stack_elements: int, device: torch.device) -> list[Record]:
    num_blocks = max(1, stack_elements // (size * size))
    problems = {case: make_problem(case, num_blocks, size, device) for case in CASES}
    times: dict[str, list[float]] = {method: [] for method in INVERSE_ROOT_METHODS}
    errors: dict[tuple[str, str], float] = {}
    rejected: dict[tuple[str, str], int] = {}
    for case, problem in problems.items():
        for method in INVERSE_ROOT_METHODS:
            seconds, result = timed(solve(problem, method), device)
            if case == "well":
                times[method].append(seconds)
            errors[case, method] = max_relative_error(result.root, problem.reference)
            rejected[case, method] = rejected_blocks(result, method)
            del result
    methods = list(INVERSE_ROOT_METHODS)
    first_round_s = sum(samples[0] for samples in times.values())
    for turn in range(fitting(SIZE_BUDGET_S, first_round_s, MIN_ROUNDS, MAX_ROUNDS)):
        for method in methods[turn % len(methods) :] + methods[: turn % len(methods)]:
            times[method].append(timed(solve(problems["well"], method), device)[0])
    records = []
    for method in INVERSE_ROOT_METHODS:
        accurate = all(errors[case, method] <= REQUIRED_RELATIVE_ERROR for case in CASES)
        accepted = all(rejected[case, method] == 0 for case in CASES)
        records.append(
            Record(
                device=device_label(device),
                block_size=size,
                num_blocks=num_blocks,
                method=method,
                time_ms=1e3 * min(times[method]),
                timed_calls=len(times[method]),
                well_error=errors["well", method],
                deficient_error=errors["deficient", method],
                well_rejected=rejected["well", method],
                deficient_rejected=rejected["deficient", method],
                qualifies=method == "eigh" or (accurate and accepted),
            )
        )
    return records


def winners(records: list[Record]) -> dict[str, str]:
    """Per block size (as a string key), the fastest qualifying method."""
    best: dict[int, Record] = {}
    for record in records:
        if record.qualifies and (record.block_size not in best or record.time_ms < best[record.block_size].time_ms):
            best[record.block_size] = record
    return {str(size): best[size].method for size in sorted(best)}


def machine() -> str:
    """``"<cores>-core <CPU model>"``, the model from ``/proc/cpuinfo`` where there is one."""
    return f"{os.cpu_count()}-core {cpu_name(platform.processor() or platform.machine())}"


def print_table(records: list[Record], chosen: dict[str, str]) -> None:
    header, rows = record_cells(records)
    marks = ["<-" if chosen.get(str(record.block_size)) == record.method else "" for record in records]
    print(format_columns([*header[1:], "chosen"], [[*row[1:], mark] for row, mark in zip(rows, marks)]))


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    records = []
    for size in args.block_sizes:
        records.extend(measure_size(size, args.stack_elements, device))
        print(f"b={size}: done after {time.perf_counter() - started:.0f} s", flush=True)
    chosen = winners(records)
    print_table(records, chosen)
    settings = root_settings("eigh")
    meta = {
        "command": " ".join(
            ["flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/speed/solver_choice.py", *sys.argv[1:]]
        ),
        "device": device_label(device),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else machine(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "required_relative_error": REQUIRED_RELATIVE_ERROR,
        "epsilon": DEFAULT_EPSILON,
        "relative_epsilon": settings.relative_epsilon,
        "matrix_scaling": settings.scaling,
        "matmul_dtype": str(settings.matmul_dtype).removeprefix("torch."),
        "root": ROOT,
        "beta2": BETA2,
        "gradients": GRADIENTS,
        "stack_elements": args.stack_elements,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    output = args.output or RESULTS_DIR / f"solver_choice_{device.type}.json"
    print(f"\nwrote {write_json(output, {'meta': meta, 'winners': chosen, 'records': [asdict(r) for r in records]})}")


if __name__ == "__main__":
    main()
