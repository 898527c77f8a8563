"""Optimizer step time on the parameter shapes of GPT-style models.

Parameters with the shapes of a GPT (token and position embeddings tied to the
output head, fused QKV, 4x MLP, biases and LayerNorms) get fixed random
gradients; no model runs. Every optimizer below steps on the same parameters
and gradients:

* ``adamw``: ``torch.optim.AdamW`` (``fused=True`` where the device supports it,
  otherwise ``foreach=True``);
* ``dash``: :class:`lightning_dash.DASH` for every inverse-root solver and matmul
  dtype, with roots recomputed at every step (``precondition_frequency=1``);
  ``eigh`` has no matmul dtype and runs once (recorded as float32);
* ``shampoo_loop``: the same update one block at a time
  (``benchmarks/_shampoo_loop.py``, the structure of Distributed Shampoo), for the
  same solver, dtype and block size;
* ``dash_f10``: DASH with newton_db (float32; the default solver before 0.2) and roots every
  10 steps; one sample is the mean over 10 consecutive steps (one root
  computation amortised over its period);
* when installed, ``heavyball_soap`` (``heavyball.SOAP``), ``heavyball_shampoo``
  (``heavyball.KLShampoo``; heavyball 3.x has no plain Shampoo) and
  ``pytorch_optimizer_shampoo`` (``pytorch_optimizer.Shampoo``, full-matrix SVD
  roots, skipped when a dimension exceeds 8192), all eager, preconditioners
  refreshed every step. These are unblocked: their ``block_size`` is null.

``--suite peers`` times DASH against Meta's Distributed Shampoo instead (``make bench-step``):

* ``dash``: DASH with eigh roots, ``block_size`` 1024, Adam grafting, betas (0.9, 0.999),
  grafting beta2 0.999, at each ``--frequencies`` f (default 1 and 10);
* ``dash_default``: the same with the solver DASH picks when none is given (its default
  ``inverse_root_method``, recorded as ``solver``), so the table follows the default;
* ``dash_compiled``: ``dash_default`` with ``compile=True`` (compiled during the warm-up);
* ``meta_shampoo``: ``distributed_shampoo.DistributedShampoo`` (eigh, its default root
  solver) with the same block size, grafting, betas and f, built by
  ``benchmarks/_meta_shampoo.py`` (whose docstring lists the matched settings and why);
  skipped with a note when ``distributed_shampoo`` is not importable.

``--suite defaults`` times ``DASH(params, lr)`` with every other option at the installed package's
default (``dash_defaults``) against AdamW on ``--models``, a sample being the mean over 10 steps after at
least 10 untimed ones: what ``compare_revisions.py`` runs to compare two versions as their users find them
(records: ``<out>/step_time_defaults_<device>.json``).

The models are ``--models`` (default ``gpt-6.6m``, a GPT-2-style 6.6M, and
``matrices-8x1024``, eight 1024 x 1024 matrices and no vectors); all cases of all models are
interleaved in every round. At f > 1 one sample is the mean over f consecutive steps (one
root computation amortised over its period), and every case first takes at least f untimed
steps: Meta's Shampoo follows the Adam direction alone until its
``start_preconditioning_step`` (f, the smallest it accepts), so only then does each window
of f steps hold one root computation and f Shampoo steps for both. Records go to
``<out>/step_time_peers_<device>.json`` as a list of ``{"device", "model", "optimizer",
"solver", "frequency", "block_size", "step_ms", "ratio"}``, ``ratio`` being meta_shampoo's
``step_ms`` over this row's at the same model, f and block size (null on meta_shampoo's
rows and without it).

Measurement is interleaved so that noise hits every optimizer alike: in each of
``--rounds`` rounds (optimizers in a shuffled order), each optimizer is built
fresh on the shared parameters, stepped ``--warmup`` times, then timed for
``--samples`` samples, and freed (so only one optimizer's state is ever
allocated). ``step_ms`` is the minimum over all samples of all rounds: on a shared
machine other processes only ever add time, and with few samples (CPU steps take
seconds) one disturbed sample would shift a median (we saw 0.46 s and 5.6 s for the
same configuration in two rounds); the table also prints each row's spread,
max / min. On CPU, where the loop baseline costs as much as DASH, ``shampoo_loop``
is timed in every round; on GPU, where it is the slow one, in the first round only
(``--loop-rounds``). On CUDA the device is synchronised around every timed step.
AdamW gets five times the samples (it is cheap).

The table (with each row's time relative to AdamW and, for DASH, the speed-up over
``shampoo_loop`` with the same solver, dtype and block size) is printed and the
records are written to ``<out>/step_time_<device>.json`` as a list of
``{"device", "model", "optimizer", "solver", "dtype", "block_size", "step_ms"}``.

Run from the repository root (the CPU default, gpt-2.5m, takes about 11 minutes on 2 cores)::

    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/speed/step_time.py
    .venv/bin/python benchmarks/speed/step_time.py --device cuda --model gpt2-125m
    .venv/bin/python benchmarks/speed/step_time.py --device cuda --model gpt-1b --dtypes float32 bfloat16 float16
    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/speed/step_time.py --suite peers   # make bench-step
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _step_time_cases import (
    DTYPE_NAMES,
    F10_FREQUENCY,
    MODELS,
    PEER_MODELS,
    PEERS,
    SUITES,
    adamw_kind,
    build_cases,
    build_defaults_cases,
    build_peer_cases,
    make_parameters,
    model_parameter_shapes,
    parameter_count,
)
from _step_time_measure import (
    PeerRecord,
    Tensors,
    format_peer_table,
    format_table,
    make_peer_records,
    make_records,
    measure_models,
    run_suite,
    write_peer_records,
    write_records,
)
from common import device_label, resolve_device, results_parser

from lightning_dash.optim.roots import INVERSE_ROOT_METHODS

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def dash_option(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` as (name, value): the value read as JSON, else kept as a string."""
    name, _, value = text.partition("=")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = results_parser(
        __doc__.splitlines()[0], RESULTS_DIR, None, "cpu, cuda, cuda:1, ... (default: cuda if available)"
    )
    parser.add_argument(
        "--suite",
        choices=SUITES,
        default="solvers",
        help="solvers: DASH's solvers and dtypes against AdamW, the loop and third parties (default); "
        "peers: DASH against Meta's Distributed Shampoo; defaults: DASH(params, lr) at the installed package's "
        "defaults against AdamW (see the module docstring)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="parameter shapes of the solvers suite (default: gpt-2.5m on CPU, gpt2-125m on GPU)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(MODELS),
        default=list(PEER_MODELS),
        help=f"parameter shapes of the peers and defaults suites (default: {' '.join(PEER_MODELS)})",
    )
    parser.add_argument(
        "--frequencies",
        type=int,
        nargs="+",
        default=[1, F10_FREQUENCY],
        help="precondition frequencies of the peers suite (default: 1 10)",
    )
    parser.add_argument(
        "--block-sizes", type=int, nargs="+", default=None, help="default: 512 1024 (solvers), 1024 (peers)"
    )
    parser.add_argument("--solvers", nargs="+", choices=INVERSE_ROOT_METHODS, default=list(INVERSE_ROOT_METHODS))
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPE_NAMES,
        default=None,
        help="solver matmul dtypes (default: float32 bfloat16; float16 matmuls are ~20x "
        "slower on CPU, add it explicitly)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 2 CPU, 3 GPU; peers: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per round (default: 1 CPU, 3 GPU)")
    parser.add_argument("--samples", type=int, default=None, help="timed samples per round (default: 1 CPU, 5 GPU)")
    parser.add_argument(
        "--loop-rounds",
        type=int,
        default=None,
        help="rounds in which shampoo_loop is timed (default: every round on CPU, 1 on GPU)",
    )
    parser.add_argument("--no-loop", action="store_true", help="leave out the shampoo_loop baseline")
    parser.add_argument(
        "--no-third-party",
        action="store_true",
        help="leave out heavyball and pytorch_optimizer (peers suite: Meta's Shampoo)",
    )
    parser.add_argument("--no-compile", action="store_true", help="peers suite: leave out compiled DASH")
    parser.add_argument(
        "--dash-option",
        type=dash_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="defaults suite: a DASH option for dash_defaults, where the installed package has it (a JSON value "
        "or a string)",
    )
    args = parser.parse_args(argv)
    on_gpu = resolve_device(args.device).type == "cuda"
    peers = args.suite == "peers"
    defaults = {
        "model": "gpt2-125m" if on_gpu else "gpt-2.5m",
        "block_sizes": [PEERS.block_size] if peers else [512, 1024],
        "dtypes": ["float32", "bfloat16"],
        # peers: 12 cases of whole root periods, three rounds in about 8 minutes on 2 CPU cores
        "rounds": 3 if on_gpu or peers else 2,
        "warmup": 3 if on_gpu else 1,
        "samples": 5 if on_gpu else 1,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.loop_rounds is None:
        args.loop_rounds = 1 if on_gpu else args.rounds
    if any(frequency < 1 for frequency in args.frequencies):
        parser.error("--frequencies must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.suite in ("peers", "defaults"):
        main_peers(args)
        return
    device = resolve_device(args.device)
    device_name = device_label(device)
    shapes = model_parameter_shapes(args.model)
    max_dim = max(max(s) for _, s in shapes)
    params, grads = make_parameters(shapes, device)
    cases, notes = build_cases(args, max_dim)
    print(
        f"{args.model}: {parameter_count(shapes) / 1e6:.1f}M parameters in {len(shapes)} tensors on {device_name} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads); AdamW: {adamw_kind(device)}"
    )
    run_suite(
        cases,
        notes,
        f"{len(cases)} configurations x {args.rounds} rounds (warm-up {args.warmup}, samples {args.samples})",
        lambda: measure_models(cases, {None: (params, grads)}, args.rounds, args.warmup, args.samples, device),
        "step ms: minimum over samples; loop / DASH: shampoo_loop's time over DASH's (same solver, dtype, block); "
        "dash_f10 is amortised over its 10-step period; spread: max / min of the samples",
        lambda: make_records(cases, device_name, args.model),
        format_table,
        lambda records: write_records(records, args.out, device_name),
    )


def main_peers(args: argparse.Namespace) -> list[PeerRecord]:
    """The peers suite (DASH against Meta's Distributed Shampoo) or the defaults suite (DASH at its
    defaults against AdamW) on every model of ``--models``."""
    device = resolve_device(args.device)
    device_name = device_label(device)
    tensors: dict[str | None, Tensors] = {}
    for model in args.models:
        shapes = model_parameter_shapes(model)
        tensors[model] = make_parameters(shapes, device)
        print(f"{model}: {parameter_count(shapes):,} parameters in {len(shapes)} tensors")
    cases, notes = build_defaults_cases(args) if args.suite == "defaults" else build_peer_cases(args)
    print(f"on {device_name} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    return run_suite(
        cases,
        notes,
        f"{len(cases)} configurations x {args.rounds} rounds (warm-up {args.warmup} steps, at least f; "
        f"samples {args.samples}, of f steps each)",
        lambda: measure_models(cases, tensors, args.rounds, args.warmup, args.samples, device),
        "step ms: minimum over samples, a sample being the mean over f consecutive steps (one root computation); "
        "meta / this: meta_shampoo's step ms over the row's (same model, block, f); spread: max / min of the samples",
        lambda: make_peer_records(cases, device_name),
        format_peer_table,
        lambda records: write_peer_records(records, args.out, device_name, args.suite),
    )


if __name__ == "__main__":
    main()
