"""DASH's optimizer step on one GPU at each matmul precision: time, roofline, memory, accuracy, kernels.

GPT-2 124M's parameter shapes (``_step_time_cases.MODELS``), fixed random gradients, no model. Cases:
``adamw`` (fused) and DASH at its defaults (block 1024, roots every ``f`` = 10 steps, the solver
"auto" picks) with ``matmul_precision`` float32, tf32 and tf32x3 (``--precisions``), and with
``--compile`` the same with ``compile=True``.

* **Time.** Cases interleaved over ``--rounds`` rounds; in each, a fresh optimizer takes
  ``--warmup`` untimed steps, then ``2 f`` steps timed one by one (device synchronised around
  each). DASH's steps are split by kind: ``refresh_ms`` (steps that recompute the roots, the
  median) and ``plain_ms`` (the others, the median); ``optimizer_step_ms`` is the amortised step
  ``(refresh_ms + (f - 1) plain_ms) / f``. ``roofline_ms`` is ``benchmarks/speed/roofline.py``'s H100
  estimate for the same model, block size and f in the precision's column (tf32x3: the TF32 column
  with three times the matmul work).
* **Memory.** ``state_bytes``: what ``torch.cuda.memory_allocated`` grew by from before the
  optimizer was built to after its steps (gradients exist before); ``state_bytes_per_param`` per
  model parameter; DASH's own count (``DASH.state_bytes``) beside it.
* **Accuracy.** One step from the same state in float64 (the same solver) is the reference:
  ``update_error`` is ``||u - u64|| / ||u64||`` of the first step's update (roots computed at it).
* **Kernels.** ``--profile``: a ``torch.profiler`` trace of one window of ``f`` steps of the
  default case: kernel launches per step and the 15 kernels with the most device time.

Output: ``<out>/gpu_step_<device>.json``, a list of records with ``device`` (as torch names it),
``date``, ``commit``. On a CPU the same runs at a small size (``--model gpt-2.5m``; TF32 is emulated)::

    python3 benchmarks/speed/gpu_step.py --device cuda --profile --compile
    .venv/bin/python benchmarks/speed/gpu_step.py --device cpu --model gpt-2.5m --rounds 1 --out /tmp
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _stamp import stamp
from _step_time_cases import MODELS, build_adamw, make_parameters, model_parameter_shapes
from common import device_label, format_columns, resolve_device, results_parser, synchronize, write_json

from lightning_dash import DASH
from lightning_dash.optim.precision import resolve as resolve_precision

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

FREQUENCY = 10
BLOCK_SIZE = 1024
LR = 1e-3


def parse_args(argv: list[str] | None = None):  # noqa: ANN201 - argparse.Namespace
    parser = results_parser(__doc__.splitlines()[0], RESULTS_DIR, None, "cuda (default when available) or cpu")
    parser.add_argument("--model", default="gpt2-125m", choices=sorted(MODELS))
    parser.add_argument("--precisions", nargs="+", default=["float32", "tf32", "tf32x3"])
    parser.add_argument("--compile", action="store_true", help="also each precision with compile=True")
    parser.add_argument("--profile", action="store_true", help="kernel table of the default case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args(argv)


def dash(params: list[Tensor], precision: str, compiled: bool, **options: Any) -> DASH:
    """DASH at its defaults but for the case's precision (and compile)."""
    return DASH(params, lr=LR, block_size=BLOCK_SIZE, matmul_precision=precision, compile=compiled, **options)


def timed_steps(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``steps`` steps, the device synchronised around each."""
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return times


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def measure_case(
    build: Callable[[], torch.optim.Optimizer], warmup: int, device: torch.device
) -> tuple[list[float], list[bool], int | None, int | None]:
    """One round: (step ms, whether each step refreshed roots, allocator growth, DASH's own count)."""
    gc.collect()  # an earlier case's optimizer (DASH holds reference cycles) must not count here
    synchronize(device)
    before = allocated(device)
    optimizer = build()
    steps = warmup + 2 * FREQUENCY
    ms = timed_steps(optimizer, steps, device)
    # DASH refreshes at steps 1, 1 + f, ...: the 1-based step t refreshes when (t - 1) % f == 0.
    refreshed = [isinstance(optimizer, DASH) and (t - 1) % FREQUENCY == 0 for t in range(1, steps + 1)]
    after = allocated(device)
    own = int(optimizer.state_bytes()) if isinstance(optimizer, DASH) else None
    del optimizer
    return ms[warmup:], refreshed[warmup:], None if before is None else after - before, own


def update_error(shapes: list, device: torch.device, precision: str, method: str) -> float:
    """``||u - u64|| / ||u64||`` of the first step's update at ``precision`` against float64."""
    updates = []
    for dtype in (torch.float64, torch.float32):
        params, grads = make_parameters(shapes, device)
        params = [p.detach().to(dtype).requires_grad_(True) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        start = [p.detach().clone() for p in params]
        optimizer = dash(params, precision, False, inverse_root_method=method, precondition_frequency=FREQUENCY)
        optimizer.step()
        updates.append(torch.cat([(p.detach() - s).double().reshape(-1) for p, s in zip(params, start)]))
        del optimizer, params, grads, start
        if device.type == "cuda":
            torch.cuda.empty_cache()
    reference, update = updates
    return float((update - reference).norm() / reference.norm())


def roofline_ms(model: str, precision: str) -> float | None:
    """``benchmarks/speed/roofline.py``'s H100 estimate of DASH's step at f = 10 in ``precision``'s column."""
    import roofline

    if model not in roofline.MODELS:
        return None
    column = {c.name: c for c in roofline.columns(roofline.H100_SXM)}
    if precision == "tf32x3":
        tf32 = column["tf32"]
        column["tf32x3"] = type(tf32)("tf32x3", 4, tf32.matmul_flops / 3, tf32.root_dtype, tf32.root_gemm_bytes)
    name = {"float32": "fp32"}.get(precision, precision)
    return roofline.estimate(model, roofline.MODELS[model], BLOCK_SIZE, FREQUENCY, column[name]).dash_ms


def profile_window(params: list[Tensor], device: torch.device) -> dict[str, Any]:
    """Kernel launches per step and the kernels with the most device time over ``f`` steps of
    the default case (after one warm window)."""
    from torch.profiler import ProfilerActivity, profile

    optimizer = DASH(params, lr=LR, block_size=BLOCK_SIZE)
    timed_steps(optimizer, FREQUENCY, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as trace:
        timed_steps(optimizer, FREQUENCY, device)
    kernels = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    totals: dict[str, list[float]] = {}
    for event in kernels:
        entry = totals.setdefault(event.name[:120], [0.0, 0])
        entry[0] += event.device_time / 1e3
        entry[1] += 1
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:15]
    return {
        "kernels_per_step": len(kernels) / FREQUENCY,
        "kernel_ms_per_step": sum(v[0] for v in totals.values()) / FREQUENCY,
        "top_kernels": [
            {"name": n, "ms_per_step": v[0] / FREQUENCY, "launches_per_step": v[1] / FREQUENCY} for n, v in top
        ],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    shapes = model_parameter_shapes(args.model)
    params, grads = make_parameters(shapes, device)
    for p, g in zip(params, grads):
        p.grad = g
    count = sum(p.numel() for p in params)
    method = DASH(params[:1]).inverse_root_method_in_use
    cases: dict[str, Callable[[], torch.optim.Optimizer]] = {"adamw": lambda: build_adamw(params)}
    for precision in args.precisions:
        cases[f"dash_{precision}"] = lambda precision=precision: dash(params, precision, False)
        if args.compile:
            cases[f"dash_{precision}_compiled"] = lambda precision=precision: dash(params, precision, True)
    samples: dict[str, list[tuple[list[float], list[bool], int | None, int | None]]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, build in cases.items():
            samples[name].append(measure_case(build, args.warmup, device))
    path = args.out / f"gpu_step_{device_label(device)}.json"
    records = [record(name, runs, args, device, count) for name, runs in samples.items()]
    write_json(path, records)  # the timings are kept even if what follows fails
    for entry in records:
        if entry["optimizer"] == "dash" and not entry["compile"]:
            entry["update_error"] = update_error(shapes, device, entry["matmul_precision"], method)
            entry["roofline_ms"] = roofline_ms(args.model, entry["matmul_precision"])
            if entry["roofline_ms"]:
                entry["roofline_ratio"] = entry["optimizer_step_ms"] / entry["roofline_ms"]
            write_json(path, records)
    if args.profile:
        records.append({**stamp(device), "model": args.model, "profile": profile_window(params, device)})
        write_json(path, records)
    print_table(records)
    print(f"wrote {path}")
    return records


def record(name: str, runs: list, args: Any, device: torch.device, count: int) -> dict[str, Any]:
    """One case's record from its rounds."""
    times = [t for ms, _, _, _ in runs for t in ms]
    kinds = [k for _, refreshed, _, _ in runs for k in refreshed]
    refresh = [t for t, k in zip(times, kinds) if k]
    plain = [t for t, k in zip(times, kinds) if not k]
    grown = [g for _, _, g, _ in runs if g is not None]
    own = [o for _, _, _, o in runs if o is not None]
    is_dash = name != "adamw"
    plain_ms = statistics.median(plain)
    refresh_ms = statistics.median(refresh) if refresh else None
    amortised = (refresh_ms + (FREQUENCY - 1) * plain_ms) / FREQUENCY if refresh_ms is not None else plain_ms
    state = min(grown) if grown else own[0] if own else None
    return {
        **stamp(device),
        "model": args.model,
        "params": count,
        "optimizer": "dash" if is_dash else "adamw",
        "case": name,
        "matmul_precision": resolve_precision(name.split("_")[1]) if is_dash else None,
        "compile": name.endswith("_compiled"),
        "block_size": BLOCK_SIZE if is_dash else None,
        "precondition_frequency": FREQUENCY if is_dash else None,
        "optimizer_step_ms": amortised,
        "plain_ms": plain_ms,
        "refresh_ms": refresh_ms,
        "mean_ms": statistics.fmean(times),
        "step_ms_samples": [round(t, 3) for t in times],
        "roofline_ms": None,
        "state_bytes": state,
        "state_bytes_per_param": None if state is None else state / count,
        "dash_state_bytes": own[0] if own else None,
        "update_error": None,
    }


def print_table(records: list[dict[str, Any]]) -> None:
    rows = []
    adamw = next(r["optimizer_step_ms"] for r in records if r.get("case") == "adamw")
    for r in records:
        if "case" not in r:
            continue

        def cell(value: float | None, spec: str) -> str:
            return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

        rows.append(
            [
                r["case"],
                cell(r["optimizer_step_ms"], ".2f"),
                cell(r["optimizer_step_ms"] / adamw, ".1f"),
                cell(r["plain_ms"], ".2f"),
                cell(r["refresh_ms"], ".1f"),
                cell(r["roofline_ms"], ".2f"),
                cell(r["state_bytes_per_param"], ".1f"),
                cell(r["update_error"], ".1e"),
            ]
        )
    header = ["case", "step ms", "x AdamW", "plain ms", "refresh ms", "roofline ms", "B/param", "update err"]
    print(format_columns(header, rows))


if __name__ == "__main__":
    main()
