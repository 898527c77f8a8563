"""Roundoff sensitivity of DASH's numerics: how far a 1e-7 relative gradient perturbation moves training.

Two ranks sum gradients in another order than one process does, which changes every gradient by
about 1e-7 of itself. A trajectory that amplifies that difference makes distributed runs disagree
with single-process ones for reasons that are not bugs. The rule for DASH's defaults: on every network,
no larger than torch's Muon on the same seeds (the optimizer a user would otherwise pick; no trainer
promises more); ``DashConfig.close_to_one_process()`` keeps it at 1e-4 of the movement after 10 steps.

For each candidate (root order, damping ``epsilon``, refresh period, matmul precision, root solver, routing,
grafting norm, decomposition dtype, ``lr_scale``, root schedule) this
trains small networks with ``DASH.from_optimizer(AdamW)`` for ``--steps`` steps, once as is and once with every
gradient multiplied by ``1 + 1e-7 * randn``, and reports ``||p' - p|| / ||p - p0||`` over all
parameters, the maximum over ``--seeds`` (each seed's in ``per_seed``; one torch thread,
deterministic). Networks: the multi-process tests' MLP (12 -> 40 -> 24 -> 3, tanh, batch 16,
AdamW lr 0.02) and a residual MLP with LayerNorm (width 64, lr 3e-3), both converted without the
model (every matrix preconditioned); and the model-family suite's byte-level GRU language model (embedding 64, GRU
192, 32 windows of 64 bytes of English text, AdamW lr 3e-2), converted with the model as the
strategies convert it. Its factors have deep tails (an output layer that turns nearly rank one
within a few steps, bytes that are almost never the target): the case that exposes roundoff.

    python benchmarks/numerics/roundoff.py                      # DASH's defaults and the candidates
    python benchmarks/numerics/roundoff.py --epsilons 1e-6 1e-4 1e-3 --orders 2 4 --frequencies 2 10
    python benchmarks/numerics/roundoff.py --matmul-precisions float32 tf32 --methods eigh newton_db   # TF32 emulated
    python benchmarks/numerics/roundoff.py --device cuda --matmul-precisions float32 tf32 --out roundoff_cuda.json

On the CPU, ``tf32`` is emulated (operands rounded to TF32, :mod:`lightning_dash.optim.precision`);
on CUDA it runs on the tensor cores.

``--optimizer-dtype float64`` separates the optimizer's arithmetic from the model's: DASH then steps
float64 master copies of the float32 model (statistics, roots, momentum and update in float64), and
the model's forward and backward stay float32, reading the masters rounded to float32.

    python benchmarks/numerics/roundoff.py --networks gru_lm --seeds 8 --optimizer-dtype float32 float64

``--optimizer adamw`` or ``muon`` perturbs AdamW's own trajectory, or torch's Muon's
(``adjust_lr_fn="match_rms_adamw"`` at twice AdamW's lr on the 2-D weights, AdamW on the rest), for scale;
several names measure each into the same record (``--optimizer dash muon``: the defaults' rule).

``--perturbations halves`` measures what two data-parallel ranks change instead of a random
perturbation: the perturbed run steps on the mean of the two half-batches' gradients (each rank's
share, averaged as DDP averages them), the other on the whole batch's.

    python benchmarks/numerics/roundoff.py --networks gru_lm --seeds 8 --perturbations relative halves
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _peers_contenders import MuonWithAdamW  # noqa: E402
from _stamp import stamp  # noqa: E402
from common import format_columns, write_json  # noqa: E402
from family_models import ByteGRU, english_bytes  # noqa: E402

from lightning_dash import DASH, DashConfig  # noqa: E402

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parity_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 3))


class ResidualLayerNormMLP(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Linear(12, width)
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(x)
        return self.out(hidden + self.block(hidden))


def regression_batches(steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, 16, 12, generator=generator)
    y = torch.sin(2 * x[..., :3]) + 0.1 * torch.randn(steps, 16, 3, generator=generator)
    return list(zip(x, y))


def text_batches(steps: int, seed: int, batch: int = 32, context: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = english_bytes()
    generator = torch.Generator().manual_seed(1000 + seed)
    starts = torch.randint(0, train.numel() - context - 1, (steps, batch), generator=generator)
    windows = [torch.stack([train[s : s + context + 1] for s in row.tolist()]).long() for row in starts]
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class Network:
    """A network of the benchmark: how to build it, its batches and loss, AdamW's recipe, and
    whether DASH is told the model (the strategies' routing) or not (every matrix preconditioned)."""

    build: Callable[[], nn.Module]
    batches: Callable[[int, int], list[tuple[torch.Tensor, torch.Tensor]]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lr: float
    betas: tuple[float, float]
    knows_model: bool


NETWORKS = {
    "parity_mlp": Network(parity_mlp, regression_batches, nn.functional.mse_loss, 0.02, (0.9, 0.99), False),
    "residual_ln_mlp": Network(
        ResidualLayerNormMLP, regression_batches, nn.functional.mse_loss, 3e-3, (0.9, 0.99), False
    ),
    "gru_lm": Network(ByteGRU, text_batches, next_byte_loss, 3e-2, (0.9, 0.999), True),
}


#: What the perturbed run changes: every gradient entry by ``size * randn`` of itself, or the
#: gradient into the mean of the two half-batches' gradients.
PERTURBATIONS = ("relative", "halves")


def batch_gradients(
    model: nn.Module,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    halves: bool,
) -> None:
    """The batch loss's gradient into ``.grad``: the whole batch's, or (``halves``) the mean of its
    two halves' gradients, as two data-parallel ranks each holding one half average them."""
    if not halves:
        model.zero_grad()
        loss(model(x), y).backward()
        return
    shares = []
    for part in (slice(None, len(x) // 2), slice(len(x) // 2, None)):
        model.zero_grad()
        loss(model(x[part]), y[part]).backward()
        shares.append([p.grad for p in model.parameters()])
    for p, first, second in zip(model.parameters(), *shares):
        p.grad = (first + second) / 2


#: The optimizers whose trajectories the benchmark can perturb: DASH converted from the network's AdamW,
#: that AdamW itself, or torch's Muon on the 2-D weights (``adjust_lr_fn="match_rms_adamw"`` at twice
#: AdamW's lr, the race's best) with that AdamW on the rest.
OPTIMIZERS = ("dash", "adamw", "muon")


def build_optimizer(kind: str, adamw: torch.optim.AdamW, model: nn.Module | None, options: dict[str, Any]) -> Any:
    """The optimizer ``kind`` (:data:`OPTIMIZERS`) over ``adamw``'s parameters and recipe."""
    if kind == "dash":
        return DASH.from_optimizer(adamw, model=model, **options)
    if kind == "adamw":
        return adamw
    group = adamw.param_groups[0]
    matrices = [p for p in group["params"] if p.ndim == 2]
    rest = [p for p in group["params"] if p.ndim != 2]
    muon = torch.optim.Muon(matrices, lr=2 * group["lr"], weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    return MuonWithAdamW(muon, torch.optim.AdamW(rest, lr=group["lr"], betas=group["betas"], weight_decay=0.01))


def trajectory_change(
    network: str,
    options: dict[str, Any],
    steps: int,
    seed: int,
    size: float = 1e-7,
    device: torch.device | None = None,
    optimizer_dtype: torch.dtype = torch.float32,
    perturbation: str = "relative",
    optimizer_kind: str = "dash",
) -> float:
    """``||p' - p|| / ||p - p0||`` after ``steps`` steps, ``p'`` trained on perturbed gradients
    (``"relative"``: each times ``1 + size * randn``; ``"halves"``: the mean of the two
    half-batches' gradients); DASH steps the float32 model itself, or float64 masters of it
    (``optimizer_dtype``)."""
    if perturbation not in PERTURBATIONS:
        raise ValueError(f"perturbation must be one of {PERTURBATIONS}, got {perturbation!r}")
    spec = NETWORKS[network]
    device = device or torch.device("cpu")
    batches = [(x.to(device), y.to(device)) for x, y in spec.batches(steps, seed)]
    finals, start = [], None
    for perturbed in (False, True):
        halves = perturbed and perturbation == "halves"
        scale = size if perturbed and perturbation == "relative" else 0.0
        torch.manual_seed(seed)
        model = spec.build().to(device)
        # The optimizer's own copy: the model itself, or float64 masters of it (``optimizer_dtype``).
        stepped = model if optimizer_dtype == torch.float32 else copy.deepcopy(model).to(optimizer_dtype)
        start = torch.cat([p.detach().reshape(-1).double() for p in stepped.parameters()])
        adamw = torch.optim.AdamW(stepped.parameters(), lr=spec.lr, betas=spec.betas, weight_decay=0.01)
        optimizer = build_optimizer(optimizer_kind, adamw, stepped if spec.knows_model else None, options)
        noise = torch.Generator().manual_seed(seed + 1000)
        for x, y in batches:
            batch_gradients(model, spec.loss, x, y, halves)
            for p, master in zip(model.parameters(), stepped.parameters()):
                p.grad.mul_(1.0 + scale * torch.randn(p.shape, generator=noise).to(device))
                master.grad = p.grad.to(optimizer_dtype)
            optimizer.step()
            if stepped is not model:
                with torch.no_grad():
                    for p, master in zip(model.parameters(), stepped.parameters()):
                        p.copy_(master)
        finals.append(torch.cat([p.detach().reshape(-1).double() for p in stepped.parameters()]))
    return float((finals[1] - finals[0]).norm() / (finals[0] - start).norm())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DashConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", nargs="+", type=int, default=[defaults.root_order])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[defaults.epsilon])
    parser.add_argument("--frequencies", nargs="+", type=int, default=[defaults.precondition_frequency])
    parser.add_argument("--matmul-precisions", nargs="+", default=[defaults.matmul_precision])
    parser.add_argument("--methods", nargs="+", default=[defaults.inverse_root_method], help="inverse-root solvers")
    parser.add_argument("--grafting-norms", nargs="+", default=[defaults.grafting_norm], help="grafting norms")
    parser.add_argument("--eigh-dtypes", nargs="+", default=[defaults.eigh_dtype], help="eigh's decomposition dtypes")
    parser.add_argument("--lr-scales", nargs="+", type=float, default=[defaults.lr_scale], help="lr_scale values")
    parser.add_argument("--root-schedules", nargs="+", default=[defaults.root_schedule], help="root schedules")
    parser.add_argument("--preconditions", nargs="+", default=[defaults.precondition], help="routing rules")
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument(
        "--optimizer-dtype", nargs="+", default=["float32"], choices=["float32", "float64"], help="DASH's arithmetic"
    )
    parser.add_argument("--perturbations", nargs="+", default=["relative"], choices=PERTURBATIONS, help="what changes")
    parser.add_argument(
        "--optimizer",
        nargs="+",
        default=["dash"],
        choices=OPTIMIZERS,
        help="whose trajectories, each into the same record (adamw, muon: DASH's options unused)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", nargs="+", type=int, default=[10, 12])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "roundoff_cpu.json")
    return parser.parse_args(argv)


#: DASH's option axes, in the order of :func:`parse_args`'s flags, by option name.
DASH_AXES = {
    "root_order": "orders",
    "epsilon": "epsilons",
    "precondition_frequency": "frequencies",
    "matmul_precision": "matmul_precisions",
    "inverse_root_method": "methods",
    "precondition": "preconditions",
    "grafting_norm": "grafting_norms",
    "eigh_dtype": "eigh_dtypes",
    "lr_scale": "lr_scales",
    "root_schedule": "root_schedules",
}


def measure(kind: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """The records of one optimizer ``kind``: every candidate of DASH's option axes (none for a peer), every
    arithmetic, perturbation, network and step count, each the maximum change over ``--seeds`` seeds."""
    axes = [getattr(args, flag) if kind == "dash" else [None] for flag in DASH_AXES.values()]
    records = []
    for *values, dtype_name, perturbation in itertools.product(*axes, args.optimizer_dtype, args.perturbations):
        options = dict(zip(DASH_AXES, values))
        for network, steps in itertools.product(args.networks, args.steps):
            per_seed = [
                trajectory_change(
                    network,
                    options,
                    steps,
                    seed,
                    device=device,
                    optimizer_dtype=getattr(torch, dtype_name),
                    perturbation=perturbation,
                    optimizer_kind=kind,
                )
                for seed in range(args.seeds)
            ]
            records.append(
                {"optimizer": kind, **options, **stamp(device), "network": network, "steps": steps}
                | {"change": max(per_seed), "optimizer_dtype": dtype_name, "perturbation": perturbation}
                | {"per_seed": per_seed}
            )
    return records


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    records = [record for kind in args.optimizer for record in measure(kind, args, device)]
    header = ["optimizer", "root_order", "epsilon", "frequency", "precision", "solver", "routing", "grafting norm"]
    header += ["eigh", "lr_scale", "schedule", "arithmetic", "network", "steps", "perturbation", "change"]
    rows = [
        [r["optimizer"], str(r["root_order"]), "-" if r["epsilon"] is None else f"{r['epsilon']:.0e}"]
        + [str(r[name]) for name in ("precondition_frequency", "matmul_precision", "inverse_root_method")]
        + [str(r[name]) for name in ("precondition", "grafting_norm", "eigh_dtype", "lr_scale", "root_schedule")]
        + [r["optimizer_dtype"], r["network"], str(r["steps"]), r["perturbation"], f"{r['change']:.1e}"]
        for r in records
    ]
    print(format_columns(header, rows))
    write_json(args.out, records)
    return records


if __name__ == "__main__":
    main()
