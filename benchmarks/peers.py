"""Convergence race: DASH against AdamW, Muon, SOAP, PSGD-Kron and Meta's Distributed Shampoo.

Every contender trains the main job's byte-level GPT (``examples/train_char_gpt.py``:
:class:`~lightning_dash.demos.TinyGPT`, depth 2, 4 heads, context 128, batch 32, on the
Python standard library's source, 4 MB read, validation on held-out files) with a plain
PyTorch loop instead of Lightning: the same model, data and schedule, without the trainer's
per-step overhead, so that the optimizer step can be timed on its own. For a seed, every
run starts from the same weights (``torch.manual_seed(seed)`` as ``GPTModule`` does) and sees
the same batches in the same order (``RandomWindows(train, 128, steps * 32, seed)``, the main
job's training data); validation is the main job's fixed set of held-out windows
(``RandomWindows(validation, 128, --val-windows, seed=12345)``). Schedule: linear warm-up over
5% of the steps, then cosine decay to 0.1 of the peak
(:func:`lightning_dash.demos.lightning_gpt.warmup_cosine`, the main job's).

Contenders (:data:`CONTENDERS`; ``--optimizers`` selects some; ``betas=(0.9, 0.95)`` and
decoupled weight decay 0.01 wherever an optimizer takes them):

* ``adamw``: ``torch.optim.AdamW``.
* ``muon``: ``torch.optim.Muon`` (its defaults: momentum 0.95, Nesterov, 5 Newton-Schulz steps,
  ``adjust_lr_fn="original"``) on the hidden 2-D weights (attention in/out projections, MLP),
  and, as its documentation recommends, AdamW on the rest (byte embedding, position table,
  output head, biases, LayerNorms), both inside one :class:`MuonWithAdamW` so the schedule scales
  both. The Muon lr is swept on its own grid; the AdamW part takes ``--muon-adamw-lr`` (default:
  AdamW's best lr at the same width, from the records).
* ``muon-match-rms``: the same, with ``adjust_lr_fn="match_rms_adamw"`` (Muon's lr scaled by
  0.2 sqrt(max(rows, cols)): its update RMS about AdamW's, meant to let AdamW's lr carry over), on AdamW's
  lr grid; recorded as ``unavailable`` where the installed torch's Muon does not take it.
* ``soap``: ``heavyball.SOAP`` with its defaults (``precondition_frequency=2``,
  ``shampoo_beta=0.95``, ``max_precond_dim=2048``); ``psgd-kron``: ``heavyball.PSGDKron`` with its
  defaults (annealed preconditioner-update probability, ``precond_lr=0.1``). heavyball compiles
  with ``torch.compile`` by default; here it runs eager (``heavyball.utils.compile_mode = None``),
  as every other contender does.
* ``meta-shampoo``: ``distributed_shampoo.DistributedShampoo`` (``../shared/peers/README.md``) as
  ``_meta_shampoo.build_meta_shampoo`` builds it for the step-time benchmark (eigh roots, Adam
  grafting with beta2 0.95 and epsilon 1e-8, epsilon 1e-12, ``max_preconditioner_dim=256``,
  roots every 10 steps from step 10, no factors on vectors), with decoupled weight decay 0.01
  set on its groups (it reads ``weight_decay`` at every step): Meta's recipe (:data:`META_RECIPE`:
  fourth roots, ``L^(-1/4) G R^(-1/4)``, every 10 steps, plain momentum).
* ``meta-shampoo-dash-recipe``: the same with DASH's recipe (:data:`DASH_RECIPE`, DASH 0.4's
  defaults, the ones behind the recorded DASH runs): square roots ``L^(-1/2) G R^(-1/2)``
  (``inverse_exponent_override={2: 0.5}``), roots every 2 steps (from step 2, the earliest Meta
  accepts; DASH starts at step 1) and DASH's Nesterov direction (``beta3 = beta1**2``; see
  ``_meta_shampoo``), on a grid around DASH's best lr. Records state the recipe and the
  ``beta3`` and exponents read back from the built optimizer.
* DASH variants, each a name and its options (:data:`DASH_VARIANTS`): DASH's defaults (inverse
  square roots, Nesterov momentum, roots every 2 steps, Adam grafting) with ``block_size=256`` and
  ``inverse_root_method`` ``eigh`` or ``newton_db``; the ``-hidden`` variants add
  ``precondition="hidden"`` (embeddings, output head, tied weights and vectors go to the grafting
  optimizer) with ``model=model``; TinyGPT's position table is a bare parameter, not an
  ``nn.Embedding``, so "hidden" still preconditions it (Muon's split above gives it to AdamW). A
  variant whose options this version of DASH does not know is recorded as ``unavailable`` and
  skipped. Records state the DASH options as the optimizer resolved them (:data:`DASH_RECORDED`).
* ``dash-from-adamw``: the AdamW above handed to ``DASH.from_optimizer`` (``block_size=256``), as
  the trainers' conversions do: AdamW's lr, DASH's ``lr_scale`` for Adam sources. It runs at AdamW's
  best lr of the width only (the claim it tests: a tuned AdamW recipe is a good DASH recipe).

Protocol, per width (``--widths``; the first is the main size, the others are "larger"): each
contender runs every lr of its grid (``--lrs-<name>``; halvings and doublings: AdamW 3e-3 to
2.4e-2 around the main job's AdamW lr, 6e-3, SOAP 3e-3 to 1.2e-2; Meta's Shampoo and PSGD-Kron
6e-3 to 2.4e-2; DASH 1.2e-2 to 9.6e-2, around 8x AdamW's; Meta's Shampoo with DASH's recipe 2.4e-2 to
9.6e-2, around DASH's best; Muon 0.01 to 0.04 around its documented 0.02, ``muon-match-rms`` AdamW's) with
the first seed of ``--seeds``; its best lr is the one with the lowest final validation loss
(averaged over the seeds run at every lr of the grid). When that is the grid's largest (smallest)
lr, the grid is extended by one doubling (halving), ``--extend-edges`` times. The other seeds then
run at the best lr. At a larger width only
``--large-optimizers`` run, with ``--large-seeds``, at two lrs: the contender's best at the main
width and the better of that lr's grid neighbours there (DASH variants also at AdamW's best lr at
that width, for the lr-transfer summary).

Per run: validation loss every ``--eval-every`` steps; wall time counts training steps only
(data, forward, backward, optimizer step, schedule), not evaluations; the optimizer step
(``optimizer.step()``) is timed on its own. Step times are taken per 10-step window (the mean
over the window: every window holds whole refresh cycles of DASH (5) and of Meta's Shampoo (1, or 5
with DASH's recipe), so
refreshes are amortised): ``opt_step_ms`` and ``train_step_ms`` are the fastest window's (other processes on
a shared machine only ever add time; the table takes the fastest over the seeds), ``*_robust_ms``
the median window's (``convergence.robust_step_ms``), and the window means are recorded;
``opt_step_median_ms`` (refresh steps excluded in effect) and ``opt_step_mean_ms`` (every step)
too. ``state_bytes``: DASH's ``state_bytes()`` (its stacked statistics,
roots, momentum and grafting buffers live outside ``optimizer.state``, which holds only step
counters), for the others the bytes of every distinct tensor storage reachable from
``optimizer.state`` (parameters excluded); ``state_bytes_walk`` is the latter for all.

Table, per width, at each contender's best lr: final validation loss (mean ± standard deviation
and range over seeds), steps to AdamW's final loss (the target of a seed: AdamW's final
validation loss at its best lr on that seed; the first evaluation at or below it; null if never)
and its ratio to AdamW's, training seconds to it (measured, and estimated as steps x the fastest
window's training-step time), optimizer-step time and state bytes. The lr-transfer summary gives, per width,
the best lr of AdamW and of ``dash-eigh``, their ratio, DASH's final loss at AdamW's best lr
against at its own best, and ``dash-from-adamw``'s at AdamW's best lr.

Outputs in ``--out`` (default ``benchmarks/results``): ``peers_<device>.json`` (``records``: one per
optimizer x width x lr x seed x steps, with its curve; ``summary``: the tables), merged with the
file already there (a new record replaces one with the same key, others are kept), and
``peers_<device>_w<width>.png`` (mean validation loss at the best lr against steps and against
training wall time). ``--report-only`` rebuilds the summary and the plots from the JSON.

Threads: one by default (``--threads``). On this project's 2-core machine, shared with test runs
that do not wait for the benchmarks, a busy second process slowed torch's two threads about 10x
(AdamW's 200 steps: 24 s alone, 272 s beside a test run), while one thread keeps to its core.
The thread count changes losses in their last digits (other splits of the sums), not the race.

Defaults (what ``make bench-peers`` runs): 200 steps, evaluation every 10 steps on 256 validation
windows, widths 128 (478,976 parameters) and 256 (1,744,128: 3.6x), seeds 0 1 2 at both. A race split over
processes runs each with its own ``--out`` and joins them with ``--merge``. Run from the repository
root::

    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/peers.py
    .venv/bin/python benchmarks/peers.py --optimizers dash-eigh-hidden,dash-newton_db-hidden
    .venv/bin/python benchmarks/peers.py --report-only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _meta_shampoo
from common import RESULTS_DIR, device_label, format_columns, markdown_table, resolve_device, synchronize
from convergence import Point, first_reaching, robust_step_ms

from lightning_dash import DASH, RootComputationError
from lightning_dash.demos import TinyGPT, load_stdlib_corpus
from lightning_dash.demos.lightning_gpt import warmup_cosine
from lightning_dash.demos.stdlib_text import ByteCorpus, RandomWindows

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01
DASH_BLOCK_SIZE = 256
#: Meta's Shampoo recomputes its roots every this many steps (as in the step-time benchmark).
META_FREQUENCY = 10
#: Steps per timing window: a multiple of DASH's root period (2) and Meta's (10), so every window
#: holds whole refresh cycles.
TIMING_WINDOW = 10
#: The main job's seed of its validation windows (``StdlibBytes.val_dataloader``).
VALIDATION_SEED = 12345
#: AdamW's learning rates: halvings and doublings around the main job's AdamW lr (6e-3).
ADAMW_LRS = (3e-3, 6e-3, 1.2e-2, 2.4e-2)
#: SOAP's: AdamW's grid without its largest value (three points, for the time budget; a grid whose best
#: lr is at its edge is extended, see --extend-edges).
SOAP_LRS = (3e-3, 6e-3, 1.2e-2)
#: The Adam-grafted Shampoos' (DASH, Meta's) and PSGD-Kron's: around the main job's DASH lr (1.2e-2,
#: twice AdamW's). PSGD-Kron was far behind at 2e-3 after 40 steps and best at 2.4e-2 of
#: {2e-3, 6e-3, 1.2e-2, 2.4e-2}.
GRAFTED_LRS = (6e-3, 1.2e-2, 2.4e-2)
#: DASH's: with its defaults (square roots, Nesterov, roots every 2 steps) its best lr was 8x AdamW's in the
#: investigation (4.8e-2 at width 128), so its grid is AdamW's times 4.
DASH_LRS = (1.2e-2, 2.4e-2, 4.8e-2, 9.6e-2)
#: Meta's Shampoo with DASH's recipe: three points centred on DASH's best lr with that recipe (4.8e-2).
META_DASH_RECIPE_LRS = (2.4e-2, 4.8e-2, 9.6e-2)


@dataclass(frozen=True)
class Recipe:
    """How an Adam-grafted Shampoo takes and refreshes its roots: the settings DASH's lead was
    measured with, as data, so that another Shampoo can run them."""

    #: p of the inverse p-th root of each Kronecker factor: ``L^(-1/p) G R^(-1/p)``.
    root_order: int
    #: roots recomputed every this many steps
    precondition_frequency: int
    #: DASH's Nesterov direction ``beta1 m_t + (1 - beta1) g_t`` instead of the momentum ``m_t``
    nesterov: bool


#: DASH 0.4's recipe (its defaults), the one behind the recorded DASH numbers.
DASH_RECIPE = Recipe(root_order=2, precondition_frequency=2, nesterov=True)
#: Meta's Shampoo as the step-time benchmark configures it (its default exponent, plain momentum).
META_RECIPE = Recipe(root_order=_meta_shampoo.META_ROOT_ORDER, precondition_frequency=META_FREQUENCY, nesterov=False)


# ---------------------------------------------------------------------- contenders
@dataclass(frozen=True)
class Contender:
    """One optimizer of the race: how to build it, its lr grid, what it needs installed."""

    name: str
    family: str  # adamw, muon, soap, psgd, meta, dash, converted (AdamW turned into DASH by from_optimizer)
    lrs: tuple[float, ...]
    options: dict[str, Any] = field(default_factory=dict)
    #: a module that must be importable, or None
    requires: str | None = None


#: DASH variants: name -> options beyond the shared ones (data, so new routings are one line).
DASH_VARIANTS: dict[str, dict[str, Any]] = {
    "dash-eigh": {"inverse_root_method": "eigh"},
    "dash-newton_db": {"inverse_root_method": "newton_db"},
    "dash-eigh-hidden": {"inverse_root_method": "eigh", "precondition": "hidden"},
    "dash-newton_db-hidden": {"inverse_root_method": "newton_db", "precondition": "hidden"},
}

CONTENDERS: dict[str, Contender] = {
    "adamw": Contender("adamw", "adamw", ADAMW_LRS),
    "muon": Contender("muon", "muon", (0.01, 0.02, 0.04)),
    "muon-match-rms": Contender("muon-match-rms", "muon", ADAMW_LRS, {"adjust_lr_fn": "match_rms_adamw"}),
    "soap": Contender("soap", "soap", SOAP_LRS, requires="heavyball"),
    "psgd-kron": Contender("psgd-kron", "psgd", GRAFTED_LRS, requires="heavyball"),
    "meta-shampoo": Contender("meta-shampoo", "meta", GRAFTED_LRS, asdict(META_RECIPE), _meta_shampoo.MODULE),
    "meta-shampoo-dash-recipe": Contender(
        "meta-shampoo-dash-recipe", "meta", META_DASH_RECIPE_LRS, asdict(DASH_RECIPE), _meta_shampoo.MODULE
    ),
    **{name: Contender(name, "dash", DASH_LRS, options) for name, options in DASH_VARIANTS.items()},
    "dash-from-adamw": Contender("dash-from-adamw", "converted", ADAMW_LRS),
}
#: The contenders that run at the larger widths by default.
LARGE_DEFAULT = ("adamw", "muon", "soap", "dash-eigh", "dash-from-adamw")
#: The DASH variant of the lr-transfer summary.
TRANSFER_DASH = "dash-eigh"


class Unavailable(Exception):
    """The contender cannot be built here (a package is missing, or an option is unknown)."""


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on some parameters and ``torch.optim.AdamW`` on the others, as one
    optimizer: its ``param_groups`` are the two optimizers' own group dicts, so an lr scheduler
    scales both, and :meth:`step` steps both."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.optimizers = (muon, adamw)
        groups = muon.param_groups + adamw.param_groups
        super().__init__(groups, defaults={})
        # Optimizer.__init__ keeps the group dicts it is given (it only fills in defaults).
        assert all(a is b for a, b in zip(self.param_groups, groups))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def muon_split(model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """The hidden 2-D weights (for Muon) and the rest (byte embedding, position table, output
    head, vectors: for AdamW)."""
    outer = {id(model.token.weight), id(model.position), id(model.head.weight)}
    hidden = [p for p in model.parameters() if p.ndim == 2 and id(p) not in outer]
    rest = [p for p in model.parameters() if p.ndim != 2 or id(p) in outer]
    return hidden, rest


def build(contender: Contender, model: nn.Module, lr: float, muon_adamw_lr: float) -> torch.optim.Optimizer:
    """The contender's optimizer on ``model`` (raises :class:`Unavailable` if it cannot be built)."""
    if contender.requires is not None and importlib.util.find_spec(contender.requires) is None:
        raise Unavailable(f"{contender.requires} is not installed")
    family = contender.family
    if family == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    if family == "muon":
        hidden, rest = muon_split(model)
        muon = build_muon(hidden, lr, contender.options)
        adamw = torch.optim.AdamW(rest, lr=muon_adamw_lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        return MuonWithAdamW(muon, adamw)
    if family in ("soap", "psgd"):
        import heavyball
        import heavyball.utils

        heavyball.utils.compile_mode = None  # eager (its default compiles with torch.compile)
        # It supports an lr that changes between steps (a schedule) with multi_tensor=True, its default,
        # and warns that this is experimental; the race checked that the schedule's lr is the one applied.
        warnings.filterwarnings("ignore", message="Learning rate changed between steps")
        kind = heavyball.SOAP if family == "soap" else heavyball.PSGDKron
        return kind(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    if family == "meta":
        recipe = Recipe(**contender.options)
        optimizer = _meta_shampoo.build_meta_shampoo(
            model.parameters(),
            lr=lr,
            betas=BETAS,
            block_size=DASH_BLOCK_SIZE,
            precondition_frequency=recipe.precondition_frequency,
            grafting_beta2=BETAS[1],
            grafting_epsilon=1e-8,
            root_order=recipe.root_order,
            nesterov=recipe.nesterov,
        )
        for group in optimizer.param_groups:  # the builder's 0 is the step-time benchmark's choice
            group["weight_decay"] = WEIGHT_DECAY
        return optimizer
    if family == "converted":  # AdamW's recipe, lr included, handed to DASH as a trainer's conversion does
        adamw = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        return DASH.from_optimizer(adamw, block_size=DASH_BLOCK_SIZE, **contender.options)
    if family == "dash":
        # DASH's defaults, but for the block size; a variant's options override the shared ones.
        options = {"betas": BETAS, "weight_decay": WEIGHT_DECAY, "block_size": DASH_BLOCK_SIZE, **contender.options}
        if "precondition" in options:
            options["model"] = model
        try:
            return DASH(model.parameters(), lr=lr, **options)
        except TypeError as error:
            # Only an option this DASH does not know makes a variant unavailable ("unknown DASH option(s)
            # [...]; known: [...]"); anything else is a bug.
            unknown = str(error).split("; known", 1)[0]
            if "unknown" in unknown and any(f"'{name}'" in unknown for name in contender.options):
                raise Unavailable(f"DASH does not take {sorted(contender.options)}: {unknown}") from error
            raise
    raise ValueError(f"unknown family {family!r}")


def build_muon(params: list[Tensor], lr: float, options: dict[str, Any]) -> torch.optim.Optimizer:
    """``torch.optim.Muon`` with the contender's options; :class:`Unavailable` when this torch's Muon
    does not take one of them (an unknown keyword, or a value it rejects, as ``adjust_lr_fn``)."""
    if not hasattr(torch.optim, "Muon"):
        raise Unavailable(f"torch {torch.__version__} has no torch.optim.Muon")
    try:
        return torch.optim.Muon(params, lr=lr, weight_decay=WEIGHT_DECAY, **options)
    except (TypeError, ValueError) as error:
        if any(str(name) in str(error) or str(value) in str(error) for name, value in options.items()):
            raise Unavailable(f"torch {torch.__version__}'s Muon does not take {options}: {error}") from error
        raise


#: DASH options a record states as the optimizer resolved them (its defaults may change between versions).
DASH_RECORDED = ("block_size", "root_order", "nesterov", "lr_scale", "inverse_root_method")


def optimizer_options(
    contender: Contender, lr: float, muon_adamw_lr: float, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """What a record says about how its optimizer was built."""
    options: dict[str, Any] = {"lr": lr, "betas": BETAS, "weight_decay": WEIGHT_DECAY}
    if contender.family == "muon":
        options["adamw_lr"] = muon_adamw_lr
    if contender.family == "meta":
        # As the optimizer resolved them: the exponent on each factor of a matrix and beta3.
        group = optimizer.param_groups[0]
        override = group["preconditioner_config"].inverse_exponent_override
        options.update(
            block_size=DASH_BLOCK_SIZE,
            beta3=group["beta3"],
            inverse_exponent_override={str(order): value for order, value in sorted(override.items())},
            start_preconditioning_step=group["start_preconditioning_step"],
        )
    if isinstance(optimizer, DASH):
        options.update({name: getattr(optimizer, name) for name in DASH_RECORDED})
        options["precondition_frequency"] = optimizer.param_groups[0]["precondition_frequency"]
    if contender.family in ("soap", "psgd"):
        options["compile"] = False
    options.update(contender.options)
    return {key: list(value) if isinstance(value, tuple) else value for key, value in options.items()}


# ---------------------------------------------------------------------- state bytes
def storages_bytes(values: Iterable[Any], skip: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable from ``values`` (through dicts, lists, tuples
    and dataclasses: Meta's Kronecker factors sit in one), but not those whose data pointer is in ``skip``."""
    seen: dict[int, int] = {}
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif is_dataclass(value) and not isinstance(value, type):
            stack.extend(getattr(value, f.name) for f in fields(value))
    return sum(seen.values())


def state_walk_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (both optimizers of a :class:`MuonWithAdamW`)."""
    inner = getattr(optimizer, "optimizers", (optimizer,))
    params = {p.untyped_storage().data_ptr() for o in inner for g in o.param_groups for p in g["params"]}
    return storages_bytes([o.state for o in inner], params)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """DASH's own count (its stacks live outside ``optimizer.state``), else :func:`state_walk_bytes`."""
    if isinstance(optimizer, DASH):
        counted = optimizer.state_bytes
        return int(counted() if callable(counted) else counted)
    return state_walk_bytes(optimizer)


# ---------------------------------------------------------------------- training
@dataclass(frozen=True)
class Settings:
    """Model, data, schedule and evaluation shared by every run (width varies per run)."""

    steps: int = 200
    batch_size: int = 32
    context: int = 128
    depth: int = 2
    heads: int = 4
    warmup_fraction: float = 0.05
    eval_every: int = 10
    val_windows: int = 256
    max_bytes: int = 4_000_000

    @property
    def warmup(self) -> int:
        return max(1, round(self.warmup_fraction * self.steps))


@dataclass
class Data:
    """The corpus and the fixed validation windows (inputs, targets)."""

    corpus: ByteCorpus
    val_tokens: Tensor
    val_targets: Tensor


def load_data(settings: Settings) -> Data:
    corpus = load_stdlib_corpus(max_bytes=settings.max_bytes)
    windows = RandomWindows(corpus.validation, settings.context, settings.val_windows, seed=VALIDATION_SEED)
    pairs = [windows[i] for i in range(len(windows))]
    return Data(corpus, torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))


def make_model(width: int, seed: int, settings: Settings) -> TinyGPT:
    """The main job's model with the seed's initial weights (``GPTModule`` seeds the same way)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyGPT(context=settings.context, width=width, depth=settings.depth, heads=settings.heads)


def evaluate(model: TinyGPT, data: Data, device: torch.device, batch: int = 64) -> float:
    """Mean loss over the fixed validation windows (eval mode, as Lightning's validation)."""
    model.eval()
    losses, counts = [], []
    with torch.no_grad():
        for start in range(0, data.val_tokens.shape[0], batch):
            tokens = data.val_tokens[start : start + batch].to(device)
            targets = data.val_targets[start : start + batch].to(device)
            losses.append(model.loss(tokens, targets).item() * tokens.shape[0])
            counts.append(tokens.shape[0])
    model.train()
    return sum(losses) / sum(counts)


def train_run(
    contender: Contender,
    lr: float,
    seed: int,
    width: int,
    settings: Settings,
    data: Data,
    device: torch.device,
    muon_adamw_lr: float,
) -> dict[str, Any]:
    """One run; returns its record (see :func:`record_key`). Raises :class:`Unavailable`."""
    model = make_model(width, seed, settings).to(device)
    optimizer = build(contender, model, lr, muon_adamw_lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup, settings.steps))
    windows = RandomWindows(data.corpus.train, settings.context, settings.steps * settings.batch_size, seed)
    curve = [Point(0, 0.0, evaluate(model, data, device))]
    trained_s, status, note = 0.0, "ok", None
    step_s: list[float] = []
    opt_s: list[float] = []
    for step in range(1, settings.steps + 1):
        if status == "ok":
            synchronize(device)
            start = time.perf_counter()
            pairs = [windows[i] for i in range((step - 1) * settings.batch_size, step * settings.batch_size)]
            tokens = torch.stack([p[0] for p in pairs]).to(device)
            targets = torch.stack([p[1] for p in pairs]).to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = model.loss(tokens, targets)
            loss.backward()
            synchronize(device)
            before_step = time.perf_counter()
            try:
                optimizer.step()
            except RootComputationError as error:
                status, note = "diverged", f"step {step}: {error}"
            synchronize(device)
            after_step = time.perf_counter()
            schedule.step()
            synchronize(device)
            step_s.append(time.perf_counter() - start)
            opt_s.append(after_step - before_step)
            trained_s += step_s[-1]
            if not math.isfinite(loss.item()):
                status, note = "diverged", f"training loss {loss.item()} at step {step}"
        if step % settings.eval_every == 0 or step == settings.steps:
            value = evaluate(model, data, device) if status == "ok" else math.nan
            if not math.isfinite(value) and status == "ok":
                status, note = "diverged", f"validation loss {value} at step {step}"
            curve.append(Point(step, trained_s, value))
    return {
        "optimizer": contender.name,
        "width": width,
        "params": sum(p.numel() for p in model.parameters()),
        "lr": lr,
        "seed": seed,
        "steps": settings.steps,
        "status": status,
        "note": note,
        "options": optimizer_options(contender, lr, muon_adamw_lr, optimizer),
        "settings": asdict(settings),
        "environment": environment(),
        "initial_val_loss": curve[0].val_loss,
        "final_val_loss": finite_or_none(curve[-1].val_loss),
        "wall_s": trained_s,
        "train_step_ms": min(window_ms(step_s)),
        "train_step_robust_ms": robust_step_ms(step_s),
        "opt_step_ms": min(window_ms(opt_s)),
        "opt_step_robust_ms": robust_step_ms(opt_s),
        "opt_step_median_ms": 1e3 * statistics.median(opt_s),
        "opt_step_mean_ms": 1e3 * statistics.mean(opt_s),
        "train_window_ms": [round(v, 3) for v in window_ms(step_s)],
        "opt_window_ms": [round(v, 3) for v in window_ms(opt_s)],
        "state_bytes": state_bytes(optimizer),
        "state_bytes_walk": state_walk_bytes(optimizer),
        "curve": [[p.step, round(p.wall_s, 4), finite_or_none(p.val_loss)] for p in curve],
    }


def window_ms(step_s: list[float], window: int = TIMING_WINDOW) -> list[float]:
    """Mean step time of each full ``window``-step window, in ms (of the partial one if none is full).
    Every window holds whole root-refresh cycles of DASH and Meta's Shampoo."""
    windows = [step_s[i : i + window] for i in range(0, len(step_s), window)]
    full = [w for w in windows if len(w) == window] or windows
    return [1e3 * sum(w) / len(w) for w in full] or [math.nan]


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def unavailable_record(name: str, width: int, steps: int, reason: str) -> dict[str, Any]:
    return {
        "optimizer": name,
        "width": width,
        "lr": None,
        "seed": None,
        "steps": steps,
        "status": "unavailable",
        "note": reason,
    }


# ---------------------------------------------------------------------- records
def record_key(record: dict[str, Any]) -> tuple:
    """Records are keyed by optimizer, width, lr, seed and steps."""
    return (record["optimizer"], record["width"], record["lr"], record["seed"], record["steps"])


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with ``new`` added: a new record replaces an old one with the same key, and an
    optimizer that now has runs at a width and step count loses its ``unavailable`` record there."""
    ran = {(r["optimizer"], r["width"], r["steps"]) for r in new if r["status"] != "unavailable"}
    keys = {record_key(r) for r in new}
    kept = [
        r
        for r in old
        if record_key(r) not in keys
        and not (r["status"] == "unavailable" and (r["optimizer"], r["width"], r["steps"]) in ran)
    ]
    return kept + new


def load_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return json.loads(path.read_text())["records"]


def curve_points(record: dict) -> list[Point]:
    return [Point(s, w, math.nan if v is None else v) for s, w, v in record["curve"]]


def runs_of(records: list[dict], name: str, width: int, steps: int) -> list[dict]:
    return [
        r
        for r in records
        if r["optimizer"] == name and r["width"] == width and r["steps"] == steps and r["status"] != "unavailable"
    ]


def loss_score(runs: list[dict]) -> float:
    """Mean final loss of runs; infinite if one diverged."""
    losses = [r["final_val_loss"] for r in runs]
    if not losses or any(v is None or not math.isfinite(v) for v in losses):
        return math.inf
    return statistics.mean(losses)


def best_lr(records: list[dict], name: str, width: int, steps: int) -> float | None:
    """The lr with the lowest final validation loss, averaged over the seeds run at every lr
    (over all its seeds when no seed was run at every lr); a diverged run never wins."""
    runs = runs_of(records, name, width, steps)
    by_lr: dict[float, list[dict]] = {}
    for run in runs:
        by_lr.setdefault(run["lr"], []).append(run)
    if not by_lr:
        return None
    common = set.intersection(*({r["seed"] for r in group} for group in by_lr.values()))

    def score(lr: float) -> float:
        chosen = [r for r in by_lr[lr] if r["seed"] in common] or by_lr[lr]
        return loss_score(chosen)

    return min(sorted(by_lr), key=score)


def steps_to(record: dict, target: float) -> Point | None:
    """The first evaluation (after step 0) at or below ``target``."""
    return first_reaching(curve_points(record), target)


# ---------------------------------------------------------------------- analysis
def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summary_rows(records: list[dict], width: int, steps: int, names: list[str]) -> list[dict]:
    """One row per contender at its best lr (see the module docstring)."""
    adamw_lr = best_lr(records, "adamw", width, steps)
    targets = {
        r["seed"]: r["final_val_loss"]
        for r in runs_of(records, "adamw", width, steps)
        if r["lr"] == adamw_lr and r["final_val_loss"] is not None
    }
    adamw_steps = {}
    for r in runs_of(records, "adamw", width, steps):
        if r["lr"] == adamw_lr and r["seed"] in targets:
            reached = steps_to(r, targets[r["seed"]])
            adamw_steps[r["seed"]] = reached
    rows = []
    for name in names:
        unavailable = [
            r
            for r in records
            if r["optimizer"] == name and r["width"] == width and r["steps"] == steps and r["status"] == "unavailable"
        ]
        lr = best_lr(records, name, width, steps)
        if lr is None:
            if unavailable:
                rows.append({"optimizer": name, "status": "unavailable", "note": unavailable[0]["note"]})
            continue
        runs = sorted((r for r in runs_of(records, name, width, steps) if r["lr"] == lr), key=lambda r: r["seed"])
        finals = [r["final_val_loss"] for r in runs]
        finite = [v for v in finals if v is not None]
        reached_steps, ratios, walls, estimates = [], [], [], []
        fastest_train_ms = min(r["train_step_ms"] for r in runs)
        for r in runs:
            if r["seed"] not in targets:
                continue
            point = steps_to(r, targets[r["seed"]])
            base = adamw_steps.get(r["seed"])
            reached_steps.append(None if point is None else point.step)
            ratios.append(None if point is None or base is None else point.step / base.step)
            walls.append(None if point is None else point.wall_s)
            estimates.append(None if point is None else point.step * fastest_train_ms / 1e3)
        mean, sd = mean_sd(finite) if finite else (math.nan, math.nan)
        rows.append(
            {
                "optimizer": name,
                "status": "ok" if len(finite) == len(finals) else "diverged",
                "best_lr": lr,
                "seeds": [r["seed"] for r in runs],
                "params": runs[0]["params"],
                "final_val_loss": finals,
                "final_val_loss_mean": finite_or_none(mean),
                "final_val_loss_sd": finite_or_none(sd),
                "steps_to_adamw_final": reached_steps,
                "steps_ratio_to_adamw": ratios,
                "wall_s_to_adamw_final": walls,
                "estimated_s_to_adamw_final": estimates,
                "wall_s": statistics.mean(r["wall_s"] for r in runs),
                "opt_step_ms": min(r["opt_step_ms"] for r in runs),
                "opt_step_robust_ms": statistics.median(r["opt_step_robust_ms"] for r in runs),
                "opt_step_median_ms": statistics.median(r["opt_step_median_ms"] for r in runs),
                "opt_step_mean_ms": statistics.median(r["opt_step_mean_ms"] for r in runs),
                "train_step_ms": fastest_train_ms,
                "train_step_robust_ms": statistics.median(r["train_step_robust_ms"] for r in runs),
                "state_bytes": runs[0]["state_bytes"],
                "state_bytes_walk": runs[0]["state_bytes_walk"],
            }
        )
    return rows


def lr_sweep(records: list[dict], width: int, steps: int, names: list[str]) -> dict[str, dict[str, float | None]]:
    """Per contender, lr -> mean final validation loss over the seeds run at that lr."""
    sweep = {}
    for name in names:
        by_lr: dict[float, list[dict]] = {}
        for run in runs_of(records, name, width, steps):
            by_lr.setdefault(run["lr"], []).append(run)
        if by_lr:
            sweep[name] = {f"{lr:g}": finite_or_none(loss_score(by_lr[lr])) for lr in sorted(by_lr)}
    return sweep


def lr_transfer(records: list[dict], width: int, steps: int, dash: str = TRANSFER_DASH) -> dict[str, Any] | None:
    """AdamW's and DASH's best lr, their ratio, and DASH's final loss at AdamW's best lr against at
    its own (the seeds both lrs were run with)."""
    adamw_lr, dash_lr = best_lr(records, "adamw", width, steps), best_lr(records, dash, width, steps)
    if adamw_lr is None or dash_lr is None:
        return None
    runs = runs_of(records, dash, width, steps)
    at = {lr: {r["seed"]: r for r in runs if r["lr"] == lr} for lr in (adamw_lr, dash_lr)}
    seeds = sorted(set(at[adamw_lr]) & set(at[dash_lr]))
    own = loss_score([at[dash_lr][s] for s in seeds]) if seeds else math.inf
    borrowed = loss_score([at[adamw_lr][s] for s in seeds]) if seeds else math.inf
    return {
        "width": width,
        "dash": dash,
        "adamw_best_lr": adamw_lr,
        "dash_best_lr": dash_lr,
        "ratio": dash_lr / adamw_lr,
        "seeds": seeds,
        "dash_loss_at_own_best": finite_or_none(own),
        "dash_loss_at_adamw_best": finite_or_none(borrowed),
        "lost": finite_or_none(borrowed - own) if seeds else None,
        **converted_transfer(records, width, steps, adamw_lr, loss_score(list(at[dash_lr].values()))),
    }


def converted_transfer(
    records: list[dict], width: int, steps: int, adamw_lr: float, own: float
) -> dict[str, float | list[int] | None]:
    """``from_optimizer``'s DASH (AdamW's lr times its ``lr_scale``) at AdamW's best lr: its mean final loss
    over the seeds it ran, and that minus ``own``, DASH's at its own best lr (every seed run there)."""
    runs = [r for r in runs_of(records, "dash-from-adamw", width, steps) if r["lr"] == adamw_lr]
    if not runs:
        return {}
    loss = loss_score(runs)
    return {
        "converted_seeds": sorted(r["seed"] for r in runs),
        "converted_loss_at_adamw_best": finite_or_none(loss),
        "converted_lost": finite_or_none(loss - own),
    }


# ---------------------------------------------------------------------- output
def fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def seeds_text(values: list, spec: str) -> str:
    """Per-seed values, ``-`` for a seed that never reached; the mean of the defined ones first."""
    defined = [v for v in values if v is not None]
    if not values:
        return "-"
    head = format(statistics.mean(defined), spec) if defined else "never"
    if len(values) == 1:
        return head
    return f"{head} ({' '.join(fmt(v, spec) for v in values)})"


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = [
        "optimizer",
        "best lr",
        "seeds",
        "final val loss",
        "steps to AdamW final",
        "/ AdamW",
        "train s to it",
        "est. s",
        "opt step ms",
        "state MiB",
    ]
    body = []
    for row in rows:
        if row["status"] == "unavailable":
            body.append([row["optimizer"], "unavailable"] + [""] * (len(header) - 2))
            continue
        finals = [v for v in row["final_val_loss"] if v is not None]
        if finals:
            loss = f"{row['final_val_loss_mean']:.4f} ± {row['final_val_loss_sd']:.4f}"
            if len(finals) > 1:
                loss += f" ({min(finals):.4f}-{max(finals):.4f})"
            if len(finals) < len(row["final_val_loss"]):
                loss += " (some diverged)"
        else:
            loss = "diverged"
        body.append(
            [
                row["optimizer"],
                f"{row['best_lr']:g}",
                str(len(row["seeds"])),
                loss,
                seeds_text(row["steps_to_adamw_final"], ".0f"),
                seeds_text(row["steps_ratio_to_adamw"], ".2f"),
                seeds_text(row["wall_s_to_adamw_final"], ".1f"),
                seeds_text(row["estimated_s_to_adamw_final"], ".1f"),
                f"{row['opt_step_ms']:.1f}",
                f"{row['state_bytes'] / 2**20:.2f}",
            ]
        )
    return header, body


def sweep_text(sweep: dict[str, dict[str, float | None]]) -> str:
    return "\n".join(
        f"  {name:<22} " + "  ".join(f"{lr}: {fmt(loss)}" for lr, loss in losses.items())
        for name, losses in sweep.items()
    )


def transfer_text(transfer: dict[str, Any]) -> str:
    return (
        f"  width {transfer['width']}: best lr AdamW {transfer['adamw_best_lr']:g}, {transfer['dash']} "
        f"{transfer['dash_best_lr']:g} (ratio {transfer['ratio']:g}); {transfer['dash']} final loss at its own "
        f"best {fmt(transfer['dash_loss_at_own_best'])}, at AdamW's best {fmt(transfer['dash_loss_at_adamw_best'])} "
        f"(lost {fmt(transfer['lost'])}; seeds {transfer['seeds']})"
        + (
            f"; from_optimizer(AdamW) at AdamW's best {fmt(transfer['converted_loss_at_adamw_best'])} "
            f"(lost {fmt(transfer['converted_lost'])}; seeds {transfer['converted_seeds']})"
            if "converted_seeds" in transfer
            else ""
        )
    )


def plot(records: list[dict], rows: list[dict], path: Path, title: str, target: float | None) -> None:
    """Two panels: mean validation loss at each contender's best lr against steps and against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_wall) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = plt.get_cmap("tab10").colors
    tail_low, tail_high = math.inf, -math.inf
    # The contenders only (a --dash-variant of an investigation is in the table, not in the plot).
    for index, row in enumerate(r for r in rows if r["status"] != "unavailable" and r["optimizer"] in CONTENDERS):
        runs = [
            r
            for r in records
            if r["optimizer"] == row["optimizer"]
            and r["lr"] == row["best_lr"]
            and r["seed"] in row["seeds"]
            and r["width"] == row["width"]
            and r["steps"] == row["steps"]
        ]
        curves = [curve_points(r) for r in runs]
        length = min(len(c) for c in curves)
        steps = [curves[0][i].step for i in range(1, length)]
        wall = [statistics.mean(c[i].wall_s for c in curves) for i in range(1, length)]
        loss = [statistics.mean(c[i].val_loss for c in curves) for i in range(1, length)]
        style = "-" if row["optimizer"].startswith("dash") else "--"
        if index >= len(colors):  # a colour's second use: another line style
            style = "-." if style == "-" else ":"
        label = f"{row['optimizer']} (lr {row['best_lr']:g}, {len(curves)} seed{'s' if len(curves) > 1 else ''})"
        color = colors[index % len(colors)]
        by_step.plot(steps, loss, style, color=color, label=label)
        by_wall.plot(wall, loss, style, color=color, label=label)
        finite = [v for v in loss if math.isfinite(v)]
        if finite:
            tail_low = min(tail_low, min(finite))
            tail_high = max(tail_high, finite[len(finite) // 5] if len(finite) > 5 else finite[-1])
    if math.isfinite(tail_low) and tail_high > tail_low:
        by_step.set_ylim(tail_low - 0.05 * (tail_high - tail_low), tail_high)
    for axis in (by_step, by_wall):
        if target is not None:
            axis.axhline(target, color="grey", linestyle=":", linewidth=0.9, label="AdamW final (mean)")
        axis.grid(alpha=0.3)
    by_step.set_xlabel("optimizer step")
    by_wall.set_xlabel("training wall time (s, evaluations excluded)")
    by_step.set_ylabel("validation loss (nats/byte)")
    by_wall.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report(records: list[dict], out: Path, device_name: str) -> dict:
    """Print the tables and write the summary and the plots of every width and step count in
    ``records``; returns the summary."""
    summary: dict[str, Any] = {"widths": {}, "lr_transfer": []}
    groups = sorted({(r["width"], r["steps"]) for r in records})
    for width, steps in groups:
        ran = {r["optimizer"] for r in records if r["width"] == width and r["steps"] == steps}
        present = [n for n in CONTENDERS if n in ran] + sorted(ran - set(CONTENDERS))  # variants last
        rows = summary_rows(records, width, steps, present)
        for row in rows:
            row.update(width=width, steps=steps)
        sweep = lr_sweep(records, width, steps, present)
        transfer = lr_transfer(records, width, steps)
        params = next((r["params"] for r in records if r["width"] == width and "params" in r), None)
        key = f"w{width}_s{steps}"
        summary["widths"][key] = {"width": width, "steps": steps, "params": params, "rows": rows, "lr_sweep": sweep}
        if transfer is not None:
            summary["lr_transfer"].append(transfer)
        header, body = table_rows(rows)
        print(f"\nwidth {width} ({params:,} parameters), {steps} steps; at each contender's best lr:")
        print(format_columns(header, body))
        print("final validation loss per lr (mean over the seeds run at it):")
        print(sweep_text(sweep))
        summary["widths"][key]["markdown"] = markdown_table(header, body)
        adamw = next((row for row in rows if row["optimizer"] == "adamw" and row["status"] != "unavailable"), None)
        target = adamw["final_val_loss_mean"] if adamw else None
        png = out / f"peers_{device_name}_w{width}.png"
        shape = next((r["settings"] for r in records if r["width"] == width and "settings" in r), {})
        title = (
            f"TinyGPT width {width} ({params:,} params), depth {shape.get('depth')}, context {shape.get('context')}, "
            f"{steps} steps, stdlib bytes ({device_name})"
        )
        if any(row["status"] != "unavailable" for row in rows):
            plot(records, rows, png, title, target)
            print(f"wrote {png}")
    if summary["lr_transfer"]:
        print("\nlr transfer (AdamW's best lr used for DASH):")
        for transfer in summary["lr_transfer"]:
            print(transfer_text(transfer))
    return summary


def environment() -> dict[str, Any]:
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for module, distribution in (("heavyball", "heavyball"), ("distributed_shampoo", "torch-shampoo")):
        if importlib.util.find_spec(module) is not None:
            from importlib.metadata import version

            versions[distribution] = version(distribution)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.machine(),
    )
    return versions | {"threads": torch.get_num_threads(), "cpu": cpu}


def write_results(path: Path, records: list[dict], summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "summary": summary,
        "records": sorted(records, key=lambda r: tuple(str(v) for v in record_key(r))),
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")


# ---------------------------------------------------------------------- protocol
def neighbour_lrs(records: list[dict], contender: Contender, main_width: int, steps: int) -> list[float]:
    """At a larger width: the contender's best lr at the main width and the better of its grid neighbours
    there (the grid's middle two when the main width has no runs)."""
    best = best_lr(records, contender.name, main_width, steps)
    grid = sorted(contender.lrs)
    if best is None:
        middle = len(grid) // 2
        return grid[max(0, middle - 1) : middle + 1]
    swept = lr_sweep(records, main_width, steps, [contender.name]).get(contender.name, {})
    ordered = sorted({*grid, best})
    index = ordered.index(best)
    candidates = [ordered[i] for i in (index - 1, index + 1) if 0 <= i < len(ordered)]

    def score(lr: float) -> float:
        value = swept.get(f"{lr:g}")
        return math.inf if value is None else value

    return sorted([best, min(candidates, key=score)]) if candidates else [best]


def warm_up(contenders: list[Contender], width: int, settings: Settings, data: Data, device: torch.device) -> None:
    """Two untimed steps of each contender, so that one-time costs (imports, kernel selection) land in
    no run's time."""
    short = replace(settings, steps=2, eval_every=2)
    for contender in contenders:
        try:
            train_run(contender, contender.lrs[0], 0, width, short, data, device, 6e-3)
        except Unavailable:
            pass


def edge_extension(records: list[dict], name: str, width: int, steps: int) -> float | None:
    """When the best lr is the largest (smallest) of those run, twice (half) that lr, else None."""
    lrs = sorted({r["lr"] for r in runs_of(records, name, width, steps)})
    best = best_lr(records, name, width, steps)
    if best is None or len(lrs) < 2:
        return None
    if best == lrs[-1]:
        return float(f"{2 * best:.6g}")
    if best == lrs[0]:
        return float(f"{best / 2:.6g}")
    return None


def parse_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--optimizers",
        type=parse_list,
        default=None,
        help="comma-separated contenders (default: all, or none besides the --dash-variant ones)",
    )
    parser.add_argument(
        "--large-optimizers",
        type=parse_list,
        default=list(LARGE_DEFAULT),
        help="the contenders run at the widths after the first (default: %(default)s)",
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256], help="the first is the main width")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the first sweeps the lrs")
    parser.add_argument("--large-seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds at the larger widths")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--val-windows", type=int, default=defaults.val_windows)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--context", type=int, default=defaults.context)
    parser.add_argument("--depth", type=int, default=defaults.depth)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--max-bytes", type=int, default=defaults.max_bytes)
    for name, contender in CONTENDERS.items():
        parser.add_argument(
            f"--lrs-{name}",
            dest=f"lrs_{name.replace('-', '_')}",
            type=float,
            nargs="+",
            default=list(contender.lrs),
            help="lr grid (default: %(default)s)",
        )
    parser.add_argument(
        "--dash-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='an extra DASH variant, its options as JSON (they override the shared ones; "lrs": its grid), '
        'e.g. \'dash-f2={"inverse_root_method": "eigh", "precondition_frequency": 2, "lrs": [0.006]}\'; '
        "(runs with the --optimizers given, else alone)",
    )
    parser.add_argument(
        "--muon-adamw-lr",
        type=float,
        default=None,
        help="lr of the AdamW part of muon (default: AdamW's best at the same width, else 6e-3)",
    )
    parser.add_argument(
        "--extend-edges",
        type=int,
        default=2,
        help="at the main width, times a grid is extended by one doubling (halving) when its best lr is its "
        "largest (smallest) (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default: %(default)s; on a shared 2-core machine a second busy process slowed "
        "two threads 10x, see the module docstring)",
    )
    parser.add_argument("--resume", action="store_true", help="skip runs whose key is already in the JSON")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        help="results files whose records join the JSON first (a race split over processes with their own --out)",
    )
    parser.add_argument("--report-only", action="store_true", help="rebuild the table and plots from the JSON")
    args = parser.parse_args(argv)
    if args.optimizers is None:
        args.optimizers = [] if args.dash_variant else list(CONTENDERS)
    args.registry = dict(CONTENDERS)
    for text in args.dash_variant:
        name, _, options = text.partition("=")
        try:
            options = json.loads(options)
        except json.JSONDecodeError as error:
            parser.error(f"--dash-variant {text!r}: {error}")
        lrs = tuple(options.pop("lrs", GRAFTED_LRS))
        options = {key: tuple(value) if isinstance(value, list) else value for key, value in options.items()}
        args.registry[name] = Contender(name, "dash", lrs, options)
        if name not in args.optimizers:
            args.optimizers.append(name)
    unknown = set(args.optimizers) - set(args.registry)
    if unknown:
        parser.error(f"unknown optimizer(s) {sorted(unknown)}; known: {list(args.registry)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    device_name = device_label(device)
    settings = Settings(
        steps=args.steps,
        batch_size=args.batch_size,
        context=args.context,
        depth=args.depth,
        heads=args.heads,
        eval_every=args.eval_every,
        val_windows=args.val_windows,
        max_bytes=args.max_bytes,
    )
    path = args.out / f"peers_{device_name}.json"
    records = load_records(path)
    for other in args.merge:
        records = merge(records, load_records(other))
    # AdamW first: muon's AdamW part and the DASH lrs at larger widths use AdamW's best lr.
    registry = args.registry
    names = sorted(args.optimizers, key=lambda n: (n != "adamw", list(registry).index(n)))
    print(f"{device_name}, {environment()}")
    print(f"settings: {settings}")
    start = time.perf_counter()
    if not args.report_only:
        data = load_data(settings)
        print(f"corpus {data.corpus.train.numel():,} training / {data.corpus.validation.numel():,} validation bytes")
        main_width = args.widths[0]
        warm_up([registry[n] for n in names], main_width, settings, data, device)
        for width in args.widths:
            large = width != main_width
            seeds = args.large_seeds if large else args.seeds
            for name in names:
                if large and name not in args.large_optimizers:
                    continue
                flag = f"lrs_{name.replace('-', '_')}"
                contender = registry[name]
                if name in CONTENDERS:
                    contender = replace(contender, lrs=tuple(getattr(args, flag)))
                if contender.family == "converted":  # the claim under test: AdamW's best lr, unchanged
                    adamw_lr = best_lr(records, "adamw", width, settings.steps)
                    lrs = [adamw_lr] if adamw_lr is not None else list(contender.lrs)
                elif large:
                    lrs = neighbour_lrs(records, contender, main_width, settings.steps)
                    adamw_lr = best_lr(records, "adamw", width, settings.steps)
                    if contender.family == "dash" and adamw_lr is not None and adamw_lr not in lrs:
                        lrs = sorted([*lrs, adamw_lr])
                else:
                    lrs = list(contender.lrs)
                records, ok = run_grid(records, contender, lrs, seeds[:1], width, settings, data, device, args, path)
                if not ok:
                    continue
                for _ in range(0 if large or contender.family == "converted" else args.extend_edges):
                    beyond = edge_extension(records, name, width, settings.steps)
                    if beyond is None:
                        break
                    print(f"  {name}: best lr at the edge of the grid; adding {beyond:g}")
                    records, _ = run_grid(
                        records, contender, [beyond], seeds[:1], width, settings, data, device, args, path
                    )
                chosen = best_lr(records, name, width, settings.steps)
                rest = seeds[1:]
                records, _ = run_grid(records, contender, [chosen], rest, width, settings, data, device, args, path)
        print(f"\nruns took {time.perf_counter() - start:.0f} s")
    summary = report(records, args.out, device_name)
    write_results(path, records, summary)
    print(f"wrote {path}")
    return summary


def run_grid(
    records: list[dict],
    contender: Contender,
    lrs: list[float],
    seeds: list[int],
    width: int,
    settings: Settings,
    data: Data,
    device: torch.device,
    args: argparse.Namespace,
    path: Path,
) -> tuple[list[dict], bool]:
    """Run ``contender`` at every lr x seed, merging each record into ``records`` (and the JSON, so an
    interrupted race keeps what it measured); False when the contender is unavailable."""
    existing = {record_key(r) for r in records if r["status"] != "unavailable"}
    for lr in lrs:
        for seed in seeds:
            key = (contender.name, width, lr, seed, settings.steps)
            if args.resume and key in existing:
                continue
            muon_lr = args.muon_adamw_lr or best_lr(records, "adamw", width, settings.steps) or 6e-3
            try:
                record = train_run(contender, lr, seed, width, settings, data, device, muon_lr)
            except Unavailable as error:
                print(f"  {contender.name}: unavailable ({error})")
                records = merge(records, [unavailable_record(contender.name, width, settings.steps, str(error))])
                write_results(path, records, {})
                return records, False
            records = merge(records, [record])
            write_results(path, records, {})
            print(
                f"  {contender.name:<22} w{width} lr {lr:<7g} seed {seed}: {record['status']}, final val loss "
                f"{fmt(record['final_val_loss'])}, {record['wall_s']:.1f} s training, opt step "
                f"{record['opt_step_ms']:.1f} ms, state {record['state_bytes'] / 2**20:.2f} MiB",
                flush=True,
            )
    return records, True


if __name__ == "__main__":
    main()
