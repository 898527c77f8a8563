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

    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/step_time.py
    .venv/bin/python benchmarks/step_time.py --device cuda --model gpt2-125m
    .venv/bin/python benchmarks/step_time.py --device cuda --model gpt-1b --dtypes float32 bfloat16 float16
    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/step_time.py --suite peers   # make bench-step
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _meta_shampoo
from common import RESULTS_DIR, build_optimizer, device_label, format_columns, resolve_device, synchronize, write_json

from lightning_dash.optim.roots import INVERSE_ROOT_METHODS

LR = 1e-4
SEED = 0
#: pytorch_optimizer's Shampoo keeps a full ``d x d`` factor per dimension and takes its SVD.
FULL_MATRIX_MAX_DIM = 8192
#: Steps per dash_f10 sample: one root period.
F10_FREQUENCY = 10
DTYPE_NAMES = ("float32", "bfloat16", "float16")
SUITES = ("solvers", "peers")


@dataclass(frozen=True)
class GPTShape:
    """The dimensions that fix a GPT's parameter shapes."""

    width: int
    layers: int
    vocab: int
    context: int


@dataclass(frozen=True)
class MatrixSet:
    """``count`` matrices of ``rows x cols`` and nothing else (no vectors, no embeddings):
    the root computation and the matmuls alone, without the elementwise work of many small
    tensors."""

    count: int
    rows: int
    cols: int


MODELS: dict[str, GPTShape | MatrixSet] = {
    # 2.5M parameters, the CPU default: with roots at every step a 10M model takes
    # 15-40 s per step on 2 cores, too slow for the whole solver grid
    "gpt-2.5m": GPTShape(width=256, layers=3, vocab=256, context=256),
    "gpt-3m": GPTShape(width=256, layers=4, vocab=256, context=256),
    # 6,646,272 parameters in 100 tensors, the peers suite's GPT: 34 matrix tiles at block size
    # 1024 (17 with a side of 1024: wpe and both MLP matrices of every layer; 8 of 768 x 256;
    # 9 of 256 x 256) and 66 vectors
    "gpt-6.6m": GPTShape(width=256, layers=8, vocab=256, context=1024),
    "gpt-10m": GPTShape(width=384, layers=6, vocab=256, context=256),
    "gpt2-125m": GPTShape(width=768, layers=12, vocab=50257, context=1024),
    "gpt2-350m": GPTShape(width=1024, layers=24, vocab=50257, context=1024),
    "gpt2-774m": GPTShape(width=1280, layers=36, vocab=50257, context=1024),
    "gpt-1b": GPTShape(width=2048, layers=18, vocab=50257, context=1024),
    # 71k parameters: for smoke runs and tests (compare_revisions.py), not a result
    "gpt-tiny": GPTShape(width=64, layers=1, vocab=256, context=64),
    # 8.4M parameters: 16 factors of 1024 x 1024, the peers suite's matrix-only case
    "matrices-8x1024": MatrixSet(count=8, rows=1024, cols=1024),
}
#: The peers suite's models (``--models``).
PEER_MODELS = ("gpt-6.6m", "matrices-8x1024")


@dataclass(frozen=True)
class PeerSettings:
    """What DASH and Meta's Shampoo share in the peers suite: the settings Meta's README
    recommends for a comparison with an Adam-grafted Shampoo (``../shared/peers/README.md``)."""

    lr: float = LR
    betas: tuple[float, float] = (0.9, 0.999)
    grafting_beta2: float = 0.999
    grafting_epsilon: float = 1e-8
    block_size: int = 1024
    solver: str = "eigh"


PEERS = PeerSettings()


@dataclass(frozen=True)
class Record:
    """One row of ``step_time_<device>.json``."""

    device: str
    model: str
    optimizer: str
    solver: str | None
    dtype: str | None
    block_size: int | None
    step_ms: float


@dataclass(frozen=True)
class PeerRecord:
    """One row of ``step_time_peers_<device>.json``."""

    device: str
    model: str
    optimizer: str
    solver: str
    frequency: int
    block_size: int
    step_ms: float
    #: meta_shampoo's step_ms over this row's (same model, frequency, block size); None on its own rows.
    ratio: float | None


@dataclass
class Case:
    """One optimizer configuration to time (on ``model``'s parameters in the peers suite)."""

    optimizer: str
    solver: str | None
    dtype: str | None
    block_size: int | None
    build: Callable[[list[Tensor]], torch.optim.Optimizer]
    steps_per_sample: int = 1
    max_rounds: int | None = None
    samples_ms: list[float] = field(default_factory=list)
    skipped: str | None = None
    model: str | None = None
    #: Root period, in the peers suite (where it is a column rather than part of the name).
    frequency: int | None = None
    #: Untimed steps at least this many, whatever ``--warmup`` says (see the module docstring).
    min_warmup: int = 0


# ---------------------------------------------------------------------- shapes
def gpt_parameter_shapes(shape: GPTShape) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a GPT-2-style model's parameters (output head tied to ``wte``)."""
    w = shape.width
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (shape.vocab, w)), ("wpe", (shape.context, w))]
    for layer in range(shape.layers):
        prefix = f"h.{layer}."
        shapes += [
            (prefix + "ln_1.weight", (w,)),
            (prefix + "ln_1.bias", (w,)),
            (prefix + "attn.c_attn.weight", (3 * w, w)),
            (prefix + "attn.c_attn.bias", (3 * w,)),
            (prefix + "attn.c_proj.weight", (w, w)),
            (prefix + "attn.c_proj.bias", (w,)),
            (prefix + "ln_2.weight", (w,)),
            (prefix + "ln_2.bias", (w,)),
            (prefix + "mlp.c_fc.weight", (4 * w, w)),
            (prefix + "mlp.c_fc.bias", (4 * w,)),
            (prefix + "mlp.c_proj.weight", (w, 4 * w)),
            (prefix + "mlp.c_proj.bias", (w,)),
        ]
    shapes += [("ln_f.weight", (w,)), ("ln_f.bias", (w,))]
    return shapes


def matrix_set_shapes(shape: MatrixSet) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of ``shape.count`` equal matrices."""
    return [(f"matrix.{index}", (shape.rows, shape.cols)) for index in range(shape.count)]


def model_parameter_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the parameters of ``MODELS[model]``."""
    shape = MODELS[model]
    return gpt_parameter_shapes(shape) if isinstance(shape, GPTShape) else matrix_set_shapes(shape)


def parameter_count(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) for _, s in shapes)


def make_parameters(
    shapes: list[tuple[str, tuple[int, ...]]], device: torch.device
) -> tuple[list[Tensor], list[Tensor]]:
    """Parameters with GPT-like initial scales and fixed random gradients."""
    generator = torch.Generator(device="cpu").manual_seed(SEED)
    params, grads = [], []
    for _, shape in shapes:
        params.append((0.02 * torch.randn(shape, generator=generator)).to(device).requires_grad_())
        grads.append((1e-3 * torch.randn(shape, generator=generator)).to(device))
    return params, grads


def set_gradients(params: list[Tensor], grads: list[Tensor]) -> None:
    """Put the fixed gradients back (some optimizers clear or modify ``.grad``)."""
    for param, grad in zip(params, grads):
        if param.grad is None:
            param.grad = grad.clone()
        else:
            param.grad.copy_(grad)


# ---------------------------------------------------------------------- optimizers
def build_adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    """AdamW, fused where this torch supports it on the parameters' device."""
    try:
        return build_optimizer("adamw", params, lr=LR, fused=True)
    except (RuntimeError, ValueError):
        return build_optimizer("adamw", params, lr=LR, foreach=True)


def adamw_kind(device: torch.device) -> str:
    """Which AdamW implementation :func:`build_adamw` gets on ``device``."""
    optimizer = build_adamw([torch.zeros(2, device=device, requires_grad=True)])
    return "fused" if optimizer.defaults.get("fused") else "foreach"


def dash_case(solver: str, dtype: str, block_size: int, frequency: int = 1) -> Case:
    def build(params: list[Tensor]) -> torch.optim.Optimizer:
        return build_optimizer(
            "dash",
            params,
            lr=LR,
            block_size=block_size,
            precondition_frequency=frequency,
            inverse_root_method=solver,
            matmul_dtype=getattr(torch, dtype),
        )

    name = "dash" if frequency == 1 else f"dash_f{frequency}"
    return Case(name, solver, dtype, block_size, build, steps_per_sample=frequency)


def loop_case(solver: str, dtype: str, block_size: int, rounds: int | None) -> Case:
    def build(params: list[Tensor]) -> torch.optim.Optimizer:
        # Imported here: a run against an older checkout (compare_revisions.py) with
        # --no-loop need not import the loop, which follows today's DASH internals.
        from _shampoo_loop import ShampooLoop

        return ShampooLoop(
            params,
            lr=LR,
            block_size=block_size,
            precondition_frequency=1,
            inverse_root_method=solver,
            matmul_dtype=getattr(torch, dtype),
        )

    return Case("shampoo_loop", solver, dtype, block_size, build, max_rounds=rounds)


def third_party_cases(max_dim: int) -> tuple[list[Case], list[str]]:
    """Cases for the installed third-party optimizers, and notes on those left out."""
    cases, notes = [], []
    if importlib.util.find_spec("heavyball") is None:
        notes.append("heavyball not installed: heavyball_soap and heavyball_shampoo skipped")
    else:
        import heavyball
        import heavyball.utils

        heavyball.utils.compile_mode = None  # eager, as every other optimizer here

        def soap(params: list[Tensor]) -> torch.optim.Optimizer:
            return heavyball.SOAP(params, lr=LR, precondition_frequency=1, weight_decay=0.0)

        def kl_shampoo(params: list[Tensor]) -> torch.optim.Optimizer:
            return heavyball.KLShampoo(params, lr=LR, precondition_frequency=1, weight_decay=0.0)

        cases += [
            Case("heavyball_soap", None, None, None, soap),
            Case("heavyball_shampoo", None, None, None, kl_shampoo),
        ]
        notes.append(
            f"heavyball {heavyball_version()}: heavyball_shampoo is heavyball.KLShampoo "
            "(no plain Shampoo in heavyball 3.x); eager, precondition_frequency=1"
        )
    if importlib.util.find_spec("pytorch_optimizer") is None:
        notes.append("pytorch_optimizer not installed: pytorch_optimizer_shampoo skipped")
    elif max_dim > FULL_MATRIX_MAX_DIM:
        notes.append(
            f"pytorch_optimizer_shampoo skipped: it keeps a full {max_dim}x{max_dim} factor "
            "and takes its SVD every step"
        )
    else:
        from pytorch_optimizer import Shampoo

        def full_shampoo(params: list[Tensor]) -> torch.optim.Optimizer:
            return Shampoo(params, lr=LR, preconditioning_compute_steps=1)

        cases.append(Case("pytorch_optimizer_shampoo", None, None, None, full_shampoo))
        notes.append("pytorch_optimizer_shampoo: full-matrix factors (no blocks), SVD roots every step")
    return cases, notes


def heavyball_version() -> str:
    from importlib.metadata import version

    return version("heavyball")


def default_inverse_root_method(device: torch.device | None = None, block_size: int = 1024) -> str:
    """The solver ``DASH(...)`` uses when none is given (read from a throwaway optimizer on
    ``device``: what ``"auto"`` picks there, for revisions that have it)."""
    param = torch.zeros(2, 2, requires_grad=True, device=device)
    probe = build_optimizer("dash", [param], lr=LR, block_size=block_size)
    return str(getattr(probe, "inverse_root_method_in_use", getattr(probe, "inverse_root_method", "default")))


def dash_peer_case(
    model: str, frequency: int, solver: str | None, settings: PeerSettings = PEERS, compiled: bool = False
) -> Case:
    """DASH with the peers' shared settings; ``solver=None`` leaves DASH's default solver;
    ``compiled``: ``compile=True`` (its first steps compile, within the warm-up)."""
    options: dict = {} if solver is None else {"inverse_root_method": solver}
    if compiled:
        options["compile"] = True

    def build(params: list[Tensor]) -> torch.optim.Optimizer:
        return build_optimizer(
            "dash",
            params,
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=0.0,
            block_size=settings.block_size,
            precondition_frequency=frequency,
            grafting="adam",
            grafting_beta2=settings.grafting_beta2,
            grafting_epsilon=settings.grafting_epsilon,
            matmul_dtype=torch.float32,
            **options,
        )

    name, solver_name = ("dash", solver) if solver is not None else ("dash_default", default_inverse_root_method())
    name = "dash_compiled" if compiled else name
    return Case(
        name,
        solver_name,
        None,
        settings.block_size,
        build,
        steps_per_sample=frequency,
        model=model,
        frequency=frequency,
        min_warmup=_meta_shampoo.start_preconditioning_step(frequency),
    )


def meta_shampoo_case(model: str, frequency: int, settings: PeerSettings = PEERS) -> Case:
    """Meta's Distributed Shampoo (eigh roots) with the settings of :func:`dash_peer_case`."""

    def build(params: list[Tensor]) -> torch.optim.Optimizer:
        return _meta_shampoo.build_meta_shampoo(
            params,
            lr=settings.lr,
            betas=settings.betas,
            block_size=settings.block_size,
            precondition_frequency=frequency,
            grafting_beta2=settings.grafting_beta2,
            grafting_epsilon=settings.grafting_epsilon,
        )

    return Case(
        "meta_shampoo",
        "eigh",
        None,
        settings.block_size,
        build,
        steps_per_sample=frequency,
        model=model,
        frequency=frequency,
        min_warmup=_meta_shampoo.start_preconditioning_step(frequency),
    )


def build_peer_cases(args: argparse.Namespace) -> tuple[list[Case], list[str]]:
    """Per model, block size and frequency: DASH (eigh), DASH with its default solver, eager and
    compiled, and meta_shampoo."""
    with_meta = _meta_shampoo.available()
    cases = []
    for model in args.models:
        for block_size in args.block_sizes:
            settings = dataclasses.replace(PEERS, block_size=block_size)
            for frequency in args.frequencies:
                cases += [
                    dash_peer_case(model, frequency, settings.solver, settings),
                    dash_peer_case(model, frequency, None, settings),
                    dash_peer_case(model, frequency, None, settings, compiled=True),
                ]
                if with_meta:
                    cases.append(meta_shampoo_case(model, frequency, settings))
    if with_meta:
        notes = [
            f"meta_shampoo: distributed_shampoo {_meta_shampoo.version()}, eigh roots, Adam grafting, "
            "max_preconditioner_dim = block, start_preconditioning_step = f, no factors on vectors "
            "(benchmarks/_meta_shampoo.py)"
        ]
    else:
        notes = ["distributed_shampoo not installed: meta_shampoo skipped (make bench-step installs it)"]
    notes.append(
        f"shared: lr {PEERS.lr}, betas {PEERS.betas}, Adam grafting beta2 {PEERS.grafting_beta2} "
        f"epsilon {PEERS.grafting_epsilon}, no weight decay; dash_default's solver: {default_inverse_root_method()}"
    )
    return cases, notes


def build_cases(args: argparse.Namespace, max_dim: int) -> tuple[list[Case], list[str]]:
    """AdamW, every DASH configuration with its loop baseline, dash_f10, third parties."""
    cases = [Case("adamw", None, None, None, build_adamw)]
    solver_dtypes = [
        (solver, dtype) for solver in args.solvers for dtype in (["float32"] if solver == "eigh" else args.dtypes)
    ]
    for block_size in args.block_sizes:
        cases += [dash_case(solver, dtype, block_size) for solver, dtype in solver_dtypes]
        if not args.no_loop:
            cases += [loop_case(solver, dtype, block_size, args.loop_rounds) for solver, dtype in solver_dtypes]
        cases.append(dash_case("newton_db", "float32", block_size, frequency=F10_FREQUENCY))
    notes: list[str] = []
    if not args.no_third_party:
        extra, notes = third_party_cases(max_dim)
        cases += extra
    return cases, notes


# ---------------------------------------------------------------------- timing
def timed_sample(
    optimizer: torch.optim.Optimizer, params: list[Tensor], grads: list[Tensor], steps: int, device: torch.device
) -> float:
    """Mean milliseconds per step over ``steps`` consecutive steps (gradient reset untimed)."""
    total = 0.0
    for _ in range(steps):
        set_gradients(params, grads)
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        total += time.perf_counter() - start
    return 1e3 * total / steps


def run_case(
    case: Case, params: list[Tensor], grads: list[Tensor], warmup: int, samples: int, device: torch.device
) -> None:
    """Build ``case`` fresh, warm it up (at least ``case.min_warmup`` steps), add ``samples`` timings, free it."""
    optimizer = case.build(params)
    try:
        for _ in range(max(warmup, case.min_warmup)):
            timed_sample(optimizer, params, grads, 1, device)
        for _ in range(samples):
            case.samples_ms.append(timed_sample(optimizer, params, grads, case.steps_per_sample, device))
    finally:
        del optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


Tensors = tuple[list[Tensor], list[Tensor]]


def measure(
    cases: list[Case],
    params: list[Tensor],
    grads: list[Tensor],
    rounds: int,
    warmup: int,
    samples: int,
    device: torch.device,
    verbose: bool = True,
) -> None:
    """Interleaved rounds over all cases, on the same parameters; see :func:`measure_models`."""
    measure_models(cases, {None: (params, grads)}, rounds, warmup, samples, device, verbose)


def measure_models(
    cases: list[Case],
    tensors: dict[str | None, Tensors],
    rounds: int,
    warmup: int,
    samples: int,
    device: torch.device,
    verbose: bool = True,
) -> None:
    """Interleaved rounds over all cases, each on the parameters and gradients of its model
    (``tensors[case.model]``); a case that raises is skipped with its reason."""
    for round_index in range(rounds):
        order = list(cases)
        random.Random(round_index).shuffle(order)
        for case in order:
            if case.skipped or (case.max_rounds is not None and round_index >= case.max_rounds):
                continue
            begin = time.perf_counter()
            try:
                # AdamW is cheap: more samples at no cost.
                params, grads = tensors[case.model]
                run_case(case, params, grads, warmup, samples * (5 if case.optimizer == "adamw" else 1), device)
            except Exception as error:  # noqa: BLE001 - a third-party failure must not end the run
                case.skipped = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            if verbose:
                status = case.skipped or f"{case.samples_ms[-1]:.1f} ms"
                print(
                    f"  round {round_index + 1}/{rounds} {label(case):<48} {status} "
                    f"({time.perf_counter() - begin:.1f} s)",
                    flush=True,
                )


def label(case: Case) -> str:
    parts = [case.model, case.optimizer, case.solver, case.dtype]
    parts += [None if case.block_size is None else f"b{case.block_size}"]
    parts += [None if case.frequency is None else f"f{case.frequency}"]
    return " ".join(p for p in parts if p)


def measured(cases: list[Case]) -> list[Case]:
    """The cases that have samples and did not fail."""
    return [c for c in cases if c.samples_ms and not c.skipped]


def make_records(cases: list[Case], device_name: str, model: str) -> list[Record]:
    """One record per measured case: the minimum of its samples (see the module docstring)."""
    return [
        Record(
            device=device_name,
            model=model,
            optimizer=c.optimizer,
            solver=c.solver,
            dtype=c.dtype,
            block_size=c.block_size,
            step_ms=float(min(c.samples_ms)),
        )
        for c in measured(cases)
    ]


def make_peer_records(cases: list[Case], device_name: str) -> list[PeerRecord]:
    """One record per measured case of the peers suite (minimum of its samples), with the ratio
    of meta_shampoo's time at the same model, frequency and block size to the row's."""
    step_ms = {id(c): float(min(c.samples_ms)) for c in measured(cases)}
    meta = {
        (c.model, c.frequency, c.block_size): step_ms[id(c)] for c in measured(cases) if c.optimizer == "meta_shampoo"
    }
    records = []
    for c in measured(cases):
        reference = meta.get((c.model, c.frequency, c.block_size)) if c.optimizer != "meta_shampoo" else None
        records.append(
            PeerRecord(
                device=device_name,
                model=str(c.model),
                optimizer=c.optimizer,
                solver=str(c.solver),
                frequency=int(c.frequency or 1),
                block_size=int(c.block_size or 0),
                step_ms=step_ms[id(c)],
                ratio=None if reference is None else reference / step_ms[id(c)],
            )
        )
    return records


# ---------------------------------------------------------------------- output
def ratios(records: list[Record]) -> list[tuple[float | None, float | None]]:
    """Per record: step time / AdamW's, and (DASH rows) shampoo_loop's time / DASH's."""
    adamw = next((r.step_ms for r in records if r.optimizer == "adamw"), None)
    loops = {(r.solver, r.dtype, r.block_size): r.step_ms for r in records if r.optimizer == "shampoo_loop"}
    out = []
    for r in records:
        vs_adamw = r.step_ms / adamw if adamw else None
        loop = loops.get((r.solver, r.dtype, r.block_size)) if r.optimizer == "dash" else None
        out.append((vs_adamw, loop / r.step_ms if loop else None))
    return out


def format_table(records: list[Record], spreads: list[float] | None = None) -> str:
    """The records with their ratios; ``spreads`` (max / min of each row's samples) if given."""
    header = ["model", "optimizer", "solver", "dtype", "block", "step ms", "x AdamW", "loop / DASH"]
    header += ["spread"] if spreads is not None else []
    rows = []
    for index, (record, (vs_adamw, speedup)) in enumerate(zip(records, ratios(records))):
        rows.append(
            [
                record.model,
                record.optimizer,
                record.solver or "-",
                record.dtype or "-",
                "-" if record.block_size is None else str(record.block_size),
                f"{record.step_ms:.1f}",
                "-" if vs_adamw is None else f"{vs_adamw:.1f}",
                "-" if speedup is None else f"{speedup:.2f}",
            ]
            + ([f"{spreads[index]:.2f}"] if spreads is not None else [])
        )
    return format_columns(header, rows)


def format_peer_table(records: list[PeerRecord], spreads: list[float] | None = None) -> str:
    """The peers suite's records (in case order: model, block, frequency) with ``meta / this``."""
    header = ["model", "block", "f", "optimizer", "solver", "step ms", "meta / this"]
    header += ["spread"] if spreads is not None else []
    rows = []
    for index, record in enumerate(records):
        rows.append(
            [
                record.model,
                str(record.block_size),
                str(record.frequency),
                record.optimizer,
                record.solver,
                f"{record.step_ms:.1f}",
                "-" if record.ratio is None else f"{record.ratio:.2f}",
            ]
            + ([f"{spreads[index]:.2f}"] if spreads is not None else [])
        )
    return format_columns(header, rows)


def write_records(records: list[Record], out_dir: Path, device_name: str) -> Path:
    return write_json(out_dir / f"step_time_{device_name}.json", records)


def write_peer_records(records: list[PeerRecord], out_dir: Path, device_name: str) -> Path:
    return write_json(out_dir / f"step_time_peers_{device_name}.json", records)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--suite",
        choices=SUITES,
        default="solvers",
        help="solvers: DASH's solvers and dtypes against AdamW, the loop and third parties (default); "
        "peers: DASH against Meta's Distributed Shampoo (see the module docstring)",
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
        help=f"parameter shapes of the peers suite (default: {' '.join(PEER_MODELS)})",
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
    parser.add_argument("--no-third-party", action="store_true", help="leave out heavyball and pytorch_optimizer")
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
    if args.suite == "peers":
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
    for note in notes:
        print(f"note: {note}")
    print(f"{len(cases)} configurations x {args.rounds} rounds (warm-up {args.warmup}, samples {args.samples})")
    start = time.perf_counter()
    measure(cases, params, grads, args.rounds, args.warmup, args.samples, device)
    records = make_records(cases, device_name, args.model)
    print(
        f"\nmeasured in {time.perf_counter() - start:.0f} s; step ms: minimum over samples; loop / DASH: "
        "shampoo_loop's time over DASH's (same solver, dtype, block); dash_f10 is amortised over its 10-step "
        "period; spread: max / min of the samples\n"
    )
    print(format_table(records, [max(c.samples_ms) / min(c.samples_ms) for c in measured(cases)]))
    for case in cases:
        if case.skipped:
            print(f"skipped {label(case)}: {case.skipped}")
    print(f"\nwrote {write_records(records, args.out, device_name)}")


def main_peers(args: argparse.Namespace) -> list[PeerRecord]:
    """The peers suite: DASH against Meta's Distributed Shampoo on every model of ``--models``."""
    device = resolve_device(args.device)
    device_name = device_label(device)
    tensors: dict[str | None, Tensors] = {}
    for model in args.models:
        shapes = model_parameter_shapes(model)
        tensors[model] = make_parameters(shapes, device)
        print(f"{model}: {parameter_count(shapes):,} parameters in {len(shapes)} tensors")
    cases, notes = build_peer_cases(args)
    print(f"on {device_name} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for note in notes:
        print(f"note: {note}")
    print(
        f"{len(cases)} configurations x {args.rounds} rounds (warm-up {args.warmup} steps, at least f; "
        f"samples {args.samples}, of f steps each)"
    )
    start = time.perf_counter()
    measure_models(cases, tensors, args.rounds, args.warmup, args.samples, device)
    records = make_peer_records(cases, device_name)
    print(
        f"\nmeasured in {time.perf_counter() - start:.0f} s; step ms: minimum over samples, a sample being the mean "
        "over f consecutive steps (one root computation); meta / this: meta_shampoo's step ms over the row's "
        "(same model, block, f); spread: max / min of the samples\n"
    )
    print(format_peer_table(records, [max(c.samples_ms) / min(c.samples_ms) for c in measured(cases)]))
    for case in cases:
        if case.skipped:
            print(f"skipped {label(case)}: {case.skipped}")
    print(f"\nwrote {write_peer_records(records, args.out, device_name)}")
    return records


if __name__ == "__main__":
    main()
