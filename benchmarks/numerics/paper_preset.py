"""``DashConfig.paper()`` against the DASH authors' own code, in float64 on CPU.

The authors publish DASH in ``IST-DASLab/ISTA-DASLab-Optimizers`` (package ``dash``). Give this
script a checkout of it (``--authors-path``, the folder that holds ``ista_daslab_optimizers``);
nothing of it is in this project. Their package's ``__init__`` loads CUDA extensions, so only its
``dash`` subpackage is imported, under a stand-in parent package; ``triton`` and ``wandb`` are
replaced by stand-ins that are never called on this path (the Triton factor kernel is unused, the
16-bit Newton kernels and logging are off); ``DashLayerwise`` calls ``self.sync_params()``, a
method only its sibling class defines, after every step, which a one-process run does not need
(a no-op is attached when it is missing).

Two problems, as the paper preset's bars state them: a 256 x 512 matrix (least squares on 1,024
samples) over 20 steps, and an MLP 16-32-8 with biases (tanh, mean squared error, a new batch
each step) over 50 steps, each with weight decay. Both optimizers start from the same float64
weights and see the same gradients; the authors' ``DashLayerwise`` runs its eigendecomposition
roots (EVD, the only solver of theirs that stays in float64: the iterative ones scale by a bfloat16
power iteration). After every step, the distance between the two runs' parameters is divided by
the distance the authors' run moved from the start; the worst step is reported, beside the same
measure for the authors' run against itself with every gradient entry multiplied by
``1 + 1e-15 * noise`` (their own roundoff floor on the problem: how far roundoff alone moves it)
and for DASH's defaults (a different algorithm, for scale).

    python benchmarks/numerics/paper_preset.py --authors-path /path/to/ISTA-DASLab-Optimizers
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _stamp import stamp  # noqa: E402
from common import write_json  # noqa: E402

from lightning_dash import DASH, DashConfig  # noqa: E402

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

PACKAGE = "ista_daslab_optimizers"
#: The preset's bars: the largest distance to the authors' run, as a share of its movement.
BARS = {"matrix": 1e-8, "mlp": 1e-10}
#: The relative roundoff-level noise on each gradient entry that measures the authors' own floor.
JITTER = 1e-15

Gradients = Callable[[list[Tensor], int], Tensor]


def load_authors_dash(root: Path) -> types.ModuleType:
    """The authors' ``dash`` subpackage from ``root``, imported without its parent's CUDA extensions."""
    folder = root / PACKAGE
    if not (folder / "dash").is_dir():
        raise SystemExit(f"--authors-path: {folder / 'dash'} does not exist (give the repository's root)")
    parent = types.ModuleType(PACKAGE)
    parent.__path__ = [str(folder)]
    utils = types.ModuleType(f"{PACKAGE}.utils")
    utils.__path__ = [str(folder / "utils")]
    sys.modules.update({PACKAGE: parent, f"{PACKAGE}.utils": utils})

    def unavailable(*_: Any, **__: Any) -> None:
        raise RuntimeError("a Triton kernel was called: it has no CPU version")

    stand_ins = {
        f"{PACKAGE}.utils.triton_kernels": {"update_dash_preconditioner": unavailable},
        f"{PACKAGE}.utils.newton_schulz_triton": {"ns_line_1": unavailable, "ns_line_2": unavailable},
    }
    if importlib.util.find_spec("wandb") is None:
        stand_ins["wandb"] = {"log": lambda *_, **__: None, "Histogram": lambda *_, **__: None}
    for name, attributes in stand_ins.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules[name] = module
    dash = importlib.import_module(f"{PACKAGE}.dash")
    if not hasattr(dash.DashLayerwise, "sync_params"):
        dash.DashLayerwise.sync_params = lambda self: None
    return dash


def least_squares(seed: int = 1) -> tuple[list[Tensor], Gradients]:
    """A 256 x 512 weight and the gradient of ``||W X - Y||^2 / 2n`` over 1,024 samples."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 1024, generator=generator, dtype=torch.float64)
    y = torch.randn(256, 1024, generator=generator, dtype=torch.float64)
    weight = torch.randn(256, 512, generator=generator, dtype=torch.float64) / 512**0.5
    return [weight], lambda params, step: 0.5 * ((params[0] @ x - y) ** 2).sum() / x.shape[1]


def small_mlp(steps: int, seed: int = 2) -> tuple[list[Tensor], Gradients]:
    """An MLP 16-32-8 with biases (tanh), its mean squared error on a new batch each step."""
    generator = torch.Generator().manual_seed(seed)
    params: list[Tensor] = []
    for fan_in, fan_out in ((16, 32), (32, 8)):
        bound = fan_in**-0.5
        params += [
            torch.empty(fan_out, fan_in, dtype=torch.float64).uniform_(-bound, bound, generator=generator),
            torch.empty(fan_out, dtype=torch.float64).uniform_(-bound, bound, generator=generator),
        ]
    batches = [
        (torch.randn(32, 16, generator=generator, dtype=torch.float64), torch.randn(32, 8, generator=generator))
        for _ in range(steps)
    ]

    def loss(weights: list[Tensor], step: int) -> Tensor:
        x, target = batches[step - 1]
        hidden = torch.tanh(x @ weights[0].T + weights[1])
        return ((hidden @ weights[2].T + weights[3] - target.double()) ** 2).mean()

    return params, loss


def trajectory(
    make: Callable[[list[Tensor]], torch.optim.Optimizer],
    initial: list[Tensor],
    loss: Gradients,
    steps: int,
    jitter: float = 0.0,
) -> list[list[Tensor]]:
    """The parameters after each of ``steps`` steps of the optimizer ``make`` builds; ``jitter``
    multiplies every gradient entry by ``1 + jitter * noise`` (standard normal, seeded)."""
    params = [tensor.clone().requires_grad_(True) for tensor in initial]
    optimizer = make(params)
    generator = torch.Generator().manual_seed(7)
    out = []
    for step in range(1, steps + 1):
        grads = torch.autograd.grad(loss(params, step), params)
        for param, grad in zip(params, grads):
            noise = torch.randn(grad.shape, generator=generator, dtype=grad.dtype)
            param.grad = grad.detach() * (1 + jitter * noise)  # new: the authors' step writes into .grad
        optimizer.step()
        out.append([param.detach().clone() for param in params])
    return out


def worst_distance(ours: list[list[Tensor]], theirs: list[list[Tensor]], initial: list[Tensor]) -> float:
    """The largest ``||ours - theirs|| / ||theirs - initial||`` over the steps (all parameters flattened)."""
    flat = lambda tensors: torch.cat([t.reshape(-1) for t in tensors])  # noqa: E731
    start = flat(initial)
    return max(float((flat(a) - flat(b)).norm() / (flat(b) - start).norm()) for a, b in zip(ours, theirs, strict=True))


def compare(dash: types.ModuleType, name: str, block_size: int) -> dict[str, Any]:
    steps = 20 if name == "matrix" else 50
    initial, loss = least_squares() if name == "matrix" else small_mlp(steps)
    lr, weight_decay = (1e-2, 0.1)
    authors_config = dash.DashConfig(block_size=block_size, inv_root_method=dash.DashInverseRootMethodType.EVD)
    authors = lambda p: dash.DashLayerwise(p, lr=lr, weight_decay=weight_decay, config=authors_config)  # noqa: E731
    theirs = trajectory(authors, initial, loss, steps)
    jittered = trajectory(authors, initial, loss, steps, jitter=JITTER)
    preset = DashConfig.paper(block_size=block_size)
    ours = trajectory(lambda p: DASH(p, lr=lr, weight_decay=weight_decay, config=preset), initial, loss, steps)
    defaults = DashConfig(block_size=block_size)
    default = trajectory(lambda p: DASH(p, lr=lr, weight_decay=weight_decay, config=defaults), initial, loss, steps)
    distance = worst_distance(ours, theirs, initial)
    return {
        "problem": name,
        "shapes": [list(t.shape) for t in initial],
        "steps": steps,
        "block_size": block_size,
        "lr": lr,
        "weight_decay": weight_decay,
        "paper_preset_distance": distance,
        "bar": BARS[name],
        "within_bar": distance <= BARS[name],
        "authors_roundoff_floor": worst_distance(jittered, theirs, initial),
        "dash_defaults_distance": worst_distance(default, theirs, initial),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-path", type=Path, required=True, help="checkout of ISTA-DASLab-Optimizers")
    parser.add_argument("--authors-commit", help="the checkout's commit, recorded in the JSON")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "paper_preset_cpu.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dash = load_authors_dash(args.authors_path)
    rows = [compare(dash, "matrix", 256), compare(dash, "matrix", 512), compare(dash, "mlp", 8)]
    for row in rows:
        print(
            f"{row['problem']:6s} block {row['block_size']:4d}: DashConfig.paper() {row['paper_preset_distance']:.1e} "
            f"(bar {row['bar']:.0e}); the authors' own under 1e-15 gradient noise {row['authors_roundoff_floor']:.1e}; "
            f"DASH's defaults {row['dash_defaults_distance']:.1e} of the authors' movement"
        )
    record = {
        **stamp(torch.device("cpu")),
        "authors": {"repository": "IST-DASLab/ISTA-DASLab-Optimizers", "commit": args.authors_commit},
        "paper_preset": DashConfig.paper().changed(),
        "rows": rows,
    }
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
