"""The race's contenders (``peers.py``): their lr grids, recipes, how each optimizer is built, its state bytes."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

import _meta_shampoo
import torch
from torch import Tensor, nn

from lightning_dash import DASH

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
    #: adamw, muon, soap, psgd, meta, meta-ec (its eigenvalue-corrected Shampoo), dash, converted (AdamW turned
    #: into DASH by from_optimizer), strategy
    #: (the same with the model, every DASH option at its default: what ``strategy="dash"`` makes of it)
    family: str
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
    # Meta's eigenvalue-corrected Shampoo from AdamW's recipe (no grafting), over AdamW's grid
    **{
        name: Contender(
            name,
            "meta-ec",
            ADAMW_LRS,
            {"eigenbasis": eigenbasis, "precondition_frequency": META_FREQUENCY},
            _meta_shampoo.MODULE,
        )
        for name, eigenbasis in (("meta-ec-shampoo", "eigh"), ("meta-soap", "qr"))
    },
    **{name: Contender(name, "dash", DASH_LRS, options) for name, options in DASH_VARIANTS.items()},
    "dash-from-adamw": Contender("dash-from-adamw", "converted", ADAMW_LRS),
    "dash-strategy-defaults": Contender("dash-strategy-defaults", "strategy", ADAMW_LRS),
}
#: The contenders that take AdamW's recipe, lr included, and run at AdamW's best lr only.
FROM_ADAMW = ("converted", "strategy")
#: The contenders that run at the larger widths by default.
LARGE_DEFAULT = ("adamw", "muon", "soap", "dash-eigh", "dash-from-adamw", "dash-strategy-defaults")
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
    if family == "meta-ec":
        optimizer = _meta_shampoo.build_meta_eigenvalue_corrected(
            model.parameters(), lr=lr, betas=BETAS, block_size=DASH_BLOCK_SIZE, **contender.options
        )
        for group in optimizer.param_groups:  # decoupled, as AdamW's
            group["weight_decay"] = WEIGHT_DECAY
        return optimizer
    if family == "converted":  # AdamW's recipe, lr included, handed to DASH as a trainer's conversion does
        adamw = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        return DASH.from_optimizer(adamw, block_size=DASH_BLOCK_SIZE, **contender.options)
    if family == "strategy":  # what strategy="dash" makes of it: the model for routing, DASH's defaults otherwise
        adamw = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        return DASH.from_optimizer(adamw, model=model, **contender.options)
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
    if contender.family in ("meta", "meta-ec"):
        options.update(block_size=DASH_BLOCK_SIZE, epsilon=optimizer.param_groups[0]["epsilon"])
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
        options["epsilon"] = optimizer.param_groups[0]["epsilon"]
        options["grafting_norm"] = optimizer.config.grafting_norm
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
