"""How DASH's damping is chosen: validation loss and sensitivity to roundoff.

For every damping candidate (absolute ``1e-12``, the default before damping became
relative, and relative ``epsilon`` values) and solver, this script measures:

* **validation loss** of the main job's model (``make demo``: the stdlib byte-level
  TinyGPT, width 128, depth 2, context 128, batch 32, 800 steps, 5% warm-up then
  cosine, weight decay 0.01, DASH at the main job's lr 1.2e-2, block 256, roots every
  10 steps), trained with a plain PyTorch loop, one run per seed;
* **roundoff sensitivity**: a ``(20, 12)`` parameter (a factor of rank 12 in a 20 x 20
  block, as early steps and blocks wider than the batch give) trained for 10 steps
  with random gradients, once as is and once with every gradient multiplied by
  ``1 + 1e-7 * randn`` (the size of the difference between a one-rank and a two-rank
  gradient sum); reported is ``||p' - p|| / ||p - p0||``, the change relative to the
  parameters' movement, for roots every step and every 10 steps, maximum over seeds.

``defaults`` is whatever DASH is importable: run the script once more with
``PYTHONPATH`` pointing at a checkout of an older version (``--candidates defaults --tag
before``) to measure that version's defaults on the same runs.

Outputs ``damping_<device>[_<tag>].json`` in ``--out`` (default ``benchmarks/numerics/results``)
with one record per candidate: ``{"device", "label", "epsilon", "relative", "solver",
"val_loss" (per seed), "val_loss_mean", "sensitivity_f1", "sensitivity_f10",
"root_failures"}``, and prints a table.

Run from the repository root (each candidate takes 3 runs of 2-4 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/numerics/damping.py
    git worktree add /tmp/before v0.1 && PYTHONPATH=/tmp/before .venv/bin/python \
        benchmarks/numerics/damping.py --candidates defaults --tag before
    .venv/bin/python benchmarks/numerics/damping.py --steps 40 --seeds 0   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers
sys.path.append(str(Path(__file__).resolve().parents[1] / "races"))  # convergence.py: the main job's training run

from common import build_optimizer, device_label, markdown_table, resolve_device, write_json
from convergence import Settings, hyperparameters, train_run

from lightning_dash import DASH
from lightning_dash.showcase import load_stdlib_corpus

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

MAIN_JOB_LR = 1.2e-2


@dataclass(frozen=True)
class Candidate:
    """One damping setting with one solver, or (``solver=None``) the installed DASH's defaults."""

    epsilon: float | None
    relative: bool
    solver: str | None

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """``defaults`` or ``solver:relative|absolute:epsilon``, e.g. ``eigh:relative:1e-6``."""
        if text == "defaults":
            return cls(None, False, None)
        solver, kind, epsilon = text.split(":")
        return cls(float(epsilon), kind == "relative", solver)

    @property
    def label(self) -> str:
        if self.solver is None:
            return "defaults"
        kind = "relative" if self.relative else "absolute"
        return f"{self.solver} {kind} {self.epsilon:g}"

    def options(self) -> dict:
        if self.solver is None:
            return {}
        return dict(epsilon=self.epsilon, relative_epsilon=self.relative, inverse_root_method=self.solver)


CANDIDATES = ("defaults", "eigh:relative:1e-5", "eigh:relative:1e-7", "eigh:relative:1e-8", "newton_db:relative:1e-5")


def sensitivity(candidate: Candidate, frequency: int, seeds: range, steps: int = 10) -> float:
    """Largest ``||p' - p|| / ||p - p0||`` over seeds after ``steps`` steps (see the module doc)."""
    worst = 0.0
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randn(20, 12, generator=generator)
        grads = [torch.randn(20, 12, generator=generator) for _ in range(steps)]
        noise = [torch.randn(20, 12, generator=generator) for _ in range(steps)]
        finals = []
        for size in (0.0, 1e-7):
            param = torch.nn.Parameter(start.clone())
            optimizer = DASH([param], lr=1e-2, precondition_frequency=frequency, **candidate.options())
            for grad, wiggle in zip(grads, noise):
                param.grad = grad * (1.0 + size * wiggle)
                optimizer.step()
            finals.append(param.detach().clone())
        worst = max(worst, float((finals[1] - finals[0]).norm() / (finals[0] - start).norm()))
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=list(CANDIDATES),
        help="'defaults' or solver:relative|absolute:epsilon (default: %(default)s)",
    )
    parser.add_argument("--tag", default="", help="suffix of the JSON file, e.g. 'before' for an older checkout")
    args = parser.parse_args(argv)
    candidates = [Candidate.parse(text) for text in args.candidates]
    device = resolve_device(args.device)
    settings = Settings(
        steps=args.steps,
        warmup=max(1, args.steps // 20),
        context=128,
        eval_every=args.steps,
        eval_batches=16,
        corpus_bytes=4_000_000,
    )
    corpus = load_stdlib_corpus(max_bytes=settings.corpus_bytes)
    print(f"{device_label(device)}, torch {torch.__version__}, {torch.get_num_threads()} threads; {settings}")
    records, failures = [], {}
    start = time.perf_counter()
    losses: dict[Candidate, list[float]] = {c: [] for c in candidates}
    for seed in args.seeds:  # interleaved: every candidate once per seed, in turn
        for candidate in candidates:

            def build(name, model, lr, candidate=candidate, seed=seed):
                # convergence.py's DASH (block 256, roots every 10 steps) with the candidate's damping
                optimizer = build_optimizer(
                    name, model.parameters(), **hyperparameters(name, lr), **candidate.options()
                )
                failures[(candidate, seed)] = optimizer
                return optimizer

            run = train_run("dash", MAIN_JOB_LR, seed, corpus, settings, device, build=build)
            losses[candidate].append(run.final_val_loss)
            print(
                f"  seed {seed} {candidate.label:<28} val loss {run.final_val_loss:.4f} ({run.wall_s:.0f} s)",
                flush=True,
            )
    for candidate in candidates:
        record = {
            "device": device_label(device),
            "label": candidate.label + (f" ({args.tag})" if args.tag else ""),
            "epsilon": candidate.epsilon,
            "relative": candidate.relative,
            "solver": candidate.solver,
            "val_loss": losses[candidate],
            "val_loss_mean": statistics.mean(losses[candidate]),
            "sensitivity_f1": sensitivity(candidate, 1, range(3)),
            "sensitivity_f10": sensitivity(candidate, 10, range(3)),
            "root_failures": sum(failures[(candidate, s)].root_failure_count for s in args.seeds),
        }
        records.append(record)
    print(f"\n{len(candidates) * len(args.seeds)} runs in {time.perf_counter() - start:.0f} s\n")
    rows = []
    for record in records:
        per_seed = ", ".join(f"{v:.4f}" for v in record["val_loss"])
        rows.append(
            [
                record["label"],
                f"{record['val_loss_mean']:.4f} ({per_seed})",
                f"{record['sensitivity_f1']:.1e} / {record['sensitivity_f10']:.1e}",
                record["root_failures"],
            ]
        )
    print(
        markdown_table(
            ["damping", "val loss (mean; per seed)", "roundoff sensitivity f=1 / f=10", "root failures"], rows
        )
    )
    path = args.out / f"damping_{device_label(device)}{'_' + args.tag if args.tag else ''}.json"
    print(f"wrote {write_json(path, records, indent=1)}")


if __name__ == "__main__":
    main()
