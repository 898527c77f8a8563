"""Where the time of a Newton inverse-root refresh goes, against the FLOPs the method needs.

For each block size ``b`` a stack of ``n`` Shampoo factors is built the way DASH
accumulates them: the bias-corrected EMA (``beta2`` of :class:`DashConfig`) of ``G G^T``
over :data:`GRADIENTS` low-rank-ish gradients (rank :data:`GRADIENT_RANK` with decaying
singular values plus a little full-rank noise), stored divided by a per-block scale, with
DASH's default relative damping (``epsilon = 1e-6``). Each solver computes the inverse
fourth roots with :func:`inverse_root` and DASH's default settings (power-iteration
scaling, float32 matmuls, iterations planned on the host from ``min_eps``), and is
measured on

* ``ms``: the fastest of ``--repetitions`` calls after one warm-up call (the machine is
  shared: the minimum is the least disturbed),
* ``square_matmuls``: ``(n, b, b) x (n, b, b)`` matmuls, each ``2 n b^3`` FLOPs
  (``pred_gflop``); ``thin_gflop``: the other matmuls (power iteration),
* ``matmul_ms`` / ``other_ms``: time inside square matmuls and in everything else
  (elementwise ops, reductions, copies, ``eigh``), from a run that times every ATen call,
* ``ideal_ms``: ``square_matmuls`` times one plain ``torch.bmm`` of the same shape (whose
  ``bmm_gflops``, the fastest of five, is reported), the time the method's FLOPs need at
  the machine's rate,
* ``iterations``: iterations run (every one costs full matmuls, converged blocks included)
  and ``converged_by``: the iteration after which every block was frozen (per pass),
* ``syncs``: host synchronisations (:func:`~lightning_dash.testing.op_counts.count_ops`),
* ``max_rel_err``: the largest per-block ``||X - X_ref||_F / ||X_ref||_F`` against the
  float64 ``eigh`` root of the same float32 factor.

The table is printed and the records are stored under ``--label`` in
``benchmarks/speed/results/newton_cost_cpu.json`` (other labels already in the file are kept,
so a run on an older revision and one on a newer sit side by side).

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/speed/newton_cost.py --label after
    PYTHONPATH=. .venv/bin/python benchmarks/speed/newton_cost.py --block-sizes 256 --methods newton_db
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from common import format_columns

import lightning_dash.optim.roots.newton as newton_roots
from lightning_dash.optim.config import DashConfig
from lightning_dash.optim.roots import inverse_root
from lightning_dash.testing.op_counts import count_ops

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

ROOT = 4
SEED = 2024
GRADIENTS = 20
GRADIENT_RANK = 8
#: Full-rank noise of each gradient, relative to its low-rank part.
GRADIENT_NOISE = 1e-3
MATMUL_OPS = frozenset({"bmm", "mm", "matmul", "addmm", "baddbmm"})


@dataclass(frozen=True)
class Problem:
    statistics: Tensor
    scale: Tensor
    eps: Tensor
    min_eps: float
    reference: Tensor


@dataclass
class Record:
    label: str
    block_size: int
    n: int
    method: str
    ms: float
    ratio_to_eigh: float
    square_matmuls: int
    pred_gflop: float
    thin_gflop: float
    matmul_ms: float
    other_ms: float
    ideal_ms: float
    bmm_gflops: float
    launches: int
    syncs: int
    iterations: int
    converged_by: list[int] = field(default_factory=list)
    max_rel_err: float = 0.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--num-blocks", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=["eigh", "newton_db", "coupled_newton"])
    parser.add_argument("--repetitions", type=int, default=3, help="timed calls per configuration (fastest)")
    parser.add_argument("--label", default="current", help="key of this run in the JSON file")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "newton_cost_cpu.json")
    return parser.parse_args()


def make_problem(num_blocks: int, size: int, config: DashConfig) -> Problem:
    """Bias-corrected EMA of ``G G^T`` over low-rank-ish gradients, stored as DASH stores it."""
    generator = torch.Generator().manual_seed(SEED + size)
    beta = config.betas[1]
    singular = torch.logspace(0.0, -2.0, GRADIENT_RANK)
    factor = torch.zeros(num_blocks, size, size)
    for _ in range(GRADIENTS):
        left = torch.randn(num_blocks, size, GRADIENT_RANK, generator=generator) * singular
        right = torch.randn(num_blocks, GRADIENT_RANK, size, generator=generator) / size**0.5
        noise = torch.randn(num_blocks, size, size, generator=generator) / size**0.5
        grad = left @ right + GRADIENT_NOISE * noise
        factor = beta * factor + (1.0 - beta) * (grad @ grad.transpose(1, 2))
    factor = factor / (1.0 - beta**GRADIENTS)
    factor = 0.5 * (factor + factor.transpose(1, 2))
    scale = factor.abs().amax(dim=(1, 2)).double()
    statistics = (factor / scale.float()[:, None, None]).contiguous()
    eps = torch.full((num_blocks,), config.epsilon)
    exact = statistics.double() * scale[:, None, None]
    damping = config.epsilon * torch.linalg.matrix_norm(exact, ord="fro")
    values, vectors = torch.linalg.eigh(exact)
    reference = (vectors * (values + damping[:, None]).pow(-1.0 / ROOT).unsqueeze(1)) @ vectors.transpose(1, 2)
    return Problem(statistics, scale, eps, config.epsilon, reference)


class OpTimer(TorchDispatchMode):
    """Wall time and count of every ATen call, with square matmuls apart (CPU: calls are synchronous)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.times: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.thin_flops = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        name = func._schema.name.split("::")[-1]
        if name in MATMUL_OPS and isinstance(out, Tensor):
            left = args[-2] if name in ("addmm", "baddbmm") else args[0]
            inner, rows, cols = left.shape[-1], out.shape[-2], out.shape[-1]
            batch = out.shape[0] if out.dim() == 3 else 1
            if inner == rows == cols == self.size:
                name = "square_matmul"
            else:
                self.thin_flops += 2.0 * batch * rows * cols * inner
        self.times[name] += elapsed
        self.calls[name] += 1
        return out


def plain_bmm_seconds(num_blocks: int, size: int) -> float:
    left, right = torch.randn(num_blocks, size, size), torch.randn(num_blocks, size, size)
    torch.bmm(left, right)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        torch.bmm(left, right)
        runs.append(time.perf_counter() - start)
    return min(runs)


def iteration_trace(run: Callable[[], Any]) -> list[list[int]]:
    """Active (not yet converged) blocks after each iteration's test, per pass: the solvers
    call ``newton_roots.freeze(active, ...)`` with one ``active`` mask per iteration."""
    seen: list[Tensor] = []
    real = newton_roots.freeze

    def recording(active: Tensor, new: Tensor, old: Tensor) -> Tensor:
        if not seen or seen[-1] is not active:
            seen.append(active)
        return real(active, new, old)

    newton_roots.freeze = recording
    try:
        run()
    finally:
        newton_roots.freeze = real
    passes: list[list[int]] = []
    previous = None
    for active in seen:
        count = int(active.sum())
        if previous is None or count > previous:
            passes.append([])
        passes[-1].append(count)
        previous = count
    return passes


def measure(problem: Problem, method: str, label: str, repetitions: int, bmm_s: float, config: DashConfig) -> Record:
    num_blocks, size, _ = problem.statistics.shape
    settings = replace(config.root_settings, method=method, root_order=ROOT)

    def call() -> Tensor:
        return inverse_root(problem.statistics, problem.eps, settings, problem.scale, problem.min_eps).root

    roots = call()  # warm-up, and the result checked for accuracy
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    timer = OpTimer(size)
    with timer:
        call()
    _, counts = count_ops(call)
    passes = iteration_trace(call) if method != "eigh" else []
    square = timer.calls["square_matmul"]
    matmul_s = timer.times["square_matmul"]
    total_s = sum(timer.times.values())
    difference = torch.linalg.matrix_norm(roots.double() - problem.reference, ord="fro")
    error = (difference / torch.linalg.matrix_norm(problem.reference, ord="fro")).max().item()
    return Record(
        label=label,
        block_size=size,
        n=num_blocks,
        method=method,
        ms=1e3 * min(times),
        ratio_to_eigh=float("nan"),
        square_matmuls=square,
        pred_gflop=square * 2.0 * num_blocks * size**3 / 1e9,
        thin_gflop=timer.thin_flops / 1e9,
        matmul_ms=1e3 * matmul_s,
        other_ms=1e3 * (total_s - matmul_s),
        ideal_ms=1e3 * square * bmm_s,
        bmm_gflops=2.0 * num_blocks * size**3 / bmm_s / 1e9,
        launches=counts.launch_count,
        syncs=counts.sync_count,
        iterations=sum(len(p) for p in passes),
        converged_by=[next((i + 1 for i, active in enumerate(p) if active == 0), -1) for p in passes],
        max_rel_err=error,
    )


COLUMNS = (
    ("label", "{}"),
    ("block_size", "{}"),
    ("method", "{}"),
    ("ms", "{:.1f}"),
    ("ratio_to_eigh", "{:.1f}"),
    ("square_matmuls", "{}"),
    ("pred_gflop", "{:.1f}"),
    ("ideal_ms", "{:.1f}"),
    ("matmul_ms", "{:.1f}"),
    ("other_ms", "{:.1f}"),
    ("bmm_gflops", "{:.0f}"),
    ("launches", "{}"),
    ("syncs", "{}"),
    ("iterations", "{}"),
    ("converged_by", "{}"),
    ("max_rel_err", "{:.2e}"),
)


def print_table(records: list[Record]) -> None:
    rows = [[spec.format(asdict(record)[key]) for key, spec in COLUMNS] for record in records]
    print(format_columns([key for key, _ in COLUMNS], rows))


def main() -> None:
    args = parse_args()
    config = DashConfig()
    torch.manual_seed(0)
    records = []
    for size in args.block_sizes:
        problem = make_problem(args.num_blocks, size, config)
        bmm_s = plain_bmm_seconds(args.num_blocks, size)
        block = [measure(problem, method, args.label, args.repetitions, bmm_s, config) for method in args.methods]
        eigh_ms = next((record.ms for record in block if record.method == "eigh"), float("nan"))
        for record in block:
            record.ratio_to_eigh = record.ms / eigh_ms
        records += block
        print_table(block)
        print(flush=True)
    print_table(records)
    stored = json.loads(args.output.read_text()) if args.output.exists() else {}
    stored[args.label] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "records": [asdict(record) for record in records],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(stored, indent=2) + "\n")
    print(f"wrote {args.output} [{args.label}]")


if __name__ == "__main__":
    main()
