"""The step-time benchmark's configurations (``step_time.py``): model shapes, parameters, optimizer cases."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import _meta_shampoo
import torch
from common import build_optimizer
from torch import Tensor

from lightning_dash import DashConfig

LR = 1e-4
SEED = 0
#: pytorch_optimizer's Shampoo keeps a full ``d x d`` factor per dimension and takes its SVD.
FULL_MATRIX_MAX_DIM = 8192
#: Steps per dash_f10 sample: one root period.
F10_FREQUENCY = 10
DTYPE_NAMES = ("float32", "bfloat16", "float16")
SUITES = ("solvers", "peers", "defaults")
#: Steps per sample of the defaults suite: a whole root period of 10 (and of 2 or 5).
DEFAULTS_WINDOW = 10


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
    # 12.6M parameters: an 8192 x 256 embedding and six 256-wide layers, a new user's first GPT
    "gpt-8k-vocab": GPTShape(width=256, layers=6, vocab=8192, context=256),
    # the race's byte-level TinyGPT (benchmarks/races/peers.py) at its two widths
    "race-128": GPTShape(width=128, layers=2, vocab=256, context=128),
    "race-256": GPTShape(width=256, layers=2, vocab=256, context=128),
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
    return peer_case(name, solver_name, model, frequency, settings, build)


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

    return peer_case("meta_shampoo", "eigh", model, frequency, settings, build)


def peer_case(
    name: str,
    solver: str,
    model: str,
    frequency: int,
    settings: PeerSettings,
    build: Callable[[list[Tensor]], torch.optim.Optimizer],
) -> Case:
    """A case of the peers suite: a sample is one root period of ``frequency`` steps, after at least
    Meta's Shampoo's own warm-up before its first roots."""
    return Case(
        name,
        solver,
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
    with_meta = _meta_shampoo.available() and not args.no_third_party
    cases = []
    for model in args.models:
        for block_size in args.block_sizes:
            settings = dataclasses.replace(PEERS, block_size=block_size)
            for frequency in args.frequencies:
                cases += [
                    dash_peer_case(model, frequency, settings.solver, settings),
                    dash_peer_case(model, frequency, None, settings),
                ]
                if not args.no_compile:
                    cases.append(dash_peer_case(model, frequency, None, settings, compiled=True))
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


def defaults_with(options: dict) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    """``DASH(params, lr, **options)``, leaving out the options the installed package does not take (an
    older revision, whose defaults then stand)."""

    def build(params: list[Tensor]) -> torch.optim.Optimizer:
        taken = {name: value for name, value in options.items() if name in DashConfig.__dataclass_fields__}
        return build_optimizer("dash", params, lr=LR, **taken)

    return build


def build_defaults_cases(args: argparse.Namespace) -> tuple[list[Case], list[str]]:
    """Per model: AdamW, and DASH as ``DASH(params, lr)`` builds it, every other option at the installed
    package's default (``--dash-option`` replaces some, where that package has them), so that two revisions
    compare as a user of each would find them. A sample is the mean over :data:`DEFAULTS_WINDOW` steps,
    after at least as many untimed ones (past the early refreshes of a ``"doubling"`` schedule)."""
    options = dict(args.dash_option)
    cases = []
    for model in args.models:
        cases.append(Case("adamw", None, None, None, build_adamw, model=model))
        cases.append(
            Case(
                "dash_defaults",
                default_inverse_root_method(),
                None,
                None,
                defaults_with(options),
                steps_per_sample=DEFAULTS_WINDOW,
                model=model,
                frequency=DEFAULTS_WINDOW,
                min_warmup=DEFAULTS_WINDOW,
            )
        )
    given = f", with {options} where the installed package takes them" if options else ""
    return cases, [f"dash_defaults: DASH(params, lr={LR}), the installed package's defaults otherwise{given}"]


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
