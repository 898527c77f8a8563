"""Roundoff sensitivity of DASH's numerics: how far a 1e-7 relative gradient perturbation moves training.

Two ranks sum gradients in another order than one process does, which changes every gradient by
about 1e-7 of itself. A trajectory that amplifies that difference makes distributed runs disagree
with single-process ones for reasons that are not bugs, so the defaults must keep it small (the
project's goal: at most 1e-4 of the parameters' movement after 10 steps).

For each candidate (root order, damping ``epsilon``, refresh period, matmul precision, root solver) this
trains small networks with ``DASH.from_optimizer(AdamW)`` for ``--steps`` steps, once as is and once with every
gradient multiplied by ``1 + 1e-7 * randn``, and reports ``||p' - p|| / ||p - p0||`` over all
parameters, the maximum over ``--seeds`` (one torch thread, deterministic). Networks: the
multi-process tests' MLP (12 -> 40 -> 24 -> 3, tanh, batch 16, AdamW lr 0.02 with a step
schedule) and a residual MLP with LayerNorm (width 64, lr 3e-3).

    python benchmarks/roundoff.py                      # DASH's defaults and the candidates
    python benchmarks/roundoff.py --epsilons 1e-6 1e-4 1e-3 --orders 2 4 --frequencies 2 10
    python benchmarks/roundoff.py --matmul-precisions float32 tf32 --methods eigh newton_db   # TF32 emulated
    python benchmarks/roundoff.py --device cuda --matmul-precisions float32 tf32 --out roundoff_cuda.json

On the CPU, ``tf32`` is emulated (operands rounded to TF32, :mod:`lightning_dash.optim.precision`);
on CUDA it runs on the tensor cores.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, format_columns, write_json  # noqa: E402

from lightning_dash import DASH, DashConfig  # noqa: E402


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


#: name -> (network, AdamW lr)
NETWORKS = {"parity_mlp": (parity_mlp, 0.02), "residual_ln_mlp": (ResidualLayerNormMLP, 3e-3)}


def trajectory_change(
    network: str,
    options: dict[str, Any],
    steps: int,
    seed: int,
    size: float = 1e-7,
    device: torch.device | None = None,
) -> float:
    """``||p' - p|| / ||p - p0||`` after ``steps`` steps, ``p'`` trained on perturbed gradients."""
    build, lr = NETWORKS[network]
    device = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, 16, 12, generator=generator)
    y = torch.sin(2 * x[..., :3]) + 0.1 * torch.randn(steps, 16, 3, generator=generator)
    x, y = x.to(device), y.to(device)
    finals, start = [], None
    for perturbation in (0.0, size):
        torch.manual_seed(seed)
        model = build().to(device)
        start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        adamw = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
        optimizer = DASH.from_optimizer(adamw, **options)
        noise = torch.Generator().manual_seed(seed + 1000)
        for step in range(steps):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[step]), y[step]).backward()
            for p in model.parameters():
                p.grad.mul_(1.0 + perturbation * torch.randn(p.shape, generator=noise).to(device))
            optimizer.step()
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return float((finals[1] - finals[0]).norm() / (finals[0] - start).norm())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DashConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", nargs="+", type=int, default=[defaults.root_order])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[defaults.epsilon])
    parser.add_argument("--frequencies", nargs="+", type=int, default=[defaults.precondition_frequency])
    parser.add_argument("--matmul-precisions", nargs="+", default=[defaults.matmul_precision])
    parser.add_argument("--methods", nargs="+", default=[defaults.inverse_root_method], help="inverse-root solvers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", nargs="+", type=int, default=[10, 12])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "roundoff_cpu.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    records = []
    candidates = itertools.product(args.orders, args.epsilons, args.frequencies, args.matmul_precisions, args.methods)
    for order, epsilon, frequency, matmul_precision, method in candidates:
        options = {
            "root_order": order,
            "epsilon": epsilon,
            "precondition_frequency": frequency,
            "matmul_precision": matmul_precision,
            "inverse_root_method": method,
        }
        for network, steps in itertools.product(NETWORKS, args.steps):
            change = max(trajectory_change(network, options, steps, seed, device=device) for seed in range(args.seeds))
            records.append({**options, "device": device.type, "network": network, "steps": steps, "change": change})
    header = ["root_order", "epsilon", "frequency", "precision", "solver", "network", "steps", "change / movement"]
    rows = [
        [str(r["root_order"]), f"{r['epsilon']:.0e}", str(r["precondition_frequency"]), r["matmul_precision"]]
        + [r["inverse_root_method"], r["network"], str(r["steps"]), f"{r['change']:.1e}"]
        for r in records
    ]
    print(format_columns(header, rows))
    write_json(args.out, records)
    return records


if __name__ == "__main__":
    main()
