"""Training-step time of a GPT-style model: AdamW, synchronous DASH, asynchronous DASH.

The model is the repository's :class:`~lightning_dash.showcase.TinyGPT` at GPT-2-small
shape (12 layers, width 768, 12 heads, vocabulary 50257, context 1024; 163M
parameters with its untied head), trained on random tokens (only time is measured)
with the forward pass under bf16 autocast. For each configuration the step
(forward, backward, optimizer step) runs ``--warmup`` times, then ``--steps`` times
between two device synchronisations; ``step_ms`` is the mean of the latter, so with
``--steps`` a multiple of 10 every root step of frequency 10 is counted in proportion.

Configurations: ``adamw`` (torch AdamW, fused on CUDA), ``dash_sync`` and
``dash_async`` (``async_preconditioning=True``, ``--max-staleness``) at
``precondition_frequency`` 1 and 10, block size 1024. The table gives each step time
and its ratio to AdamW; the records go to ``benchmarks/speed/results/async_overlap_<device>.json``
as ``{"device", "optimizer", "precondition_frequency", "step_ms"}``.

On a GPU, from the repository root::

    PYTHONPATH=. python benchmarks/speed/async_overlap.py --device cuda

``--smoke`` runs a tiny configuration for a few steps (it works on CPU, where
asynchronous DASH is the synchronous path); it writes a file only with ``--output``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from common import build_optimizer, markdown_table, synchronize, write_json

from lightning_dash import DASH
from lightning_dash.showcase import TinyGPT

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Config:
    context: int
    width: int
    depth: int
    heads: int
    vocab: int
    batch_size: int
    block_size: int
    warmup: int
    steps: int


FULL = Config(
    context=1024, width=768, depth=12, heads=12, vocab=50257, batch_size=8, block_size=1024, warmup=10, steps=30
)
SMOKE = Config(context=32, width=32, depth=2, heads=2, vocab=256, batch_size=2, block_size=16, warmup=1, steps=2)


@dataclass
class Record:
    device: str
    optimizer: str
    precondition_frequency: int | None
    step_ms: float


def make_optimizer(
    kind: str,
    model: torch.nn.Module,
    frequency: int | None,
    config: Config,
    args: argparse.Namespace,
    device: torch.device,
) -> torch.optim.Optimizer:
    """``adamw`` or ``dash_sync`` / ``dash_async`` with the shared lr, betas and weight decay."""
    options = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if kind == "adamw":
        return build_optimizer("adamw", model.parameters(), **options, fused=device.type == "cuda")
    return build_optimizer(
        "dash",
        model.parameters(),
        **options,
        block_size=config.block_size,
        precondition_frequency=frequency,
        inverse_root_method=args.inverse_root_method,
        matmul_dtype=args.matmul_dtype,
        async_preconditioning=kind == "dash_async",
        max_staleness=args.max_staleness,
    )


def measure(kind: str, frequency: int | None, config: Config, args: argparse.Namespace, device: torch.device) -> float:
    """Mean milliseconds of one training step after warm-up."""
    torch.manual_seed(0)
    model = TinyGPT(
        context=config.context, width=config.width, depth=config.depth, heads=config.heads, vocab=config.vocab
    ).to(device)
    optimizer = make_optimizer(kind, model, frequency, config, args, device)
    generator = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, config.vocab, (config.batch_size, config.context + 1), device=device, generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model.loss(inputs, targets)
        loss.backward()
        optimizer.step()

    for _ in range(config.warmup):
        step()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(config.steps):
        step()
    synchronize(device)
    elapsed_ms = (time.perf_counter() - started) * 1e3 / config.steps
    if isinstance(optimizer, DASH) and optimizer.async_preconditioning:
        print(
            f"  {kind} f={frequency}: hidden {optimizer.async_roots_hidden}, waited "
            f"{optimizer.async_roots_waited}, main-stream wait {optimizer.async_wait_ms:.1f} ms"
        )
    return elapsed_ms


def print_table(records: list[Record]) -> None:
    adamw = next(r.step_ms for r in records if r.optimizer == "adamw")
    rows = [
        [
            r.optimizer,
            "-" if r.precondition_frequency is None else r.precondition_frequency,
            f"{r.step_ms:.2f}",
            f"{r.step_ms / adamw:.3f}",
        ]
        for r in records
    ]
    print("\n" + markdown_table(["optimizer", "precondition_frequency", "step ms", "ratio to AdamW"], rows))


def main(argv: list[str] | None = None) -> list[Record]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps (a quick check, not a result)")
    parser.add_argument("--frequencies", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--inverse-root-method", default="newton_db")
    parser.add_argument("--matmul-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON path (default: benchmarks/speed/results/async_overlap_<device>.json; none with --smoke)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = SMOKE if args.smoke else FULL
    if args.batch_size is not None:
        config = replace(config, batch_size=args.batch_size)
    if args.steps is not None:
        config = replace(config, steps=args.steps)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device {device_name}; model width {config.width}, depth {config.depth}, context {config.context}, "
        f"vocab {config.vocab}, batch {config.batch_size}; block {config.block_size}, "
        f"{args.inverse_root_method} ({args.matmul_dtype} matmuls), max_staleness {args.max_staleness}"
    )

    runs: list[tuple[str, int | None]] = [("adamw", None)]
    runs += [(kind, f) for f in args.frequencies for kind in ("dash_sync", "dash_async")]
    records = []
    threads = torch.get_num_threads()
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors: extra threads only contend with other processes
    try:
        for kind, frequency in runs:
            step_ms = measure(kind, frequency, config, args, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the previous model and optimizer are gone
            records.append(Record(device_name, kind, frequency, step_ms))
            print(f"{kind:>10} f={frequency}: {step_ms:.2f} ms/step")
    finally:
        torch.set_num_threads(threads)
    print_table(records)

    output = args.output
    if output is None and not args.smoke:
        output = RESULTS_DIR / f"async_overlap_{device.type}.json"
    if output is not None:
        print(f"\nwrote {write_json(output, records)}")
    return records


if __name__ == "__main__":
    main()
