"""A long run with loss spikes: does any solver or matmul dtype ever leave a NaN behind?

A small byte-level TinyGPT (the main job's model, narrowed so that 10,000 steps take
minutes) trains on stdlib source with a plain PyTorch loop, once per solver and matmul
dtype, with the same batches. Every ``--spike-every`` steps the loss is multiplied by
1e12 for one step (a loss spike: huge but finite gradients), and half-way between two
spikes by ``inf`` (a bad batch: non-finite gradients). AdamW runs the same schedule for
comparison.

Reported per run: steps whose parameters were not all finite (must be 0 for DASH),
root failures, skipped steps, the largest Newton residual seen, the final validation
loss and its difference from the float32 ``eigh`` run. Output:
``soak_<device>.json`` in ``--out`` (default ``benchmarks/numerics/results``), and a table.

Run from the repository root (the default, 10 runs of 10,000 steps, took about
23 minutes of one core: 100 s per float32 configuration, 200 s per float16 one)::

    .venv/bin/python benchmarks/numerics/soak.py
    .venv/bin/python benchmarks/numerics/soak.py --steps 200 --spike-every 50   # a quick look
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from common import (
    build_optimizer,
    device_label,
    markdown_table,
    resolve_device,
    validation_loss,
    warmup_cosine,
    write_json,
)

from lightning_dash import DASH
from lightning_dash.showcase import ByteCorpus, TinyGPT, load_stdlib_corpus

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

SPIKE = 1e12
#: (solver, matmul dtype) pairs; eigh has no matmul dtype of its own.
CONFIGURATIONS = [("eigh", "float32")] + [
    (solver, dtype)
    for solver in ("newton_db", "coupled_newton", "chebyshev")
    for dtype in ("float32", "bfloat16", "float16")
]


@dataclass
class SoakResult:
    """One run: how often it went wrong and where it ended."""

    device: str
    optimizer: str
    solver: str | None
    matmul_dtype: str | None
    steps: int
    spikes: int
    bad_batches: int
    nonfinite_parameter_steps: int
    root_failures: int
    nonfinite_grad_skips: int
    nonfinite_update_skips: int
    max_root_residual: float | None
    final_val_loss: float
    val_loss_vs_eigh: float | None
    wall_s: float


def loss_factor(step: int, spike_every: int) -> float:
    """1e12 at each spike, inf half-way between spikes, 1 otherwise (steps count from 1)."""
    if step % spike_every == 0:
        return SPIKE
    if step % spike_every == spike_every // 2:
        return math.inf
    return 1.0


def soak(
    name: str,
    solver: str | None,
    matmul_dtype: str | None,
    args: argparse.Namespace,
    corpus: ByteCorpus,
    device: torch.device,
) -> SoakResult:
    torch.manual_seed(0)
    model = TinyGPT(context=args.context, width=args.width, depth=args.depth, heads=2).to(device)
    options = {"lr": args.lr, "betas": (0.9, 0.95)}
    if name == "dash":
        options.update(
            block_size=args.block_size,
            precondition_frequency=10,
            inverse_root_method=solver,
            matmul_dtype=matmul_dtype,
            max_consecutive_root_failures=None,
        )
    optimizer = build_optimizer(name, model.parameters(), **options)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps // 50, args.steps))
    data = torch.Generator().manual_seed(0)
    nonfinite, spikes, bad, residual = 0, 0, 0, None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, targets = corpus.batch("train", args.batch_size, args.context, data)
        factor = loss_factor(step, args.spike_every)
        spikes += factor == SPIKE
        bad += math.isinf(factor)
        optimizer.zero_grad(set_to_none=True)
        (model.loss(tokens.to(device), targets.to(device)) * factor).backward()
        optimizer.step()
        schedule.step()
        if isinstance(optimizer, DASH) and optimizer.last_root_residual is not None:
            residual = max(residual or 0.0, float(optimizer.last_root_residual))
        nonfinite += not all(bool(torch.isfinite(p).all()) for p in model.parameters())
    wall = time.perf_counter() - start
    final = validation_loss(model, corpus, 32, args.context, 8, eval_mode=False) if nonfinite == 0 else math.nan
    dash = optimizer if isinstance(optimizer, DASH) else None
    return SoakResult(
        device=device_label(device),
        optimizer=name,
        solver=solver,
        matmul_dtype=matmul_dtype,
        steps=args.steps,
        spikes=spikes,
        bad_batches=bad,
        nonfinite_parameter_steps=nonfinite,
        root_failures=dash.root_failure_count if dash else 0,
        nonfinite_grad_skips=dash.nonfinite_grad_skips if dash else 0,
        nonfinite_update_skips=dash.nonfinite_update_skips if dash else 0,
        max_root_residual=residual,
        final_val_loss=final,
        val_loss_vs_eigh=None,
        wall_s=wall,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--spike-every", type=int, default=1_000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--configurations",
        nargs="+",
        default=None,
        help="solver:dtype pairs (default: every solver with every matmul dtype)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[SoakResult]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    corpus = load_stdlib_corpus(max_bytes=1_000_000)
    pairs = CONFIGURATIONS if args.configurations is None else [tuple(c.split(":")) for c in args.configurations]
    print(f"{device_label(device)}, torch {torch.__version__}; {args}")
    results = [soak("adamw", None, None, args, corpus, device)]
    for solver, dtype in pairs:
        results.append(soak("dash", solver, dtype, args, corpus, device))
        last = results[-1]
        print(
            f"  {solver:<15} {dtype:<9} non-finite steps {last.nonfinite_parameter_steps}, "
            f"root failures {last.root_failures}, val loss {last.final_val_loss:.4f} ({last.wall_s:.0f} s)",
            flush=True,
        )
    eigh = next((r for r in results if r.solver == "eigh" and r.matmul_dtype == "float32"), None)
    for result in results:
        if eigh is not None and math.isfinite(result.final_val_loss):
            result.val_loss_vs_eigh = result.final_val_loss - eigh.final_val_loss
    rows = [
        [
            r.optimizer,
            r.solver or "-",
            r.matmul_dtype or "-",
            r.nonfinite_parameter_steps,
            r.root_failures,
            f"{r.nonfinite_grad_skips} / {r.nonfinite_update_skips}",
            "-" if r.max_root_residual is None else f"{r.max_root_residual:.1e}",
            f"{r.final_val_loss:.4f}",
            "-" if r.val_loss_vs_eigh is None else f"{r.val_loss_vs_eigh:+.4f}",
        ]
        for r in results
    ]
    print(
        "\n"
        + markdown_table(
            [
                "optimizer",
                "solver",
                "matmul dtype",
                "non-finite steps",
                "root failures",
                "skipped (grad / update)",
                "max residual",
                "final val loss",
                "vs fp32 eigh",
            ],
            rows,
        )
    )
    print(f"wrote {write_json(args.out / f'soak_{device_label(device)}.json', results, indent=1)}")
    return results


if __name__ == "__main__":
    main()
