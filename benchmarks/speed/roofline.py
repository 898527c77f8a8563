"""Roofline model of one DASH optimizer step on an H100 SXM, next to AdamW: arithmetic, nothing timed.

Why: no GPU is available where DASH is developed, yet the question "what does a DASH step
cost on an H100, relative to AdamW?" needs an answer that a GPU run can then confirm or
refute. This script counts, from the parameter shapes alone, the floating-point operations
and the HBM bytes of every part of a step, and takes for each part the larger of
``FLOPs / peak`` and ``bytes / bandwidth`` (a roofline); the parts' times are summed.

Shapes: GPT-2 small, medium and large (``benchmarks/speed/step_time.py``'s helper and models), a
1.3B GPT (GPT-3 XL's shape) and Llama-3-8B (``benchmarks/distributed/fsdp_estimate.py``'s shape list
without Qwen3's per-head norms). Blocks come from DASH's own tiling
(:func:`lightning_dash.optim.stacks.blocks.param_regions`): every parameter of two or more dims
is cut into ``block_size`` tiles; 1-D parameters get Adam only.

Parts of a DASH step, per ``m x n`` block (``E = m n`` elements, ``F = m^2 + n^2`` factor entries):

* ``statistics``: ``L += G G^T``, ``R += G^T G``: ``2 m n (m + n)`` FLOPs; reads the fp32
  gradient block twice (both operands) and L, R, writes L, R.
* ``direction``: ``L^(-1/4) M R^(-1/4)``: ``2 m n (m + n)`` FLOPs; reads both roots and M,
  writes and reads back the intermediate ``L^(-1/4) M``, writes the direction.
* ``elementwise``: grafting Adam, momentum, factor scaling, graft norm, the update applied
  to the parameter, counted as one fused pass over each tensor (``BLOCK_PARAM_PASSES``,
  ``BLOCK_STATE_PASSES``); the temporaries of today's eager code are not counted.
* ``grafting norm``: with ``--grafting-norm spectral`` (the default of version 0.6; 0.7's is DASH's
  default, Frobenius, whose norms are in ``elementwise``), spectral grafting's power iterations on the
  Shampoo direction and the Adam step of every block (``SPECTRAL_READS`` reads of the block, 2 FLOPs per
  element each).
* ``packing``: each side's factor and root share one tensor, so the root is formed from its
  triangle for the direction and the new factor's triangle is written back into the pair
  (``PACKING_PASSES`` fp32 passes over each side per step).
* ``vectors``: Adam on the 1-D parameters.
* ``commit`` (eager only): the step commits its candidate state with
  ``torch.where(bad, old, new, out=old)``, so a step with a non-finite value is skipped on
  the device without a host sync: three more fp32 passes per state tensor (read old, read
  new, and the candidate's own write). ``compile=True`` fuses them away;
  ``dash_ms_without_commit`` leaves them out (as does today's commit, which swaps the
  candidate tensors in before the on-device commit).
* ``root matmuls`` and ``root elementwise``: Newton-DB inverse fourth roots of both factors,
  amortised over the precondition frequency ``f``; its iteration count is the one
  :func:`~lightning_dash.optim.roots.newton.planned_scaled_iterations` plans for the
  default relative epsilon 1e-6 (one scaled coupled pass for ``A^(-1/4)``, what ``auto``
  picks on CUDA). ``eigh`` (``auto``'s choice on CPU) is not a matmul workload: the time of cuSOLVER's
  eigendecomposition is not modelled; the records give its FLOPs and, per factor size, the
  time one decomposition must stay under for eigh to beat Newton-DB (``eigh_break_even_ms``).

Columns: ``bf16`` (bf16 parameters and gradients, every matmul at the bf16 tensor-core rate,
the root solver planned for ``matmul_dtype=bfloat16``), ``tf32`` (fp32 parameters, matmuls
at the TF32 rate), ``fp32`` (fp32 parameters, matmuls at the plain FP32 rate: PyTorch's
default ``float32_matmul_precision="highest"`` does not use TF32). Optimizer state is fp32
in every column. Kernel-launch latency, caches and overlap are outside the model.

Run from the repository root (the table is printed; the records go to
``benchmarks/speed/results/roofline_h100.json``)::

    .venv/bin/python benchmarks/speed/roofline.py
    .venv/bin/python benchmarks/speed/roofline.py --block-size 512 --out /tmp/roofline

A GPU user checks the prediction with ``python benchmarks/speed/step_time.py --device cuda --model gpt2-125m``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _roofline_counts import (
    ADAMW_FLOPS,
    BLOCK_ELEMENTWISE_FLOPS,
    BLOCK_PARAM_PASSES,
    BLOCK_STATE_PASSES,
    COMMIT_PASSES,
    EIGH_FLOPS,
    EIGH_PASSES,
    EIGH_RECONSTRUCTION_FLOPS,
    MODELS,
    NEWTON_GEMMS_PER_ITERATION,
    NEWTON_PASSES_PER_ITERATION,
    NEWTON_SETUP_PASSES,
    STATE_BYTES,
    VECTOR_ELEMENTWISE_FLOPS,
    Shapes,
    adamw_bytes_per_element,
    block_commit_bytes,
    block_counts,
    block_elementwise_bytes,
    direction_bytes,
    direction_flops,
    eigh_flops,
    factor_sides,
    newton_db_iterations,
    newton_root_elementwise_bytes,
    newton_root_elementwise_flops,
    newton_root_flops,
    newton_root_gemm_bytes,
    packing_bytes,
    spectral_grafting_bytes,
    spectral_grafting_flops,
    statistics_bytes,
    statistics_flops,
    vector_bytes_per_element,
    vector_elements,
)
from _stamp import stamp
from _state_bytes import block_state_bytes
from common import format_columns, write_json

from lightning_dash.optim.config import DashConfig

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

RESULTS_NAME = "roofline_h100.json"


# ---------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Hardware:
    """Peak rates of one GPU (dense, no sparsity)."""

    name: str
    bf16_flops: float
    tf32_flops: float
    fp32_flops: float
    bandwidth: float  # bytes per second
    source: str


H100_SXM = Hardware(
    name="H100 SXM5 80GB",
    bf16_flops=989e12,
    tf32_flops=494e12,
    fp32_flops=67e12,
    bandwidth=3.35e12,
    source=(
        "NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 tensor core 1,979 and TF32 989 TFLOP/s "
        "'with sparsity' (halved here for dense), FP32 67 TFLOP/s, HBM3 3.35 TB/s"
    ),
)


@dataclass(frozen=True)
class Column:
    """One precision setting of the table."""

    name: str
    param_bytes: int  # parameters and gradients
    matmul_flops: float
    root_dtype: torch.dtype  # what the Newton solver's matmuls run in (plans its iterations)
    #: bytes per b^2 of one root-solver GEMM: 2 operands + 1 result in fp32 (12), or, for
    #: bf16, DASH's ``bmm`` casts both operands to bf16 and the result back (24).
    root_gemm_bytes: int


def columns(hardware: Hardware) -> list[Column]:
    return [
        Column("bf16", 2, hardware.bf16_flops, torch.bfloat16, 24),
        Column("tf32", 4, hardware.tf32_flops, torch.float32, 12),
        Column("fp32", 4, hardware.fp32_flops, torch.float32, 12),
    ]


# ---------------------------------------------------------------------- roofline
def roofline_ms(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    """Milliseconds of one kernel (or batch of kernels) at whichever limit binds."""
    return 1e3 * max(flops / peak, nbytes / bandwidth)


@dataclass
class Part:
    """One part of a step, summed over every stack; ``ms`` sums each stack's roofline."""

    name: str
    flops: float = 0.0
    bytes: float = 0.0
    ms: float = 0.0
    memory_ms: float = 0.0  # the share of ``ms`` spent in bandwidth-bound stacks

    def add(self, flops: float, nbytes: float, peak: float, bandwidth: float, share: float = 1.0) -> None:
        """Add one stack's work; ``share`` amortises it (``1 / f`` for the roots)."""
        ms = roofline_ms(flops, nbytes, peak, bandwidth)
        self.flops += share * flops
        self.bytes += share * nbytes
        self.ms += share * ms
        if nbytes / bandwidth >= flops / peak:
            self.memory_ms += share * ms

    @property
    def bound(self) -> str:
        return "memory" if self.memory_ms >= 0.5 * self.ms else "compute"


PART_NAMES = (
    "statistics",
    "direction",
    "elementwise",
    "grafting norm",
    "packing",
    "vectors",
    "root matmuls",
    "root elementwise",
    "commit",
)


def dash_parts(
    blocks: Counter[tuple[int, int]],
    vectors: int,
    column: Column,
    hardware: Hardware,
    frequency: int,
    grafting_norm: str = DashConfig().grafting_norm,
) -> list[Part]:
    """Every part of one DASH step, Newton-DB roots amortised over ``frequency`` steps."""
    bw, fp32, matmul = hardware.bandwidth, hardware.fp32_flops, column.matmul_flops
    parts = {name: Part(name) for name in PART_NAMES}
    for (rows, cols), n in blocks.items():
        parts["statistics"].add(n * statistics_flops(rows, cols), n * statistics_bytes(rows, cols), matmul, bw)
        parts["direction"].add(n * direction_flops(rows, cols), n * direction_bytes(rows, cols), matmul, bw)
        elementwise_flops = n * rows * cols * BLOCK_ELEMENTWISE_FLOPS
        parts["elementwise"].add(
            elementwise_flops, n * block_elementwise_bytes(rows, cols, column.param_bytes), fp32, bw
        )
        parts["commit"].add(0.0, n * block_commit_bytes(rows, cols), fp32, bw)
        if grafting_norm == "spectral":
            parts["grafting norm"].add(
                n * spectral_grafting_flops(rows, cols), n * spectral_grafting_bytes(rows, cols), fp32, bw
            )
        parts["packing"].add(0.0, n * packing_bytes(rows, cols), fp32, bw)
    parts["vectors"].add(
        vectors * VECTOR_ELEMENTWISE_FLOPS, vectors * vector_bytes_per_element(column.param_bytes), fp32, bw
    )
    parts["commit"].add(0.0, vectors * 2 * COMMIT_PASSES * STATE_BYTES, fp32, bw)
    share = 1.0 / frequency
    for side, n in factor_sides(blocks).items():
        steps = newton_db_iterations(column.root_dtype, side)
        gemm_bytes = newton_root_gemm_bytes(side, steps, column.root_gemm_bytes)
        parts["root matmuls"].add(n * newton_root_flops(side, steps), n * gemm_bytes, matmul, bw, share)
        flops, nbytes = newton_root_elementwise_flops(side), newton_root_elementwise_bytes(side, steps)
        parts["root elementwise"].add(n * flops, n * nbytes, fp32, bw, share)
        parts["commit"].add(0.0, n * COMMIT_PASSES * STATE_BYTES * side * side, fp32, bw, share)
    return list(parts.values())


def newton_root_ms(side: int, column: Column, hardware: Hardware) -> float:
    """Modelled milliseconds of one Newton-DB root of a ``side x side`` factor (GEMMs and passes)."""
    steps = newton_db_iterations(column.root_dtype, side)
    gemm_bytes = newton_root_gemm_bytes(side, steps, column.root_gemm_bytes)
    gemms = roofline_ms(newton_root_flops(side, steps), gemm_bytes, column.matmul_flops, hardware.bandwidth)
    flops, nbytes = newton_root_elementwise_flops(side), newton_root_elementwise_bytes(side, steps)
    return gemms + roofline_ms(flops, nbytes, hardware.fp32_flops, hardware.bandwidth)


def eigh_break_even_ms(side: int, column: Column, hardware: Hardware) -> float:
    """The time one eigendecomposition of a ``side x side`` factor must stay under for the
    eigh path (decomposition, reconstruction GEMM, passes) to cost less than Newton-DB."""
    area = side * side
    reconstruction = roofline_ms(
        EIGH_RECONSTRUCTION_FLOPS * side**3, 3 * STATE_BYTES * area, column.matmul_flops, hardware.bandwidth
    )
    passes = roofline_ms(0.0, EIGH_PASSES * STATE_BYTES * area, hardware.fp32_flops, hardware.bandwidth)
    return newton_root_ms(side, column, hardware) - reconstruction - passes


# ---------------------------------------------------------------------- records
@dataclass(frozen=True)
class PartRecord:
    name: str
    gflop: float
    gbytes: float
    ms: float
    bound: str


@dataclass
class Estimate:
    """One model, precondition frequency and column: a DASH step (Newton-DB roots) and an AdamW step."""

    model: str
    column: str
    frequency: int
    block_size: int
    parameters: int
    matrix_elements: int
    vector_elements: int
    blocks: int
    #: both Newton-DB passes, for the largest factor side
    newton_iterations: int
    dash_gflop: float
    dash_gbytes: float
    #: eager, with the ``torch.where`` commit passes
    dash_ms: float
    #: without them: ``compile=True``, or today's commit, which swaps candidate tensors in
    dash_ms_without_commit: float
    adamw_gflop: float
    adamw_gbytes: float
    adamw_ms: float
    overhead: float
    overhead_without_commit: float
    memory_bound_parts: list[str]
    compute_bound_parts: list[str]
    #: eigh's FLOPs per step (amortised): counted, not timed
    eigh_gflop_per_step: float
    #: per factor side: the ms one eigendecomposition (cuSOLVER syevd) of that size must stay
    #: under for the default solver, eigh, to beat Newton-DB on this GPU
    eigh_break_even_ms: dict[str, float]
    #: factor matrices per root refresh, by side (eigh time per step = sum(count * t_eigh) / f)
    factor_matrices: dict[str, int]
    #: optimizer state: DASH's factors, roots, momentum and second moment (fp32), AdamW's m and v (fp32)
    dash_state_gb: float
    adamw_state_gb: float
    parts: list[PartRecord] = field(default_factory=list)


def estimate(
    model: str,
    shapes: Shapes,
    block_size: int,
    frequency: int,
    column: Column,
    hardware: Hardware = H100_SXM,
    grafting_norm: str = DashConfig().grafting_norm,
) -> Estimate:
    """Every count of one model's DASH and AdamW steps in one column."""
    dims = [shape for _, shape in shapes]
    blocks = block_counts(dims, block_size)
    vectors = vector_elements(dims)
    parameters = sum(math.prod(shape) for shape in dims)
    parts = dash_parts(blocks, vectors, column, hardware, frequency, grafting_norm)
    dash_ms = sum(part.ms for part in parts)
    without_commit_ms = sum(part.ms for part in parts if part.name != "commit")
    adamw_flops = ADAMW_FLOPS * parameters
    adamw_bytes = adamw_bytes_per_element(column.param_bytes) * parameters
    adamw_ms = roofline_ms(adamw_flops, adamw_bytes, hardware.fp32_flops, hardware.bandwidth)
    sides = factor_sides(blocks)
    return Estimate(
        model=model,
        column=column.name,
        frequency=frequency,
        block_size=block_size,
        parameters=parameters,
        matrix_elements=sum(rows * cols * n for (rows, cols), n in blocks.items()),
        vector_elements=vectors,
        blocks=sum(blocks.values()),
        newton_iterations=newton_db_iterations(column.root_dtype, max(sides)),
        dash_gflop=sum(part.flops for part in parts) / 1e9,
        dash_gbytes=sum(part.bytes for part in parts) / 1e9,
        dash_ms=dash_ms,
        dash_ms_without_commit=without_commit_ms,
        adamw_gflop=adamw_flops / 1e9,
        adamw_gbytes=adamw_bytes / 1e9,
        adamw_ms=adamw_ms,
        overhead=dash_ms / adamw_ms,
        overhead_without_commit=without_commit_ms / adamw_ms,
        memory_bound_parts=[part.name for part in parts if part.ms > 0 and part.bound == "memory"],
        compute_bound_parts=[part.name for part in parts if part.ms > 0 and part.bound == "compute"],
        eigh_gflop_per_step=sum(n * eigh_flops(side) for side, n in sides.items()) / frequency / 1e9,
        eigh_break_even_ms={str(side): eigh_break_even_ms(side, column, hardware) for side in sorted(sides)},
        factor_matrices={str(side): sides[side] for side in sorted(sides)},
        dash_state_gb=(sum(n * block_state_bytes(*shape) for shape, n in blocks.items()) + 2 * STATE_BYTES * vectors)
        / 1e9,
        adamw_state_gb=2 * STATE_BYTES * parameters / 1e9,
        parts=[PartRecord(p.name, p.flops / 1e9, p.bytes / 1e9, p.ms, p.bound) for p in parts],
    )


# ---------------------------------------------------------------------- output
def format_table(records: list[Estimate]) -> str:
    """One row per model and frequency, the three columns side by side."""
    by_key: dict[tuple[str, int], dict[str, Estimate]] = {}
    for record in records:
        by_key.setdefault((record.model, record.frequency), {})[record.column] = record
    header = ["model", "f", "GFLOP bf16/tf32", "GB bf16/fp32", "DASH ms bf16", "tf32", "fp32"]
    header += ["AdamW ms bf16/fp32", "x AdamW bf16", "tf32", "fp32", "compute-bound parts (tf32)"]
    rows = []
    for (model, frequency), cols in by_key.items():
        bf16, tf32, fp32 = cols["bf16"], cols["tf32"], cols["fp32"]
        rows.append(
            [
                model,
                str(frequency),
                f"{bf16.dash_gflop:,.0f} / {tf32.dash_gflop:,.0f}",
                f"{bf16.dash_gbytes:,.0f} / {tf32.dash_gbytes:,.0f}",
                *(f"{c.dash_ms:,.1f}" for c in (bf16, tf32, fp32)),
                f"{bf16.adamw_ms:.2f} / {tf32.adamw_ms:.2f}",
                *(f"{c.overhead:.0f}" for c in (bf16, tf32, fp32)),
                ", ".join(tf32.compute_bound_parts) or "none",
            ]
        )
    return format_columns(header, rows)


def assumptions(hardware: Hardware) -> dict:
    """Every modelling choice, for the JSON next to the numbers."""
    return {
        "hardware": asdict(hardware),
        "roofline": "per part and block shape: max(FLOPs / peak, bytes / HBM bandwidth), summed over parts; "
        "no kernel-launch latency, no cache reuse across kernels, no overlap",
        "columns": "bf16: 2-byte parameters and gradients, matmuls at the bf16 tensor-core rate, root solver planned "
        "for matmul_dtype=bfloat16 (its bmm casts fp32 operands, 24 bytes per b^2 per GEMM); tf32 / fp32: 4-byte "
        "parameters and gradients, matmuls at the TF32 / plain FP32 rate (PyTorch's default "
        "float32_matmul_precision='highest' is the fp32 column); optimizer state fp32 everywhere; every "
        "non-matmul FLOP at the FP32 rate",
        "roots": "Newton-DB, iterations from DASH's planner for the default relative epsilon 1e-6 and power-iteration "
        f"scaling, {NEWTON_GEMMS_PER_ITERATION} GEMMs and {NEWTON_PASSES_PER_ITERATION} fp32 passes per iteration "
        "(rescaling counted in every iteration: an upper bound, about half rescale), "
        f"{NEWTON_SETUP_PASSES} passes per root outside the iterations; amortised over f",
        "eigh": f"FLOPs {EIGH_FLOPS} b^3 (symmetric QR with vectors, Golub & Van Loan) + "
        f"{EIGH_RECONSTRUCTION_FLOPS} b^3 (reconstruction); the decomposition's GPU time is not modelled (cuSOLVER "
        "syevd is not a matmul workload); eigh_break_even_ms: what one decomposition per factor has to beat; "
        "measure with step_time.py --device cuda",
        "elementwise": f"fused passes: {BLOCK_PARAM_PASSES} in the parameter dtype and {BLOCK_STATE_PASSES} fp32 per "
        f"block element, {BLOCK_ELEMENTWISE_FLOPS} FLOPs; eager temporaries beyond these are not counted",
        "commit": f"eager torch.where(bad, old, new, out=old): {COMMIT_PASSES} fp32 passes per state tensor (momentum, "
        "second moment, L, R; the roots at root steps); dash_ms_without_commit leaves them out (compile=True)",
        "adamw": f"{ADAMW_FLOPS} FLOPs and 3 parameter-dtype + 4 fp32 passes per element",
        "check_on_gpu": "python benchmarks/speed/step_time.py --device cuda --model gpt2-125m",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=DashConfig().block_size)
    parser.add_argument("--frequencies", type=int, nargs="+", default=[1, 10], help="precondition frequencies f")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--grafting-norm",
        choices=["frobenius", "spectral"],
        default=DashConfig().grafting_norm,
        help="spectral: count spectral grafting's power iterations (default: DASH's default grafting norm)",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="results folder (default: benchmarks/speed/results)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    records = [
        estimate(model, MODELS[model], args.block_size, frequency, column, grafting_norm=args.grafting_norm)
        for model in args.models
        for frequency in args.frequencies
        for column in columns(H100_SXM)
    ]
    print(f"DASH (Newton-DB roots, block {args.block_size}, eager with commit passes) and AdamW on one {H100_SXM.name}")
    print(format_table(records))
    print(
        "f: roots every f steps, amortised; GB: HBM bytes per step; x AdamW: DASH ms / AdamW ms in the same column.\n"
        "eigh (what auto picks on CPU) is not modelled; eigh_break_even_ms in the JSON is what one eigh must beat."
    )
    report = {
        "computed": stamp(torch.device("cpu")),  # where and when the model was evaluated, at which commit
        "assumptions": assumptions(H100_SXM),
        "grafting_norm": args.grafting_norm,
        "epsilon": DashConfig().epsilon,
        "records": [asdict(record) for record in records],
    }
    print(f"\nwrote {write_json(args.out / RESULTS_NAME, report)}")
    return report


if __name__ == "__main__":
    main()
